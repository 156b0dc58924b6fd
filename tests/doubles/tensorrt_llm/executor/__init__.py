# mirrors tensorrt_llm/executor/__init__.py (1.2.x): the names the worker may import.
from .request import LoRARequest
from .result import CompletionOutput, GenerationResult, IterationResult, Logprob
from .utils import RequestError

__all__ = [
    "CompletionOutput",
    "GenerationResult",
    "IterationResult",
    "LoRARequest",
    "Logprob",
    "RequestError",
]
