"""Engines for the contract suite: echo, and both TensorRT-LLM adapters on the double."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import trtllm_worker.engine
from tests.doubles import FakeGpu, install_tensorrt_llm, release
from trtllm_worker.config import Settings
from trtllm_worker.engine.base import Engine, EngineOutput, EngineRequest
from trtllm_worker.engine.echo import EchoEngine
from trtllm_worker.tokenizer import load_tokenizer

POISON = FakeGpu.POISON_TOKEN
EngineFactory = Callable[..., Engine]


def install_double(monkeypatch: pytest.MonkeyPatch, version: str | None = None) -> FakeGpu:
    """The double installed as `tensorrt_llm` (imitating `version`, or the level
    TRTLLM_DOUBLE_RELEASE names); adapter modules re-imported against it."""
    fake = install_tensorrt_llm(monkeypatch, version)
    for name in ("trtllm_worker.engine.trtllm", "trtllm_worker.engine.trtllm_executor"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        # `from trtllm_worker.engine import trtllm` reads the package's attribute first:
        # without this a test would get the adapter bound to an earlier test's double
        monkeypatch.delattr(trtllm_worker.engine, name.rsplit(".", 1)[1], raising=False)
    return fake


EXECUTOR_ABSENT = (
    "TensorRT-LLM {version} has no C++ Executor (PR #16369): the trtllm-executor adapter is "
    "for 1.2 and earlier (test_executor_adapter_stops_without_an_executor holds its refusal)"
)


def skip_executor_without_executor(kind: str, gpu: FakeGpu) -> None:
    """The Executor adapter's tests run on the 1.2 level only."""
    if kind == "trtllm-executor" and release(gpu.version) >= (1, 4):
        pytest.skip(EXECUTOR_ABSENT.format(version=gpu.version))


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> FakeGpu:
    """The double at the test's `release` mark, else at the level TRTLLM_DOUBLE_RELEASE
    names (`make test` runs tests/engines at both)."""
    marker = request.node.get_closest_marker("release")
    return install_double(monkeypatch, marker.args[0] if marker else None)


def trtllm_settings(tmp_path: Path, engine: str, **overrides: Any) -> Settings:
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir(exist_ok=True)
    config = {"pretrained_config": {"mapping": {"world_size": overrides.pop("world_size", 1)}}}
    (engine_dir / "config.json").write_text(json.dumps(config))
    values: dict[str, Any] = {
        "engine": engine,
        "model": tmp_path,
        "engine_dir": engine_dir,
        "tokenizer": tmp_path / "tokenizer.json",
        "max_batch": 64,
        "engine_cancel_timeout_s": 0.5,
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)


def create_trtllm(settings: Settings) -> Engine:
    tokenizer = load_tokenizer(None, None)
    if settings.engine == "trtllm":
        from trtllm_worker.engine import trtllm

        return trtllm.create(settings, tokenizer)
    from trtllm_worker.engine import trtllm_executor

    return trtllm_executor.create(settings, tokenizer)


@pytest.fixture(
    params=[
        "echo",
        "echo:3-per-step",
        "trtllm",
        "trtllm-executor",
        "trtllm:3-per-step",
        "trtllm-executor:3-per-step",
    ]
)
def make_engine(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[EngineFactory]:
    """`make_engine(capacity=64)` builds the engine under test; shut down afterwards.
    `:3-per-step`: the engine (the echo engine, or the double) hands over three tokens
    per request per iteration, as speculative decoding and MTP do."""
    kind, _, variant = str(request.param).partition(":")
    engines: list[Engine] = []
    if kind != "echo":
        gpu = install_double(monkeypatch)
        skip_executor_without_executor(kind, gpu)
        gpu.step_s = 0.001
        gpu.tokens_per_step = 3 if variant else 1

    def make(capacity: int = 64, **settings: Any) -> Engine:
        """`settings`: worker settings for the TensorRT-LLM adapters (echo: ignored)."""
        engine: Engine
        if kind == "echo":
            engine = EchoEngine(
                capacity=capacity,
                step_s=0.001,
                tokens_per_step=3 if variant else 1,
                fault_token=POISON,
            )
        else:
            engine = create_trtllm(trtllm_settings(tmp_path, kind, max_batch=capacity, **settings))
        engines.append(engine)
        return engine

    make.kind = kind  # type: ignore[attr-defined]
    yield make
    for engine in engines:
        with contextlib.suppress(RuntimeError):  # already shut down by the test
            engine.shutdown()


def drive(
    engine: Engine, requests: list[EngineRequest], limit_s: float = 15.0
) -> dict[int, list[EngineOutput]]:
    """Enqueue, then wait as the looper does until every request has its final output."""
    outputs: dict[int, list[EngineOutput]] = {r.id: [] for r in requests}
    for request in requests:
        engine.enqueue(request)
    collect(engine, outputs, limit_s)
    return outputs


def collect(engine: Engine, outputs: dict[int, list[EngineOutput]], limit_s: float = 15.0) -> None:
    deadline = time.monotonic() + limit_s
    while any(not o or not o[-1].final for o in outputs.values()):
        assert time.monotonic() < deadline, "the engine did not finish the requests in time"
        for output in engine.wait(0.05):
            assert not (outputs[output.id] and outputs[output.id][-1].final), "output after final"
            outputs[output.id].append(output)


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]
