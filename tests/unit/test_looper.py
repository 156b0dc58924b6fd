"""The looper: one thread owns the engine; outputs come back to the event loop one batch
per wake-up. The sink below plays the runner's part: it takes each batch on the event loop
and tells the looper it was consumed."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import pytest

import trtllm_worker.engine.looper
from trtllm_worker.engine.base import (
    Engine,
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
)
from trtllm_worker.engine.echo import EchoEngine
from trtllm_worker.engine.looper import EngineStalled, Looper

TIMEOUT_S = 5.0


class Sink:
    """Collects what the looper hands to the event loop, as the runner does."""

    def __init__(self, *, auto_consume: bool = True) -> None:
        self.looper: Looper | None = None
        self.auto_consume = auto_consume
        self.batches: list[list[EngineOutput]] = []
        self.unconsumed = 0
        self.outputs: dict[int, list[EngineOutput]] = defaultdict(list)
        self.finals: Counter[int] = Counter()
        self.deaths: list[BaseException] = []
        self.callback_threads: set[int] = set()
        self._changed = asyncio.Event()

    def on_outputs(self, outputs: list[EngineOutput], emitted_at: float = 0.0) -> None:
        self.callback_threads.add(threading.get_ident())
        self.batches.append(outputs)
        for output in outputs:
            self.outputs[output.id].append(output)
            if output.final:
                self.finals[output.id] += 1
        self.unconsumed += 1
        if self.auto_consume:
            self.consume()
        self._changed.set()

    def on_death(self, exc: BaseException) -> None:
        self.callback_threads.add(threading.get_ident())
        self.deaths.append(exc)
        self._changed.set()

    def consume(self) -> None:
        assert self.looper is not None
        self.looper.consumed(self.unconsumed)
        self.unconsumed = 0

    def tokens(self, request_id: int) -> list[int]:
        return [token for output in self.outputs[request_id] for token in output.token_ids]

    def final(self, request_id: int) -> EngineOutput | None:
        outputs = self.outputs.get(request_id)
        return outputs[-1] if outputs and outputs[-1].final else None

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait, event-driven, until a callback made `predicate` true."""

        async def watch() -> None:
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(watch(), TIMEOUT_S)


class StartLooper(Protocol):
    def __call__(self, engine: Engine, sink: Sink) -> Looper: ...


@pytest.fixture
async def start_looper() -> AsyncIterator[StartLooper]:
    """Start loopers on the test's event loop; stop them (joining their thread) after it."""
    started: list[Looper] = []

    def start(engine: Engine, sink: Sink) -> Looper:
        looper = Looper(engine, asyncio.get_running_loop(), sink.on_outputs, sink.on_death)
        sink.looper = looper
        looper.start()
        started.append(looper)
        return looper

    yield start
    for looper in started:
        await asyncio.to_thread(looper.stop, TIMEOUT_S)
        assert not looper.alive


class RecordingEngine:
    """Delegates to an echo engine and records how the looper drives it."""

    def __init__(self, inner: EchoEngine, *, wait_error: BaseException | None = None) -> None:
        self.inner = inner
        self.wait_error = wait_error
        self.waits = 0
        self.shutdown_threads: list[str] = []
        self.calls_after_shutdown: list[str] = []

    def _record(self, name: str) -> None:
        if self.shutdown_threads:
            self.calls_after_shutdown.append(name)

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def limits(self) -> EngineLimits:
        return self.inner.limits

    def enqueue(self, request: EngineRequest) -> None:
        self._record("enqueue")
        self.inner.enqueue(request)

    def cancel(self, request_id: int) -> None:
        self._record("cancel")
        self.inner.cancel(request_id)

    def wait(self, timeout: float) -> list[EngineOutput]:
        self._record("wait")
        self.waits += 1
        if self.wait_error is not None:
            raise self.wait_error
        return self.inner.wait(timeout)

    def wake(self) -> None:
        self.inner.wake()

    def stats(self) -> EngineStats:
        return self.inner.stats()

    def shutdown(self) -> None:
        self._record("shutdown")
        self.shutdown_threads.append(threading.current_thread().name)
        self.inner.shutdown()


def echo(prompt: list[int], count: int) -> list[int]:
    return [prompt[k % len(prompt)] for k in range(count)]


async def flush_callbacks() -> None:
    """Run the callbacks a finished looper thread already scheduled: they are ahead of
    this task's resumption in the event loop's ready queue."""
    await asyncio.sleep(0)


async def heartbeats(looper: Looper, count: int) -> None:
    """Wait until the looper's heartbeat moved `count` times. The heartbeat is a plain
    attribute with no notification, so this polls it (bounded by TIMEOUT_S)."""

    async def watch() -> None:
        seen, last = 0, looper.heartbeat
        while seen < count:
            await asyncio.sleep(0.01)
            if looper.heartbeat != last:
                seen, last = seen + 1, looper.heartbeat

    await asyncio.wait_for(watch(), TIMEOUT_S)


