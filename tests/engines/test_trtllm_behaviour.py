"""The adapters against TensorRT-LLM 1.2 as it really behaves (the double follows its
source: tests/doubles): a cancel of a request the engine still has queued, statistics
of an idle engine, several tokens per step."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from tests.doubles import FakeGpu, release
from tests.engines.conftest import (
    collect,
    create_trtllm,
    drive,
    install_double,
    skip_executor_without_executor,
    tokens_of,
    trtllm_settings,
)
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.engine.base import Engine, EngineOutput, EngineRequest, FinishReason, Sampling

KINDS = ["trtllm", "trtllm-executor"]


def long_request(request_id: int, token: int) -> EngineRequest:
    return EngineRequest(id=request_id, prompt_ids=[token], max_new_tokens=100_000)


def until_final(
    engine: Engine, outputs: dict[int, list[EngineOutput]], request_id: int, limit_s: float = 5
) -> None:
    """Wait as the looper does until `request_id` has its final output (keeping the
    others' outputs)."""
    deadline = time.monotonic() + limit_s
    while not (outputs[request_id] and outputs[request_id][-1].final):
        assert time.monotonic() < deadline, "no final output in time"
        for output in engine.wait(0.05):
            outputs.setdefault(output.id, []).append(output)


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancel_of_a_request_the_engine_queued_ends_it(
    gpu: FakeGpu, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine queues on its own (KV-cache pressure: one request at a time) while
    the worker counts two running. The queued one's cancel ends its stream, cancelled
    and without tokens, within the cancel timeout; the slot is free again."""
    skip_executor_without_executor(kind, gpu)
    gpu.step_s = 0.002
    gpu.kv_cache_requests = 1
    engine = create_trtllm(trtllm_settings(tmp_path, kind, engine_cancel_timeout_s=0.3))
    try:
        engine.enqueue(long_request(1, 5))
        engine.enqueue(long_request(2, 6))
        outputs: dict[int, list[EngineOutput]] = {1: [], 2: []}
        while not outputs[1]:
            for output in engine.wait(0.05):
                outputs[output.id].append(output)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            engine.cancel(2)
            until_final(engine, outputs, 2)
        assert time.monotonic() - started < 2
        assert outputs[2][-1].finish is FinishReason.CANCELLED
        assert tokens_of(outputs[2]) == []
        engine.cancel(1)
        until_final(engine, outputs, 1)
        assert outputs[1][-1].finish is FinishReason.CANCELLED
        assert tokens_of(outputs[1])  # it ran: what it generated is kept
    finally:
        engine.shutdown()
    if kind == "trtllm":  # the LLM API never answers: the adapter ended it itself
        assert "no final output" in caplog.text


@pytest.mark.parametrize("kind", KINDS)
def test_a_running_request_ends_by_the_engines_own_answer(
    gpu: FakeGpu, tmp_path: Path, kind: str
) -> None:
    """With a long cancel timeout, a running request still ends at once: the engine's
    final `cancelled` output, not the adapter's timer."""
    skip_executor_without_executor(kind, gpu)
    gpu.step_s = 0.002
    engine = create_trtllm(trtllm_settings(tmp_path, kind, engine_cancel_timeout_s=600))
    try:
        engine.enqueue(long_request(1, 5))
        outputs: dict[int, list[EngineOutput]] = {1: []}
        while not outputs[1]:
            outputs[1] += engine.wait(0.05)
        engine.cancel(1)
        collect(engine, outputs, limit_s=5)
    finally:
        engine.shutdown()
    assert outputs[1][-1].finish is FinishReason.CANCELLED


def test_llm_api_statistics_never_block_and_read_zero_when_idle(
    gpu: FakeGpu, tmp_path: Path
) -> None:
    gpu.step_s = 0.002
    engine = create_trtllm(trtllm_settings(tmp_path, "trtllm"))
    try:
        engine.enqueue(long_request(1, 5))
        outputs: dict[int, list[EngineOutput]] = {1: []}
        deadline = time.monotonic() + 5
        busy = engine.stats()
        while busy.active_requests != 1:
            assert time.monotonic() < deadline, "no statistics while busy"
            outputs[1] += engine.wait(0.05)
            started = time.perf_counter()
            busy = engine.stats()
            assert time.perf_counter() - started < 0.01  # a cached read, not a fetch
        engine.cancel(1)
        collect(engine, outputs, limit_s=5)
        idle = engine.stats()
    finally:
        engine.shutdown()
    assert (idle.active_requests, idle.queued_requests) == (0, 0)
    assert busy.kv_cache_max_blocks == gpu.max_num_blocks


@pytest.fixture
def gpu_1_2(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    """The double as 1.2.1, whatever TRTLLM_DOUBLE_RELEASE says: WORKER_SAMPLER's 1.2 role."""
    return install_double(monkeypatch, "1.2.1")


@pytest.fixture
def gpu_1_4(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    return install_double(monkeypatch, "1.4.0rc1")


def test_the_default_sampler_honours_seed_and_penalties(gpu_1_2: FakeGpu, tmp_path: Path) -> None:
    engine = create_trtllm(trtllm_settings(tmp_path, "trtllm"))
    engine.shutdown()
    assert gpu_1_2.llm_kwargs[-1]["sampler_type"] == "TRTLLMSampler"
    assert engine.limits.ignored_parameters == {}


@pytest.mark.parametrize("sampler", ["TorchSampler", "auto"])
def test_torch_sampler_parameters_it_ignores_are_refused(
    gpu_1_2: FakeGpu, tmp_path: Path, sampler: str
) -> None:
    """1.2's TorchSampler accepts seed and the penalties and ignores them: jobs giving
    them are refused at intake (see test_inputs.py), each naming why."""
    engine = create_trtllm(trtllm_settings(tmp_path, "trtllm", sampler=sampler))
    engine.shutdown()
    ignored = engine.limits.ignored_parameters
    assert sorted(ignored) == [
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "seed",
    ]
    assert f"WORKER_SAMPLER={sampler}" in ignored["seed"]


def test_a_sampler_in_the_extra_options_must_agree(gpu_1_2: FakeGpu, tmp_path: Path) -> None:
    extra = tmp_path / "extra.json"
    extra.write_text('{"sampler_type": "TorchSampler"}')
    with pytest.raises(ConfigError, match="sampler_type: TorchSampler, but WORKER_SAMPLER"):
        create_trtllm(trtllm_settings(tmp_path, "trtllm", llm_extra_options=extra))


@pytest.mark.parametrize(
    ("sampler", "published"), [("TRTLLMSampler", True), ("TorchSampler", False)]
)
def test_logprob_is_the_sampled_tokens_own_or_absent(
    gpu_1_2: FakeGpu, tmp_path: Path, sampler: str, published: bool
) -> None:
    """Under sampling, TorchSampler's top-1 log probability is the most likely token's,
    not the sampled one's: the adapter publishes none rather than a wrong one."""
    engine = create_trtllm(trtllm_settings(tmp_path, "trtllm", sampler=sampler))
    sampled = EngineRequest(
        id=1,
        prompt_ids=[5, 6],
        max_new_tokens=4,
        sampling=Sampling(do_sample=True, temperature=0.8, top_k=50),
        return_logprobs=True,
    )
    try:
        outputs = drive(engine, [sampled])[1]
    finally:
        engine.shutdown()
    logprobs = [p for o in outputs for p in (o.logprobs or [])]
    assert len(logprobs) == 4
    if published:
        assert all(p == gpu_1_2.logprob for p in logprobs)
    else:
        assert logprobs == [None] * 4


def test_shutdown_is_prompt_when_the_stats_queue_loses_the_cancel(
    tmp_path: Path, gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.11's `asyncio.wait_for`, inside the LLM API's stats queue, can lose a
    cancel (CPython gh-86296); with requests running, statistics keep coming, so every
    later cancel could be lost too, and the adapter retried for 10 s (the contract
    suite's shutdown test failed now and then at its 5 s limit). The follower now ends
    by itself once the adapter closes. Here the stats iterator swallows every cancel."""
    import asyncio
    from collections.abc import AsyncIterator
    from typing import Any

    from tensorrt_llm import LLM

    swallowed = 0
    following = threading.Event()

    async def stubborn_stats(self: Any, timeout: float | None = 2) -> AsyncIterator[str]:  # noqa: ASYNC109 (the real signature)
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                swallowed += 1  # lost, as gh-86296 loses it
            following.set()
            yield '{"iterLatencyMS": 1.0}'

    monkeypatch.setattr(LLM, "get_stats_async", stubborn_stats)
    engine = create_trtllm(trtllm_settings(tmp_path, "trtllm"))
    assert following.wait(5)
    started = time.monotonic()
    engine.shutdown()
    assert swallowed >= 1  # the fault happened: the cancel was lost
    assert time.monotonic() - started < 2


def test_shutdown_leaves_no_task_pending_on_the_private_loop(tmp_path: Path, gpu: FakeGpu) -> None:
    """The LLM API adapter's statistics task is cancelled and awaited when the adapter
    closes: one left pending is destroyed with its loop ('Task was destroyed but it is
    pending!'), a warning that surfaced in a later test of the suite (CI)."""
    import asyncio

    from trtllm_worker.engine.trtllm import LlmApiEngine

    engine = create_trtllm(trtllm_settings(tmp_path, "trtllm"))
    assert isinstance(engine, LlmApiEngine)

    async def close_and_look() -> list[asyncio.Task[object]]:
        await engine._close()
        current = asyncio.current_task()
        return [t for t in asyncio.all_tasks() if t is not current and not t.done()]

    try:
        assert asyncio.run_coroutine_threadsafe(close_and_look(), engine._loop).result(10) == []
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("sampler", "max_top"), [("TRTLLMSampler", 0), ("TorchSampler", 20), ("auto", 20)]
)
def test_llm_api_top_logprobs_where_the_sampler_returns_them(
    gpu_1_2: FakeGpu, tmp_path: Path, sampler: str, max_top: int
) -> None:
    """1.2's TRTLLMSampler returns only the sampled token's log probability: the limits
    say 0 and why, so intake refuses `top_logprobs` rather than publish one pair."""
    engine = create_trtllm(trtllm_settings(tmp_path, "trtllm", sampler=sampler))
    try:
        assert engine.limits.max_top_logprobs == max_top
        if not max_top:
            assert "WORKER_SAMPLER=TorchSampler" in engine.limits.top_logprobs_why
    finally:
        engine.shutdown()


def test_llm_api_top_logprobs_under_sampling_need_not_hold_the_sampled_token(
    gpu: FakeGpu, tmp_path: Path
) -> None:
    """TorchSampler ranks the log-softmax before temperature and top-k/top-p: sampled,
    the top K are the model's most likely tokens, which may leave out the sampled one;
    they are published as given, by rank. On 1.2 the sampled token's `logprob` is then
    absent; the 1.4 line adds the sampled token to the top K at its own rank, so its
    `logprob` is published while `top_logprobs` stays K long."""
    engine = create_trtllm(trtllm_settings(tmp_path, "trtllm", sampler="TorchSampler"))
    sampled = EngineRequest(
        id=1,
        prompt_ids=[5, 6],
        max_new_tokens=2,
        sampling=Sampling(do_sample=True, temperature=0.8),
        return_logprobs=True,
        top_logprobs=3,
    )
    try:
        outputs = drive(engine, [sampled])[1]
    finally:
        engine.shutdown()
    lp = gpu.logprob
    tops = [top for o in outputs for top in (o.top_logprobs or [])]
    assert tops == [
        [(t + 1000, lp), (t + 1001, lp - 1), (t + 1002, lp - 2)] for t in tokens_of(outputs)
    ]
    sampled_own = [lp - 3] * 2 if release(gpu.version) >= (1, 4) else [None, None]
    assert [p for o in outputs for p in (o.logprobs or [])] == sampled_own


def test_llm_api_top_logprobs_are_ordered_by_rank_and_cut_at_k(gpu: FakeGpu) -> None:
    """A mapping in any order, or with more than K (a line that adds the sampled token
    at its own rank), gives the K best ranks, rank 1 first."""
    from tensorrt_llm.executor.result import Logprob

    from trtllm_worker.engine.trtllm import _top_logprobs

    diff = [{9: Logprob(-3.0, rank=57), 7: Logprob(-1.0, rank=2), 8: Logprob(-0.5, rank=1)}]
    assert _top_logprobs(diff, 2) == [[(8, -0.5), (7, -1.0)]]
    assert _top_logprobs([], 2) is None


def test_on_1_4_no_sampler_type_is_passed_and_top_logprobs_come_from_torch_sampler(
    gpu_1_4: FakeGpu, tmp_path: Path
) -> None:
    """The 1.4 line has TorchSampler only (PR #18232): no sampler_type is passed, top
    logprobs are available, and since TorchSampler applies the penalties there
    (PR #16485) only a seed is refused: it is honoured only for a request sampled alone
    (PR #17172's seed_manager.py)."""
    engine = create_trtllm(trtllm_settings(tmp_path, "trtllm"))
    engine.shutdown()
    assert "sampler_type" not in gpu_1_4.llm_kwargs[-1]
    assert engine.limits.max_top_logprobs == 20
    assert sorted(engine.limits.ignored_parameters) == ["seed"]
    assert "sampled alone" in engine.limits.ignored_parameters["seed"]


def test_on_1_4_worker_sampler_trtllm_is_one_line_at_start(
    gpu_1_4: FakeGpu, tmp_path: Path
) -> None:
    """An operator's WORKER_SAMPLER=TRTLLMSampler would be the LLM's refusal (a
    traceback); the worker says in one line what to do instead, before loading."""
    with pytest.raises(ConfigError) as raised:
        create_trtllm(trtllm_settings(tmp_path, "trtllm", sampler="TRTLLMSampler"))
    message = str(raised.value)
    assert message.startswith("invalid setting WORKER_SAMPLER=TRTLLMSampler: TensorRT-LLM 1.4.0rc1")
    assert "unset WORKER_SAMPLER" in message
    assert "\n" not in message
    assert gpu_1_4.llm_kwargs == []


def test_on_1_4_worker_sampler_torch_is_said_and_not_passed(
    gpu_1_4: FakeGpu, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="trtllm_worker.engine.trtllm"):
        create_trtllm(trtllm_settings(tmp_path, "trtllm", sampler="TorchSampler")).shutdown()
    assert "sampler_type" not in gpu_1_4.llm_kwargs[-1]
    assert "has TorchSampler only" in caplog.text


def test_an_extra_options_sampler_type_goes_to_a_1_4_llm_as_written(
    gpu_1_4: FakeGpu, tmp_path: Path
) -> None:
    """WORKER_SAMPLER decides nothing there: no conflict with it is claimed; the LLM takes
    "TorchSampler" (ignored) and refuses "TRTLLMSampler", which is one line."""
    extra = tmp_path / "extra.json"
    extra.write_text('{"sampler_type": "TorchSampler"}')
    with pytest.warns(UserWarning, match="ignored"):
        create_trtllm(trtllm_settings(tmp_path, "trtllm", llm_extra_options=extra)).shutdown()
    assert gpu_1_4.llm_kwargs[-1]["sampler_type"] == "TorchSampler"
    extra.write_text('{"sampler_type": "TRTLLMSampler"}')
    with pytest.raises(ConfigError, match=r"refuses the LLM arguments: .*TRTLLMSampler"):
        create_trtllm(trtllm_settings(tmp_path, "trtllm", llm_extra_options=extra))


def test_on_the_deprecated_field_a_sampler_is_passed_only_when_set(
    gpu_1_4: FakeGpu, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Between the deprecation and the removal (1.3.0rc2x, main @ 1f064c46) the field
    exists, deprecated: it is passed only when the operator set WORKER_SAMPLER."""
    from trtllm_worker.engine import trtllm

    default = trtllm_settings(tmp_path, "trtllm")
    assert trtllm.sampler_options(default, "deprecated") == {}
    assert trtllm.sampler_options(default, "selectable") == {"sampler_type": "TRTLLMSampler"}
    chosen = trtllm_settings(tmp_path, "trtllm", sampler="TRTLLMSampler")
    with caplog.at_level(logging.WARNING, logger="trtllm_worker.engine.trtllm"):
        assert trtllm.sampler_options(chosen, "deprecated") == {"sampler_type": "TRTLLMSampler"}
    assert "sampler_type is deprecated" in caplog.text
