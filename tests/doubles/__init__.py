"""Test double of the parts of TensorRT-LLM that the worker's adapters use, at two API
levels: 1.2.x (the newest stable line) and the 1.4 line (1.4.0rc1 on PyPI; modelled from
1.4-era main, NVIDIA/TensorRT-LLM @ 1f064c467a211b4168555ca06bb9b801c64eae20, and the
files each behaviour cites). One double with version branches, not a copy.

The level is `install_tensorrt_llm(version=...)`, or, when a test passes none, the
environment variable ``TRTLLM_DOUBLE_RELEASE`` (default ``1.2.1``; ``1.4.0rc1`` for the
1.4 level): `make test` runs the engine contract suite and the double's own tests once
per level. A test that holds for one line only passes its version explicitly.

``install_tensorrt_llm(monkeypatch)`` makes ``import tensorrt_llm`` (and its submodules) resolve
to ``tests/doubles/tensorrt_llm`` for one test and returns the :class:`FakeGpu` behind it.
monkeypatch undoes everything: sys.path, the ``tensorrt_llm*`` entries of ``sys.modules`` and
the current FakeGpu.  Each install imports the double afresh.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

from tests.doubles import fake_gpu
from tests.doubles.fake_gpu import FakeGpu, release

__all__ = ["DEFAULT_RELEASE", "RELEASE_VARIABLE", "FakeGpu", "install_tensorrt_llm", "release"]

RELEASE_VARIABLE = "TRTLLM_DOUBLE_RELEASE"
DEFAULT_RELEASE = "1.2.1"

_MODULES = (
    "tensorrt_llm",
    "tensorrt_llm.bindings",
    "tensorrt_llm.bindings.executor",
    "tensorrt_llm.executor",
    "tensorrt_llm.executor.params",
    "tensorrt_llm.executor.params.sampling",
    "tensorrt_llm.executor.result",
    "tensorrt_llm.executor.utils",
    "tensorrt_llm.llmapi",
    "tensorrt_llm.llmapi.llm",
    "tensorrt_llm.llmapi.llm_args",
    "tensorrt_llm.llmapi.utils",
)
_LEGACY_MODULES = ("tensorrt_llm.sampling_params",)
"""Imported at install only below 1.4: on 1.4 `tensorrt_llm.sampling_params` is a
forwarding module that warns when imported (see the double's sampling_params.py)."""


def install_tensorrt_llm(monkeypatch: pytest.MonkeyPatch, version: str | None = None) -> FakeGpu:
    """`version` picks the release the double imitates where releases differ in a way the
    adapters must cope with ("1.2.1"; "1.4.0rc1": priority and trace_headers in
    `generate_async`, RequestError, the 1.4 config fields, no C++ `Executor`). None: the
    ``TRTLLM_DOUBLE_RELEASE`` environment variable, else 1.2.1."""
    if version is None:
        version = os.environ.get(RELEASE_VARIABLE, "").strip() or DEFAULT_RELEASE
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        monkeypatch.delitem(sys.modules, name)  # a real or stale copy must not shadow the double
    gpu = FakeGpu()
    gpu.version = version
    monkeypatch.setattr(fake_gpu, "_current", gpu)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    legacy = _LEGACY_MODULES if release(version) < (1, 4) else ()
    for name in (*_MODULES, *legacy):
        importlib.import_module(name)
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        module = sys.modules.pop(name)
        monkeypatch.setitem(sys.modules, name, module)  # recorded as absent: removed on undo
    return gpu