# -- outputs ----------------------------------------------------------------------------


async def test_all_outputs_arrive_in_order_with_one_final_each(
    start_looper: StartLooper,
) -> None:
    sink = Sink()
    looper = start_looper(EchoEngine(capacity=8, step_s=0), sink)
    prompts = {1: [1, 2, 3], 2: [4], 3: [5, 6], 4: [7, 8, 9, 10], 5: [11, 12, 13]}
    budgets = {1: 7, 2: 3, 3: 12, 4: 1, 5: 20}
    for request_id, prompt in prompts.items():
        looper.submit(EngineRequest(request_id, prompt, max_new_tokens=budgets[request_id]))

    await sink.until(lambda: set(sink.finals) == set(prompts))
    await asyncio.to_thread(looper.stop, TIMEOUT_S)
    await flush_callbacks()

    assert sink.finals == dict.fromkeys(prompts, 1)
    for request_id, prompt in prompts.items():
        outputs = sink.outputs[request_id]
        assert sink.tokens(request_id) == echo(prompt, budgets[request_id])
        assert [o.final for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].finish is FinishReason.LENGTH
    assert sink.callback_threads == {threading.get_ident()}  # always on the event loop
    assert sink.deaths == []
    assert looper.error is None
    assert looper.in_flight == 0


async def test_300_concurrent_requests_on_capacity_64_all_finish(
    start_looper: StartLooper,
) -> None:
    sink = Sink()
    looper = start_looper(EchoEngine(capacity=64, step_s=0), sink)
    requests = [
        EngineRequest(i, [i, i + 1, i + 2][: 1 + i % 3], max_new_tokens=5 + i % 17)
        for i in range(1, 301)
    ]
    for request in requests:
        looper.submit(request)

    await sink.until(lambda: len(sink.finals) == len(requests))

    assert sink.finals == {request.id: 1 for request in requests}
    for request in requests:
        assert sink.tokens(request.id) == echo(request.prompt_ids, request.max_new_tokens)
        assert sink.outputs[request.id][-1].finish is FinishReason.LENGTH
    assert max(len(batch) for batch in sink.batches) <= 64
    assert looper.in_flight == 0


# -- cancel -----------------------------------------------------------------------------


async def test_cancel_mid_stream_ends_the_request_within_a_few_steps(
    start_looper: StartLooper,
) -> None:
    sink = Sink()
    looper = start_looper(EchoEngine(capacity=4, step_s=0.01), sink)
    looper.submit(EngineRequest(1, [1, 2, 3], max_new_tokens=100_000))
    await sink.until(lambda: bool(sink.outputs[1]))

    looper.cancel(1)
    tokens_at_cancel = len(sink.tokens(1))
    await sink.until(lambda: sink.final(1) is not None)

    final = sink.final(1)
    assert final is not None
    assert final.finish is FinishReason.CANCELLED
    assert final.token_ids == []
    assert sink.finals[1] == 1
    tokens = sink.tokens(1)
    assert tokens == echo([1, 2, 3], len(tokens))
    # A few 10 ms steps, with a wide margin for a loaded machine (the budget is 100 000).
    assert len(tokens) - tokens_at_cancel < 100
    assert looper.in_flight == 0


async def test_cancel_of_a_finished_request_is_ignored(start_looper: StartLooper) -> None:
    sink = Sink()
    looper = start_looper(EchoEngine(capacity=4, step_s=0), sink)
    looper.submit(EngineRequest(1, [1, 2], max_new_tokens=3))
    await sink.until(lambda: sink.final(1) is not None)

    looper.cancel(1)
    looper.cancel(99)  # never submitted
    looper.submit(EngineRequest(2, [3, 4], max_new_tokens=3))
    await sink.until(lambda: sink.final(2) is not None)

    assert sink.tokens(2) == [3, 4, 3]
    assert sink.outputs[2][-1].finish is FinishReason.LENGTH
    assert sink.finals == {1: 1, 2: 1}
    assert looper.alive
    assert looper.error is None


# -- stop and death ---------------------------------------------------------------------


async def test_stop_with_requests_in_flight_ends_the_thread_and_shuts_the_engine_down(
    start_looper: StartLooper,
) -> None:
    sink = Sink()
    engine = RecordingEngine(EchoEngine(capacity=4, step_s=0.01))
    looper = start_looper(engine, sink)
    for request_id in (1, 2, 3):
        looper.submit(EngineRequest(request_id, [request_id], max_new_tokens=100_000))
    await sink.until(lambda: bool(sink.outputs[1]))
    assert looper.alive

    await asyncio.to_thread(looper.stop, TIMEOUT_S)
    await flush_callbacks()

    assert not looper.alive
    assert engine.shutdown_threads == ["engine-looper"]  # once, on the engine's own thread
    assert engine.calls_after_shutdown == []
    assert looper.error is None
    assert sink.deaths == []
    assert not sink.finals  # stopping hands the requests back; it does not finish them


