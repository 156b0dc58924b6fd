"""One job from a validated message to its stored terminal entry, and the pump that
turns engine outputs into Redis writes. Lives on the event loop; talks to the engine only
through the looper."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worker.config import Settings
from worker.engine.base import EngineOutput, EngineRequest, FinishReason, Sampling
from worker.errors import DeadlineExceeded, HandBack, StreamUnusable
from worker.inputs import TOKENIZE_IN_THREAD_CHARS, PreparedInput, prepare_input
from worker.looper import Looper
from worker.metrics import Metrics
from worker.output import OutputProcessor, ProcessedBatch, RequestState, Terminal
from worker.publisher import Publisher, StreamState
from worker.schema import Job, metadata_json
from worker.tokenizer import TokenizerInfo

log = logging.getLogger(__name__)

_RETRY_MAX_S = 1.0
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class JobResult:
    """What became of a job: its terminal entry, or None when an earlier attempt had
    already stored one (the job is acknowledged without running)."""

    terminal: Terminal | None
    first_token_s: float | None = None


class JobRunner:
    """Runs jobs on the engine and publishes their streams."""

    def __init__(
        self,
        settings: Settings,
        tokenizer: TokenizerInfo,
        publisher: Publisher,
        metrics: Metrics,
        worker_id: str = "worker",
    ) -> None:
        self._settings = settings
        self._worker_id = worker_id
        self._lease_ids = itertools.count(1)
        self._leases: dict[str, str] = {}  # stream key → lease token, for jobs in hand
        self._tokenizer = tokenizer
        self._publisher = publisher
        self._metrics = metrics
        self._processor = OutputProcessor()
        self._engine_ids = itertools.count(1)
        self._active: dict[str, asyncio.Future[None]] = {}
        self._running: dict[str, RequestState] = {}
        self._cancel_requested: set[str] = set()
        self._inbox: list[EngineOutput] = []
        self._inbox_batches = 0
        self._inbox_since: float | None = None  # when the engine had the oldest of them
        self._inbox_ready = asyncio.Event()
        self._last_tokens_at: float | None = None  # while requests run
        self._looper: Looper | None = None
        self.engine_error: BaseException | None = None
        self.redis_healthy = True
        self._stopping = False
        self._background: set[asyncio.Task[None]] = set()

    def attach(self, looper: Looper) -> None:
        self._looper = looper

    @property
    def running(self) -> int:
        return len(self._running)

    # -- from the looper thread (via call_soon_threadsafe) ---------------------------

    def on_outputs(self, outputs: list[EngineOutput], emitted_at: float) -> None:
        self._inbox.extend(outputs)
        self._inbox_batches += 1
        if self._inbox_since is None:
            self._inbox_since = emitted_at
        self._inbox_ready.set()

    def on_engine_death(self, exc: BaseException) -> None:
        """The engine is gone: its requests are not at fault, so their jobs go back to
        the queue and another worker continues their streams from the stored tokens."""
        self.engine_error = exc  # from now on no job is submitted
        count = self.hand_back_all(f"the engine died: {type(exc).__name__}: {exc}")
        log.error("engine died: %d running jobs handed back", count)

    # -- the pump ---------------------------------------------------------------------

    async def pump(self) -> None:
        """Forever: take everything the engine delivered, turn it into entries, store
        them in one pipeline, then settle the requests that finished."""
        while True:
            await self._inbox_ready.wait()
            self._inbox_ready.clear()
            outputs, self._inbox = self._inbox, []
            batches, self._inbox_batches = self._inbox_batches, 0
            emitted_at, self._inbox_since = self._inbox_since, None
            if self._looper is not None and batches:
                self._looper.consumed(batches)
            batch = self._processor.process(outputs)
            for engine_id in batch.aborts:
                self._cancel_engine(engine_id)
            refused = await self._store(batch)
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
                self._last_tokens_at = now if self._running else None
            self._settle(batch)

    async def _store(self, batch: ProcessedBatch) -> dict[str, str] | None:
        """Write the batch, retrying while Redis is unreachable. The batch and what the
        engine delivers meanwhile are the buffer; when it holds more than
        WORKER_REDIS_BUFFER_ENTRIES, every running job is handed back (None)."""
        final = [state.key for state, _ in batch.finished]
        delay = 0.05
        while True:
            tokens = {key: self._leases[key] for key, _, _ in batch.entries if key in self._leases}
            started = time.perf_counter()
            try:
                refused = await self._publisher.write(batch.entries, final, tokens)
            except (RedisError, OSError) as exc:
                self.redis_healthy = False
                buffered = len(batch.entries) + len(self._inbox)
                if buffered > self._settings.redis_buffer_entries:
                    count = self.hand_back_all("Redis is unreachable and the buffer is full")
                    log.error("%d entries buffered: %d running jobs handed back", buffered, count)
                    return None
                log.warning("storing %d entries failed (%s); retrying", len(batch.entries), exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
                continue
            self.redis_healthy = True
            self._metrics.publish_latency.observe(time.perf_counter() - started)
            for key in final:
                if key not in refused:
                    self._leases.pop(key, None)  # the script released it with the terminal
            return refused

    def _fail_refused(self, refused: dict[str, str], batch: ProcessedBatch) -> None:
        """Requests whose writes were refused stop here: a lost lease hands the job back
        (another worker owns it now); a key Redis refuses for good (not a stream)
        dead-letters it with the reason."""
        states = [s for s in self._running.values() if s.key in refused]
        states += [s for s, _ in batch.finished if s.key in refused]
        for state in states:
            reason = refused[state.key]
            log.warning("request %s: not written: %s", state.request_id, reason)
            error: Exception
            if reason.startswith("the lease was lost"):
                self._leases.pop(state.key, None)
                error = HandBack(reason, request_id=state.request_id)
            else:
                error = StreamUnusable(
                    f"stream key {state.key!r} cannot be written: {reason}",
                    request_id=state.request_id,
                )
            self._drop(state, error)

    def _settle(self, batch: ProcessedBatch) -> None:
        now = time.monotonic()
        for state in batch.first_tokens:
            state.first_token_at = now
        self._metrics.generated_tokens.inc(batch.tokens)
        for state, terminal in batch.finished:
            self._running.pop(state.request_id, None)
            if state.done is not None and not state.done.done():
                state.done.set_result(terminal)
        self._metrics.in_flight.set(len(self._running))

    # -- jobs -------------------------------------------------------------------------

    async def run(self, job: Job, received_at: float) -> JobResult:
        """Run one job to its terminal entry. Raises `InvalidJob` (dead-letter),
        `HandBack` (requeue) or a Redis error (retry later)."""
        previous = self._active.get(job.request_id)
        if previous is not None:  # the same id is running here: let it end first
            await asyncio.shield(previous)
        finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._active[job.request_id] = finished
        try:
            return await self._run(job, received_at)
        finally:
            self._cancel_requested.discard(job.request_id)
            del self._active[job.request_id]
            finished.set_result(None)

    async def _redis(self, call: Callable[[], Awaitable[T]]) -> T:
        """A Redis call retried while Redis is unreachable: the job stays in hand rather
        than bouncing through the queue (which would count as a failed delivery)."""
        delay = 0.05
        while True:
            try:
                return await call()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                if self._stopping:
                    raise HandBack("Redis is unreachable and the worker is stopping") from exc
                self.redis_healthy = False
                log.warning("Redis is unreachable (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)

    async def _run(self, job: Job, received_at: float) -> JobResult:
        key = self._settings.stream_prefix + job.request_id
        token = f"{self._worker_id}:{next(self._lease_ids)}"
        stream = await self._take_lease(key, token)
        try:
            return await self._run_leased(job, key, stream, received_at)
        finally:
            if self._leases.get(key) == token:
                # ended without writing a terminal entry through the pump (handed back,
                # skipped, invalid, ended at once): the lease is no longer needed
                del self._leases[key]
                await self._release_quietly({key: token})

    async def _take_lease(self, key: str, token: str) -> StreamState:
        """Own the request before touching its stream, and read what it holds. A lease
        held by another worker (one that lost its broker connection, or a duplicate
        message running there) is waited out: it expires when its owner is gone, or is
        released when it ends."""
        poll_s = min(self._settings.lease_ttl_s / 4, 1.0)
        while (stream := await self._redis(lambda: self._publisher.start(key, token))) is None:
            if self._stopping:
                raise HandBack("the worker is stopping")
            await asyncio.sleep(poll_s)
        self._leases[key] = token
        return stream

    async def _release_quietly(self, leases: dict[str, str]) -> None:
        try:
            await self._publisher.release_leases(leases)
        except (RedisError, OSError) as exc:  # they expire on their own
            log.debug("releasing %d leases failed: %s", len(leases), exc)

    async def _run_leased(
        self, job: Job, key: str, stream: StreamState, received_at: float
    ) -> JobResult:
        if stream.terminal:
            return JobResult(None)
        prepared = await self._prepare(job)
        if job.deadline is not None and datetime.now(UTC) >= job.deadline:
            raise DeadlineExceeded(
                f"deadline {job.deadline.isoformat()} passed before the job started",
                request_id=job.request_id,
            )
        state = self._new_state(job, key, prepared)
        if stream.cancelled or job.request_id in self._cancel_requested:
            return await self._end_now(state, FinishReason.CANCELLED)
        if stream.token_ids:
            finish = self._resume(state, stream, prepared)
            if finish is not None:
                return await self._end_now(state, finish)
        if self.engine_error is not None or self._looper is None:
            raise HandBack("the engine is not running", request_id=job.request_id)
        terminal = await self._submit(job, state, prepared, stream.token_ids, received_at)
        ttft = None if state.first_token_at is None else state.first_token_at - received_at
        return JobResult(terminal, ttft)

    async def _prepare(self, job: Job) -> PreparedInput:
        if job.inputs is not None and len(job.inputs) > TOKENIZE_IN_THREAD_CHARS:
            return await asyncio.to_thread(prepare_input, job, self._tokenizer, self._settings)
        return prepare_input(job, self._tokenizer, self._settings)

    def _new_state(self, job: Job, key: str, prepared: PreparedInput) -> RequestState:
        params = job.parameters
        return RequestState(
            request_id=job.request_id,
            key=key,
            engine_id=next(self._engine_ids),
            tokenizer=self._tokenizer.tokenizer,
            prompt_ids=prepared.prompt_ids,
            input_tokens=len(prepared.prompt_ids),
            stops=params.stop or (),
            min_new_tokens=prepared.min_new_tokens,
            eos_ids=frozenset() if params.ignore_eos else self._tokenizer.eos_ids,
            return_logprobs=params.return_logprobs,
            metadata_json=None if job.metadata is None else metadata_json(job.metadata),
        )

    def _resume(
        self, state: RequestState, stream: StreamState, prepared: PreparedInput
    ) -> FinishReason | None:
        """Continue a stream an earlier attempt began: replay its tokens through the
        detokenizer and stop gate, so text and indices go on exactly where it ended."""
        self._metrics.resumed.inc()
        finish = state.replay(stream.token_ids)
        if state.texts != stream.texts:
            log.warning(
                "request %s: replayed text differs from the stored stream", state.request_id
            )
        # What was published is the truth: `generated_text` must equal its concatenation
        # (the last stored token may have carried a final flush that replay holds back).
        state.texts = list(stream.texts)
        if finish is not None:
            return finish
        if stream.token_ids[-1] in state.eos_ids:
            return FinishReason.EOS_TOKEN
        if len(stream.token_ids) >= prepared.max_new_tokens:
            return FinishReason.LENGTH
        return None

    async def _end_now(self, state: RequestState, finish: FinishReason) -> JobResult:
        terminal = Terminal(state.done_fields(finish), state.next_index)
        token = self._leases.get(state.key, "")
        appended = await self._redis(
            lambda: self._publisher.append_terminal(state.key, terminal.fields, token)
        )
        if appended < 0:
            raise HandBack("the lease was lost", request_id=state.request_id)
        self._leases.pop(state.key, None)
        return JobResult(terminal)

    async def _submit(
        self,
        job: Job,
        state: RequestState,
        prepared: PreparedInput,
        published_ids: list[int],
        received_at: float,
    ) -> Terminal:
        params = job.parameters
        resumed = len(published_ids)
        assert self._looper is not None
        request = EngineRequest(
            id=state.engine_id,
            prompt_ids=prepared.prompt_ids + published_ids,
            max_new_tokens=prepared.max_new_tokens - resumed,
            min_new_tokens=max(prepared.min_new_tokens - resumed, 0),
            end_id=self._tokenizer.end_id,
            eos_ids=state.eos_ids,
            ignore_eos=params.ignore_eos,
            sampling=Sampling(
                do_sample=params.do_sample,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                repetition_penalty=params.repetition_penalty,
                frequency_penalty=params.frequency_penalty,
                presence_penalty=params.presence_penalty,
                seed=params.seed,
            ),
            return_logprobs=params.return_logprobs,
            resumed_tokens=resumed,
            deadline=None if job.deadline is None else job.deadline.timestamp(),
        )
        loop = asyncio.get_running_loop()
        state.done = loop.create_future()
        self._processor.add(state)
        self._running[job.request_id] = state
        self._metrics.in_flight.set(len(self._running))
        self._metrics.input_tokens.inc(state.input_tokens)
        self._looper.submit(request)
        timer = None
        if job.deadline is not None:
            delay = (job.deadline - datetime.now(UTC)).total_seconds()
            timer = loop.call_later(
                max(delay, 0), self.cancel, job.request_id, FinishReason.DEADLINE
            )
        try:
            terminal = await state.done
        finally:
            if timer is not None:
                timer.cancel()
        if state.first_token_at is not None:
            self._metrics.ttft.observe(state.first_token_at - received_at)
        return terminal

    def cancel(self, request_id: str, cause: FinishReason = FinishReason.CANCELLED) -> bool:
        """Stop a request: at once if it runs here (the engine ends it within a step),
        or when it starts if it is being prepared. True if this worker has it."""
        state = self._running.get(request_id)
        if state is not None:
            if state.abort_cause is None:
                state.abort_cause = cause
                self._cancel_engine(state.engine_id)
            return True
        if request_id in self._active:
            self._cancel_requested.add(request_id)
            return True
        return False

    def _cancel_engine(self, engine_id: int) -> None:
        if self._looper is not None:
            self._looper.cancel(engine_id)

    def hand_back_all(self, reason: str) -> int:
        """Stop writing for every running request and let its job go back to the queue
        (drain timeout, broker connection lost, engine dead, Redis buffer full). Their
        leases are released so the next owner need not wait for them to expire."""
        states = list(self._running.values())
        leases = {s.key: self._leases.pop(s.key) for s in states if s.key in self._leases}
        for state in states:
            self._drop(state, HandBack(reason, request_id=state.request_id))
        if leases:
            task = asyncio.get_running_loop().create_task(self._release_quietly(leases))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return len(states)

    def stop_taking(self) -> None:
        """From now on jobs still waiting for Redis or a lease give up (hand back)."""
        self._stopping = True

    def _drop(self, state: RequestState, error: Exception) -> None:
        """Forget a running request: no more writes, out of the engine, job settled."""
        self._running.pop(state.request_id, None)
        if self._processor.remove(state.engine_id) is not None:
            self._cancel_engine(state.engine_id)
        if state.done is not None and not state.done.done():
            state.done.set_exception(error)
        self._metrics.in_flight.set(len(self._running))

    async def keep_leases(self) -> None:
        """Forever: renew the leases of the jobs in hand. A job whose lease is gone (it
        expired while Redis was away, and maybe another worker took it) is dropped and
        handed back."""
        every_s = self._settings.lease_ttl_s / 3
        while True:
            await asyncio.sleep(every_s)
            leases = dict(self._leases)
            try:
                lost = await self._publisher.renew_leases(leases)
            except (RedisError, OSError) as exc:
                log.warning("renewing %d leases failed: %s", len(leases), exc)
                continue
            for key in lost:
                if self._leases.get(key) != leases[key]:
                    continue  # ended meanwhile
                del self._leases[key]
                state = next((s for s in self._running.values() if s.key == key), None)
                if state is not None:
                    log.warning("request %s: lease lost; handing it back", state.request_id)
                    self._drop(state, HandBack("the lease was lost", request_id=state.request_id))
