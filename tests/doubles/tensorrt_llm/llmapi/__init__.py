# mirrors tensorrt_llm/llmapi/__init__.py: the names the worker may import. Both lines
# export GuidedDecodingParams, LoRARequest, RequestError, SamplingParams and
# SchedulerConfig (1.4: @ 1f064c467a211b4168555ca06bb9b801c64eae20; 1.2: the 1.2-era
# file exports GuidedDecodingParams, LoRARequest and SchedulerConfig as every 1.x version
# read does, but its exact list at the 1.2.1 tag could not be read here).
# SchedulingParams is exported on 1.4 (@ 1f064c46); whether 1.2.1 exports it was not
# verified, so the 1.2 double leaves it out.
from tests.doubles import fake_gpu

from ..executor import CompletionOutput, LoRARequest, RequestError
from ..executor.params.sampling import GuidedDecodingParams, SamplingParams
from .llm import LLM, RequestOutput
from .llm_args import KvCacheConfig, SchedulerConfig

__all__ = [
    "LLM",
    "CompletionOutput",
    "GuidedDecodingParams",
    "KvCacheConfig",
    "LoRARequest",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]

if fake_gpu.line() >= (1, 4):
    from ..executor.params.scheduling import SchedulingParams

    __all__ += ["SchedulingParams"]