async def test_engine_error_ends_the_looper_and_reports_it_once(
    start_looper: StartLooper,
) -> None:
    sink = Sink()
    error = RuntimeError("device lost")
    engine = RecordingEngine(EchoEngine(capacity=4, step_s=0), wait_error=error)
    looper = start_looper(engine, sink)
    looper.submit(EngineRequest(1, [1, 2, 3], max_new_tokens=10))

    await sink.until(lambda: bool(sink.deaths))
    await asyncio.to_thread(looper.stop, TIMEOUT_S)  # only joins: the thread has ended
    await flush_callbacks()

    assert sink.deaths == [error]
    assert sink.callback_threads == {threading.get_ident()}
    assert not looper.alive
    assert looper.error is error
    assert engine.waits == 1  # the thread did not go on after the error
    assert engine.shutdown_threads == ["engine-looper"]
    assert sink.batches == []


# -- idle, heartbeat, back-pressure ----------------------------------------------------


async def test_idle_looper_never_calls_engine_wait_but_keeps_its_heartbeat(
    start_looper: StartLooper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trtllm_worker.engine.looper, "IDLE_TIMEOUT_S", 0.05)
    sink = Sink()
    engine = RecordingEngine(EchoEngine(capacity=4, step_s=0))
    looper = start_looper(engine, sink)

    await heartbeats(looper, 2)
    assert engine.waits == 0

    looper.submit(EngineRequest(1, [1, 2], max_new_tokens=4))
    await sink.until(lambda: sink.final(1) is not None)
    assert sink.tokens(1) == [1, 2, 1, 2]
    waits_while_busy = engine.waits
    assert waits_while_busy >= 4

    await heartbeats(looper, 3)  # the first may be the one after the last delivery
    assert engine.waits == waits_while_busy
    assert looper.alive


async def test_unconsumed_batches_hold_the_thread_back_until_consumed(
    start_looper: StartLooper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trtllm_worker.engine.looper, "IDLE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(trtllm_worker.engine.looper, "MAX_UNCONSUMED_BATCHES", 2)
    sink = Sink(auto_consume=False)
    looper = start_looper(EchoEngine(capacity=4, step_s=0), sink)
    looper.submit(EngineRequest(1, [1, 2, 3], max_new_tokens=10))

    await sink.until(lambda: len(sink.batches) == 2)
    await heartbeats(looper, 2)  # the thread is alive, blocked on delivery
    assert len(sink.batches) == 2

    sink.auto_consume = True
    sink.consume()
    await sink.until(lambda: sink.final(1) is not None)

    assert sink.tokens(1) == echo([1, 2, 3], 10)
    assert sink.finals[1] == 1


async def test_stop_while_the_event_loop_is_not_consuming_still_stops(
    start_looper: StartLooper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trtllm_worker.engine.looper, "IDLE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(trtllm_worker.engine.looper, "MAX_UNCONSUMED_BATCHES", 2)
    sink = Sink(auto_consume=False)  # as when the pump task was cancelled before stop()
    engine = RecordingEngine(EchoEngine(capacity=4, step_s=0))
    looper = start_looper(engine, sink)
    looper.submit(EngineRequest(1, [1, 2, 3], max_new_tokens=100))
    await sink.until(lambda: len(sink.batches) == 2)

    try:
        await asyncio.to_thread(looper.stop, 1.0)

        assert not looper.alive
        assert engine.shutdown_threads == ["engine-looper"]
    finally:
        sink.consume()  # lets a stuck thread see the stop, so that the test ends cleanly


async def test_a_silent_engine_with_requests_in_flight_counts_as_dead() -> None:
    """TensorRT-LLM can leave results pending forever when its worker dies; silence
    with work in flight must end in on_death, not in a hang."""
    loop = asyncio.get_running_loop()
    died: asyncio.Future[BaseException] = loop.create_future()
    engine = EchoEngine(capacity=4, step_s=3600)  # its first step never comes
    looper = Looper(
        engine, loop, lambda outputs, emitted_at: None, died.set_result, stall_timeout_s=0.2
    )
    looper.start()
    looper.submit(EngineRequest(id=1, prompt_ids=[1, 2], max_new_tokens=5))
    error = await asyncio.wait_for(died, 5)
    assert isinstance(error, EngineStalled)
    assert "1 requests in flight" in str(error)
    looper.stop()
    assert not looper.alive
