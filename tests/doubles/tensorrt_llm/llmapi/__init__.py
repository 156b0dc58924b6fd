# mirrors tensorrt_llm/llmapi/__init__.py (1.2.x): the names the worker may import.
from ..executor import CompletionOutput, LoRARequest, RequestError
from ..sampling_params import SamplingParams
from .llm import LLM, RequestOutput
from .llm_args import KvCacheConfig

__all__ = [
    "LLM",
    "CompletionOutput",
    "KvCacheConfig",
    "LoRARequest",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]
