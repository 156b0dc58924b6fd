# mirrors tensorrt_llm/__init__.py (1.2.x): ``from tensorrt_llm import LLM, SamplingParams``.
# Test double only: see tests/doubles/__init__.py (install_tensorrt_llm).
from . import bindings as bindings
from .llmapi import LLM
from .sampling_params import SamplingParams

__version__ = "1.2.1"

__all__ = ["LLM", "SamplingParams", "__version__"]
