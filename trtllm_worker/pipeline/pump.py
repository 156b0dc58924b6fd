"""The output pump: the event-loop side of the thread boundary. The looper puts one
batch of engine outputs per wake-up into the `Inbox` (via `call_soon_threadsafe`); the
pump takes everything delivered, turns it into entries, stores them in one fenced Redis
call, then settles the requests that finished. Dropping a running request (lost lease,
hand-back) happens here, in one place; the registry itself is the `OutputProcessor`'s."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator

from trtllm_worker.config import Settings
from trtllm_worker.connect.redis import REDIS_FAILURES
from trtllm_worker.contract.errors import HandBack, Returned, StreamUnusable, WorkerError
from trtllm_worker.engine.base import EngineOutput
from trtllm_worker.engine.looper import Looper
from trtllm_worker.ops.log import about
from trtllm_worker.ops.metrics import Metrics
from trtllm_worker.pipeline.leases import Leases, lease_lost
from trtllm_worker.pipeline.output import OutputProcessor, ProcessedBatch, RequestState, Terminal
from trtllm_worker.streams.refusals import refused_for_good
from trtllm_worker.streams.store import ENTRIES_LOST_REASON, LEASE_LOST_REASON, StreamStore

log = logging.getLogger(__name__)

RETRY_MAX_S = 1.0


class Inbox:
    """What the looper delivered and the pump has not taken yet: the event-loop end of
    the thread boundary. Built before both, so each is built whole: the looper puts
    (`put`, via `call_soon_threadsafe`), the pump takes."""

    def __init__(self) -> None:
        self._outputs: list[EngineOutput] = []
        self._batches = 0
        self._since: float | None = None  # when the engine had the oldest of them
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._outputs)

    def put(self, outputs: list[EngineOutput], emitted_at: float) -> None:
        self._outputs.extend(outputs)
        self._batches += 1
        if self._since is None:
            self._since = emitted_at
        self._ready.set()

    async def take(self) -> tuple[list[EngineOutput], int, float | None]:
        """Everything delivered so far (waiting for some): the outputs, how many batches
        they came in, and when the engine had the oldest of them."""
        await self._ready.wait()
        self._ready.clear()
        outputs, self._outputs = self._outputs, []
        batches, self._batches = self._batches, 0
        since, self._since = self._since, None
        return outputs, batches, since


class OutputPump:
    """The loop that publishes running requests' outputs, and drops requests."""

    def __init__(
        self,
        settings: Settings,
        store: StreamStore,
        leases: Leases,
        metrics: Metrics,
        looper: Looper,
        inbox: Inbox,
    ) -> None:
        self._settings = settings
        self._store = store
        self._leases = leases
        self._metrics = metrics
        self._looper = looper
        self._inbox = inbox
        self._processor = OutputProcessor(
            cluster=store.cluster, usage=store.usage, model=store.model_name
        )
        self._last_tokens_at: float | None = None  # while requests run
        self._background: set[asyncio.Task[None]] = set()
        self._ending: frozenset[str] = frozenset()
        """The streams whose terminal entry the write in flight stores: that write
        releases their lease, so a renewal meanwhile finds it gone."""
        self.redis_healthy = True

    def __len__(self) -> int:
        return self._processor.in_hand

    def get(self, request_id: str) -> RequestState | None:
        return self._processor.get(request_id)

    def states(self) -> Iterator[RequestState]:
        return iter(self._processor.states())

    # -- registry ---------------------------------------------------------------------

    def add(self, state: RequestState) -> asyncio.Future[Terminal]:
        """Register a request about to be submitted; the future ends with its terminal
        entry stored, or with the error that dropped it."""
        state.done = asyncio.get_running_loop().create_future()
        self._processor.add(state)
        self._metrics.in_flight.set(self._processor.in_hand)
        return state.done

    def drop(self, state: RequestState, error: WorkerError) -> None:
        """Forget a running request: no more writes, out of the engine, job settled by
        `error`'s action."""
        if self._processor.drop(state):
            self.cancel_engine(state.engine_id)
        if state.done is not None and not state.done.done():
            state.done.set_exception(error)
        self._metrics.in_flight.set(self._processor.in_hand)

    def drop_lost_lease(self, key: str) -> None:
        """Drop the running request whose stream is `key`: its lease was found lost.
        Not one whose terminal entry is being written: that write released the lease
        (a renewal that ran after it in Redis finds it gone), and its reply decides:
        stored, the job ended; refused by the fence, `_fail_refused` hands it back."""
        if key in self._ending:
            return
        state = self._processor.with_key(key)
        if state is not None:
            log.warning("lease lost; handing the job back", extra=about(state.request_id))
            self.drop(state, lease_lost(state.request_id))

    def hand_back_all(self, reason: str) -> int:
        """Stop writing for every running request and let its job go back to the queue
        (drain timeout, broker connection lost, engine dead, Redis buffer full). Their
        leases are released so the next owner need not wait for them to expire."""
        states = self._processor.states()
        self._let_go(states, lambda s: HandBack(reason, request_id=s.request_id))
        return len(states)

    def pause(self, state: RequestState, reason: str) -> bool:
        """Stop writing for one running request, out of the engine within a step, and
        let its job go back to the queue uncounted (`Returned`), to make room for a job
        of higher priority. What it stored stays: the copy resumes from there. False
        (nothing done) for a request that already finished: its terminal entry is being
        written, and its slot frees with it."""
        if not self._processor.in_engine(state):
            return False
        # the lease stays tracked: the runner releases it (awaited) before the job is
        # settled, so a copy redelivered at once finds it free
        self.drop(state, Returned(reason, request_id=state.request_id))
        return True

    def _let_go(
        self, states: list[RequestState], error: Callable[[RequestState], WorkerError]
    ) -> None:
        """Drop these requests with their error; release their leases in the background
        (a write in flight with the old token is refused by the fence)."""
        leases = self._leases.forget_all(s.key for s in states)
        for state in states:
            self.drop(state, error(state))
        if leases:
            task = asyncio.get_running_loop().create_task(self._leases.release(leases))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def wait_background(self) -> None:
        """Wait for the lease releases `hand_back_all` started (before closing Redis)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def cancel_engine(self, engine_id: int) -> None:
        self._looper.cancel(engine_id)

    # -- the pump ---------------------------------------------------------------------

    async def run(self) -> None:
        """Forever: take everything the engine delivered, turn it into entries, store
        them in one call, then settle the requests that finished."""
        while True:
            outputs, batches, emitted_at = await self._inbox.take()
            if batches:
                self._looper.consumed(batches)
            batch = self._processor.process(outputs)
            for engine_id in batch.aborts:
                self.cancel_engine(engine_id)
            refused = await self._store_batch(batch)
            if refused is None:
                continue  # given up: every job was handed back
            if refused:
                self._fail_refused(refused, batch)
            if batch.tokens:
                now = time.monotonic()
                if emitted_at is not None:
                    self._metrics.emit_delay.observe(now - emitted_at)
                if self._last_tokens_at is not None:
                    self._metrics.inter_token.observe(now - self._last_tokens_at)
                self._last_tokens_at = now if self._processor.in_hand else None
            self._settle(batch)

    async def _store_batch(self, batch: ProcessedBatch) -> dict[str, str] | None:
        """Write the batch, retrying while Redis is unreachable. The batch and what the
        engine delivers meanwhile are the buffer; when it holds more than
        WORKER_REDIS_BUFFER_ENTRIES, every running job is handed back (None)."""
        self._ending = frozenset(state.key for state, _ in batch.finished)
        try:
            return await self._write_batch(batch)
        finally:
            self._ending = frozenset()

    async def _write_batch(self, batch: ProcessedBatch) -> dict[str, str] | None:
        delay = 0.05
        while True:
            started = time.perf_counter()
            try:
                try:
                    refused = await self._store.write(batch.write)
                except REDIS_FAILURES as exc:
                    if not refused_for_good(exc):
                        raise
                    # Not an outage: the script failed on some stream's keys, and would
                    # again. Retrying the batch would stop every stream; written one by
                    # one, only the streams at fault fail (`_fail_refused`).
                    log.warning(
                        "Redis refused a batch of %d entries (%s); writing its streams one by one",
                        batch.entry_count,
                        exc,
                    )
                    refused = await self._store.write_each(batch.write)
            except REDIS_FAILURES as exc:
                self.redis_healthy = False
                buffered = batch.entry_count + len(self._inbox)
                if buffered > self._settings.redis_buffer_entries:
                    count = self.hand_back_all("Redis is unreachable and the buffer is full")
                    log.error("%d entries buffered: %d running jobs handed back", buffered, count)
                    return None
                log.warning("storing %d entries failed (%s); retrying", batch.entry_count, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            self.redis_healthy = True
            self._metrics.publish_latency.observe(time.perf_counter() - started)
            for state, _ in batch.finished:
                if state.key not in refused:
                    self._leases.forget(state.key)  # released with the terminal entry
            return refused

    def _fail_refused(self, refused: dict[str, str], batch: ProcessedBatch) -> None:
        """Requests whose writes were refused stop here: a lost lease hands the job back
        (another worker owns it now), so do lost entries (it resumes from the stream's
        tail, as after a crash); a stream Redis refuses for good (its key is not a
        stream, or the script failed on its keys) dead-letters it with the reason."""
        states = [s for s in self._processor.states() if s.key in refused]
        states += [s for s, _ in batch.finished if s.key in refused]
        for state in states:
            reason = refused[state.key]
            log.warning("not written: %s", reason, extra=about(state.request_id))
            error: WorkerError
            if reason == LEASE_LOST_REASON:
                self._leases.forget(state.key)
                error = lease_lost(state.request_id)
            elif reason == ENTRIES_LOST_REASON:
                error = HandBack(reason, request_id=state.request_id)
            else:
                error = StreamUnusable(
                    f"stream key {state.key!r} cannot be written: {reason}",
                    request_id=state.request_id,
                )
            self.drop(state, error)

    def _settle(self, batch: ProcessedBatch) -> None:
        now = time.monotonic()
        for state in batch.first_tokens:
            state.first_token_at = now
        self._metrics.generated_tokens.inc(batch.tokens)
        for state, terminal in batch.finished:
            self._processor.settle(state)
            if state.done is not None and not state.done.done():
                state.done.set_result(terminal)
        self._metrics.in_flight.set(self._processor.in_hand)
