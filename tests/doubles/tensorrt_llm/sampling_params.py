"""mirrors tensorrt_llm/sampling_params.py.

1.2.x: the module that defines SamplingParams and GuidedDecodingParams (the double
defines them in executor/params/sampling.py and re-exports them here, unchanged).

1.4 line: a forwarding module kept at the pre-move path. A test of 1.4-era main
(tests/unittest/..., "The compatibility modules kept at the pre-move request-contract
paths"; its commit could not be identified here) holds that importing it raises exactly
one warning naming both tensorrt_llm.sampling_params and
tensorrt_llm.executor.params.sampling, and that the names are the same objects; it
deliberately does not pin the warning's category. The double warns with a
DeprecationWarning: the category is an assumption, not read from the source."""

import warnings

from tests.doubles import fake_gpu

from .executor.params.sampling import GuidedDecodingParams, SamplingParams

if fake_gpu.line() >= (1, 4):
    warnings.warn(
        "tensorrt_llm.sampling_params is deprecated; import from "
        "tensorrt_llm.executor.params.sampling instead",
        DeprecationWarning,
        stacklevel=2,
    )

__all__ = ["GuidedDecodingParams", "SamplingParams"]
