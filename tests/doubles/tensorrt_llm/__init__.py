# mirrors tensorrt_llm/__init__.py (1.2.x): ``from tensorrt_llm import LLM, SamplingParams``.
# Test double only: see tests/doubles/__init__.py (install_tensorrt_llm).
from tests.doubles import fake_gpu

from . import bindings as bindings
from .llmapi import LLM, SamplingParams  # llmapi first: it imports executor in turn

__version__ = fake_gpu.current().version  # "1.2.1" unless installed as another release

__all__ = ["LLM", "SamplingParams", "__version__"]
