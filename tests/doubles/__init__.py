"""Test double of the parts of TensorRT-LLM 1.2.x that the worker's adapters use (and,
by `version`, of the 1.4 `generate_async`).

``install_tensorrt_llm(monkeypatch)`` makes ``import tensorrt_llm`` (and its submodules) resolve
to ``tests/doubles/tensorrt_llm`` for one test and returns the :class:`FakeGpu` behind it.
monkeypatch undoes everything: sys.path, the ``tensorrt_llm*`` entries of ``sys.modules`` and
the current FakeGpu.  Each install imports the double afresh.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tests.doubles import fake_gpu
from tests.doubles.fake_gpu import FakeGpu

__all__ = ["FakeGpu", "install_tensorrt_llm"]

_MODULES = (
    "tensorrt_llm",
    "tensorrt_llm.bindings",
    "tensorrt_llm.bindings.executor",
    "tensorrt_llm.executor",
    "tensorrt_llm.executor.result",
    "tensorrt_llm.executor.utils",
    "tensorrt_llm.llmapi",
    "tensorrt_llm.llmapi.llm",
    "tensorrt_llm.llmapi.llm_args",
    "tensorrt_llm.llmapi.utils",
    "tensorrt_llm.sampling_params",
)


def install_tensorrt_llm(monkeypatch: pytest.MonkeyPatch, version: str = "1.2.1") -> FakeGpu:
    """`version` picks the release the double imitates where releases differ in a way the
    adapters must cope with: "1.4.0" gives `LLM.generate_async` its `priority` keyword."""
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        monkeypatch.delitem(sys.modules, name)  # a real or stale copy must not shadow the double
    gpu = FakeGpu()
    gpu.version = version
    monkeypatch.setattr(fake_gpu, "_current", gpu)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    for name in _MODULES:
        importlib.import_module(name)
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        module = sys.modules.pop(name)
        monkeypatch.setitem(sys.modules, name, module)  # recorded as absent: removed on undo
    return gpu
