# mirrors the nanobind extension tensorrt_llm/bindings (cpp/tensorrt_llm/nanobind/bindings.cpp)
# (1.2.x): only its ``executor`` submodule is doubled.
from . import executor as executor

__all__ = ["executor"]
