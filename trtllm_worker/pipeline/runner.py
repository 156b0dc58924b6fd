"""One job from a validated message to its stored terminal entry: lease, intake, resume,
submission to the engine, deadline and cancellation. Lives on the event loop; talks to
the engine only through the looper, and to Redis only through the store."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from trtllm_worker.config import Settings
from trtllm_worker.connect.redis import REDIS_UNAVAILABLE
from trtllm_worker.contract.errors import DeadlineExceeded, HandBack, Returned, WorkerError
from trtllm_worker.contract.job import Job, metadata_json
from trtllm_worker.contract.priority import MAX_PRIORITY, priority_class
from trtllm_worker.contract.stream import FinishReason, entry_id
from trtllm_worker.engine.base import EngineRequest, Sampling
from trtllm_worker.engine.looper import Looper
from trtllm_worker.ops.log import about
from trtllm_worker.ops.metrics import Metrics
from trtllm_worker.ops.tracing import (
    FIRST_TOKEN,
    INTAKE,
    RESUMED,
    SUBMITTED,
    TERMINAL,
    JobTrace,
    trace_context,
)
from trtllm_worker.pipeline.intake import Intake, PreparedInput
from trtllm_worker.pipeline.leases import Leases, lease_lost
from trtllm_worker.pipeline.output import RequestState, Terminal
from trtllm_worker.pipeline.pump import RETRY_MAX_S, OutputPump
from trtllm_worker.pipeline.slots import GiveBack, Slots, Ticket
from trtllm_worker.streams.store import ENTRIES_LOST_REASON, Ended, StreamState, StreamStore

log = logging.getLogger(__name__)

T = TypeVar("T")
Admit = Callable[[], Awaitable[None]]
"""Run when a job holds its lease and its stream has no terminal entry; raises a
`WorkerError` (e.g. `DeliveryLimitExceeded`) to end the job instead of running it."""


@dataclass(frozen=True, slots=True)
class JobResult:
    """What became of a job: its terminal entry, or None when an earlier attempt had
    already stored one (the job is acknowledged without running)."""

    terminal: Terminal | None
    first_token_s: float | None = None


class JobRunner:
    """Runs jobs on the engine; their outputs go through the pump."""

    def __init__(
        self,
        settings: Settings,
        intake: Intake,
        store: StreamStore,
        leases: Leases,
        pump: OutputPump,
        looper: Looper,
        metrics: Metrics,
        capacity: int | None = None,
    ) -> None:
        self._settings = settings
        self._intake = intake
        self._store = store
        self._leases = leases
        self._pump = pump
        self._looper = looper
        self._metrics = metrics
        self._engine_ids = itertools.count(1)
        self._active: dict[str, asyncio.Future[None]] = {}
        self._cancel_requested: set[str] = set()
        self.engine_error: BaseException | None = None
        self._stopping = False
        self.slots = Slots(capacity or settings.max_batch, settings.preempt_priority, self._pause)
        """The engine's slots, by priority: a job takes one before it is submitted."""

    @property
    def running(self) -> int:
        return len(self._pump)

    @property
    def redis_healthy(self) -> bool:
        return self._pump.redis_healthy

    def on_engine_death(self, exc: BaseException) -> None:
        """The engine is gone: its requests are not at fault, so their jobs go back to
        the queue and another worker continues their streams from the stored tokens."""
        self.engine_error = exc  # from now on no job is submitted
        count = self._pump.hand_back_all(f"the engine died: {type(exc).__name__}: {exc}")
        log.error("engine died: %d running jobs handed back", count)

    def hand_back_all(self, reason: str) -> int:
        return self._pump.hand_back_all(reason)

    def stop_taking(self) -> None:
        """From now on jobs still waiting for Redis or a lease give up (hand back)."""
        self._stopping = True

    # -- jobs -------------------------------------------------------------------------

    async def run(
        self,
        job: Job,
        received_at: float,
        trace: JobTrace | None = None,
        admit: Admit | None = None,
        priority: int = 0,
    ) -> JobResult:
        """Run one job to its terminal entry. Raises a `WorkerError` whose action says
        what becomes of the message, or a Redis error (retry later). `admit` (the
        consumer's delivery limit) runs once the job holds its lease and its stream is
        found unfinished; what it raises ends the job through that lease."""
        request_id = job.request_id
        # Copies of one request in hand here (a producer's retries, redeliveries) run one
        # at a time: every waiting copy wakes when the running one ends, and the first to
        # run takes the table again, so the others wait on for it. The next copy then
        # finds the terminal entry (acknowledged, not run) or resumes a stream handed back.
        while (previous := self._active.get(request_id)) is not None:
            await asyncio.shield(previous)
        finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._active[request_id] = finished
        try:
            return await self._run(job, received_at, trace, admit, priority)
        finally:
            self._cancel_requested.discard(request_id)
            del self._active[request_id]
            finished.set_result(None)

    async def _redis(self, call: Callable[[], Awaitable[T]]) -> T:
        """A Redis call retried while Redis is unreachable: the job stays in hand rather
        than bouncing through the queue (which would count as a failed delivery)."""
        delay = 0.05
        while True:
            try:
                return await call()
            except REDIS_UNAVAILABLE as exc:
                if self._stopping:
                    raise HandBack("Redis is unreachable and the worker is stopping") from exc
                self._pump.redis_healthy = False
                log.warning("Redis is unreachable (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    async def _run(
        self,
        job: Job,
        received_at: float,
        trace: JobTrace | None,
        admit: Admit | None,
        priority: int,
    ) -> JobResult:
        key = self._settings.stream_prefix + job.request_id
        token = self._leases.new_token()
        stream = await self._leases.take(
            key,
            token,
            lambda: self._redis(lambda: self._store.start(key, token)),
            lambda: self._stopping,
        )
        try:
            return await self._run_leased(job, key, stream, received_at, trace, admit, priority)
        except WorkerError as exc:
            if exc.writes_error_entry and self._leases.forget(key, token):
                exc.lease = token  # settling writes the error entry with it
            exc.tenant = job.tenant  # and counts the job under it
            exc.adapter = job.adapter
            raise
        finally:
            leases = {key: token} if self._leases.forget(key, token) else {}
            if leases:
                # ended without writing a terminal entry through the pump (handed back,
                # skipped, invalid, ended at once): the lease is no longer needed
                await self._leases.release(leases)

    async def _run_leased(
        self,
        job: Job,
        key: str,
        stream: StreamState,
        received_at: float,
        trace: JobTrace | None,
        admit: Admit | None,
        priority: int,
    ) -> JobResult:
        if stream.terminal:
            return JobResult(None)
        if admit is not None:
            # under the lease: a job refused here (delivered too often) ends its stream
            # through this lease, never against the stale one of a worker that died on it
            await admit()
        prepared = await self._intake.prepare(job)
        if trace is not None:
            trace_intake(trace, prepared)
        deadline_passed = False
        if job.deadline is not None and datetime.now(UTC) >= job.deadline:
            if not stream.token_ids:  # it never started: it is not run
                raise DeadlineExceeded(
                    f"deadline {job.deadline.isoformat()} passed before the job started",
                    request_id=job.request_id,
                )
            deadline_passed = True
        state = self._new_state(job, key, prepared)
        if stream.token_ids:
            if trace is not None:
                trace.event(
                    RESUMED, attributes={"trtllm_worker.resumed_tokens": len(stream.token_ids)}
                )
            finish = self._resume(state, stream, prepared)
            if finish is not None:
                return await self._end_now(state, finish, trace)
        if stream.cancelled or job.request_id in self._cancel_requested:
            return await self._end_now(state, FinishReason.CANCELLED, trace)
        if deadline_passed:
            # It started (its stream holds tokens) and its deadline passed while it was
            # handed over: it ends as a running job does at its deadline, with its text.
            return await self._end_now(state, FinishReason.DEADLINE, trace)
        if self.engine_error is not None:
            raise HandBack("the engine is not running", request_id=job.request_id)
        return await self._run_in_slot(job, state, prepared, stream, received_at, trace, priority)

    async def _run_in_slot(
        self,
        job: Job,
        state: RequestState,
        prepared: PreparedInput,
        stream: StreamState,
        received_at: float,
        trace: JobTrace | None,
        priority: int,
    ) -> JobResult:
        """Wait for an engine slot (by priority), then run the job in it."""
        try:
            ticket = await self.slots.acquire(job.request_id, priority)
        except GiveBack:
            self._metrics.given_back.inc()
            raise Returned(
                "given back unstarted: every slot is busy and interactive jobs are about",
                request_id=job.request_id,
            ) from None
        if ticket is None or job.request_id in self._cancel_requested:
            if ticket is not None:
                self.slots.release(ticket)
            return await self._end_now(state, FinishReason.CANCELLED, trace)
        try:
            if ticket.pausing:  # chosen to make room before it was submitted
                raise Returned("paused before it started", request_id=job.request_id)
            terminal = await self._submit(
                job, state, prepared, stream.token_ids, received_at, trace, priority
            )
        finally:
            self.slots.release(ticket)
        ttft = None if state.first_token_at is None else state.first_token_at - received_at
        return JobResult(terminal, ttft)

    def _pause(self, ticket: Ticket) -> None:
        """Slots chose this running job to make room: out of the engine within a step,
        back to the queue uncounted; a job not submitted yet sees `ticket.pausing`."""
        state = self._pump.get(ticket.request_id)
        if state is not None and self._pump.pause(
            state, "paused: a job of higher priority needs the slot"
        ):
            self._metrics.paused.inc()
            log.info(
                "pausing (priority %d) for a job of higher priority",
                ticket.priority,
                extra=about(ticket.request_id),
            )

    def _new_state(self, job: Job, key: str, prepared: PreparedInput) -> RequestState:
        params = job.parameters
        tokenizer = self._intake.tokenizer
        return RequestState(
            request_id=job.request_id,
            key=key,
            engine_id=next(self._engine_ids),
            tokenizer=tokenizer.tokenizer,
            prompt_ids=prepared.prompt_ids,
            input_tokens=len(prepared.prompt_ids),
            stops=params.stop or (),
            min_new_tokens=prepared.min_new_tokens,
            eos_ids=frozenset() if params.ignore_eos else tokenizer.eos_ids,
            stop_token_ids=prepared.stop_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            return_logprobs=params.return_logprobs,
            top_logprobs=params.top_logprobs or 0,
            metadata_json=None if job.metadata is None else metadata_json(job.metadata),
            lease=self._leases.token(key),
            tenant=job.tenant,
            adapter=job.adapter,
        )

    def _resume(
        self, state: RequestState, stream: StreamState, prepared: PreparedInput
    ) -> FinishReason | None:
        """Continue a stream an earlier attempt began: replay its tokens through the
        detokenizer and stop gate, so text and indices go on exactly where it ended."""
        self._metrics.resumed.inc()
        log.info("resuming after %d stored tokens", len(stream.token_ids))
        finish = state.replay(stream.token_ids)
        if state.texts != stream.texts:
            log.warning("replayed text differs from the stored stream")
        # What was published is the truth: `generated_text` must equal its concatenation
        # (the last stored token may have carried a final flush that replay holds back).
        state.texts = list(stream.texts)
        if finish is not None:
            return finish
        # An EOS or stop id ended the earlier attempt only once min_new_tokens (counting
        # every generated token, the published ones included) was reached; before it, it
        # was an ordinary token and generation goes on.
        published = len(stream.token_ids)
        if published >= prepared.min_new_tokens:
            if stream.token_ids[-1] in state.eos_ids:
                return FinishReason.EOS_TOKEN
            if stream.token_ids[-1] in state.stop_token_ids:
                return FinishReason.STOP_SEQUENCE
        if published >= prepared.max_new_tokens:
            return FinishReason.LENGTH
        return None

    async def _end_now(
        self, state: RequestState, finish: FinishReason, trace: JobTrace | None
    ) -> JobResult:
        """End a job that needs no engine (cancelled before it started, resumed at its
        end) through the store's one fenced end."""
        terminal = Terminal(state.done_fields(finish), state.next_index)
        lease = self._leases.token(state.key)
        ended = await self._redis(
            lambda: self._store.end(
                state.key,
                terminal.fields,
                lease,
                entry_id(state.next_index + 1),
                tenant=state.tenant,
                adapter=state.adapter,
            )
        )
        if ended is Ended.NOT_OURS:
            raise lease_lost(state.request_id)
        if ended is Ended.ENTRIES_LOST:
            raise HandBack(ENTRIES_LOST_REASON, request_id=state.request_id)
        self._leases.forget(state.key)
        if trace is not None:
            trace.event(TERMINAL)
        return JobResult(terminal)

    async def _submit(
        self,
        job: Job,
        state: RequestState,
        prepared: PreparedInput,
        published_ids: list[int],
        received_at: float,
        trace: JobTrace | None,
        priority: int = 0,
    ) -> Terminal:
        params = job.parameters
        resumed = len(published_ids)
        request = EngineRequest(
            id=state.engine_id,
            prompt_ids=prepared.prompt_ids + published_ids,
            max_new_tokens=prepared.max_new_tokens - resumed,
            min_new_tokens=max(prepared.min_new_tokens - resumed, 0),
            end_id=self._intake.tokenizer.end_id,
            eos_ids=state.eos_ids,
            stop_token_ids=prepared.stop_token_ids,
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
            top_logprobs=params.top_logprobs or 0,
            guide=prepared.grammar,
            resumed_tokens=resumed,
            deadline=None if job.deadline is None else job.deadline.timestamp(),
            priority=priority / MAX_PRIORITY,
            cache_salt=job.tenant,
            trace_headers=trace_context(trace),
            # checked when the message was read (an unknown one is dead-lettered there)
            adapter=None if job.adapter is None else self._intake.adapters[job.adapter],
        )
        done = self._pump.add(state)
        self._metrics.input_tokens.inc(state.input_tokens)
        self._looper.submit(request)
        if trace is not None:
            trace.event(SUBMITTED)
        timer = None
        if job.deadline is not None:
            delay = (job.deadline - datetime.now(UTC)).total_seconds()
            loop = asyncio.get_running_loop()
            timer = loop.call_later(
                max(delay, 0), self.cancel, job.request_id, FinishReason.DEADLINE
            )
        try:
            terminal = await done
        finally:
            if timer is not None:
                timer.cancel()
            if trace is not None and state.first_token_at is not None:
                trace.event(FIRST_TOKEN, state.first_token_at)
        if state.first_token_at is not None:
            klass = priority_class(priority, self._settings.preempt_priority)
            ttft = self._metrics.by_class(self._metrics.ttft, klass)
            ttft.observe(state.first_token_at - received_at)
        if trace is not None:
            trace.event(TERMINAL)
        return terminal

    def cancel(self, request_id: str, cause: FinishReason = FinishReason.CANCELLED) -> bool:
        """Stop a request: at once if it runs here (the engine ends it within a step),
        or when it starts if it is being prepared. True if this worker has it."""
        state = self._pump.get(request_id)
        if state is not None:
            if state.abort_cause is None:
                state.abort_cause = cause
                self._pump.cancel_engine(state.engine_id)
            return True
        if request_id in self._active:
            self._cancel_requested.add(request_id)
            self.slots.withdraw(request_id)  # waiting for a slot: it ends now
            return True
        return False

    async def keep_leases(self) -> None:
        """Forever: renew the leases of the jobs in hand; drop the ones lost."""
        await self._leases.keep(self._pump.drop_lost_lease)


def trace_intake(trace: JobTrace, prepared: PreparedInput) -> None:
    trace.event(INTAKE)
    attributes = trace.attributes
    attributes["gen_ai.request.max_tokens"] = prepared.max_new_tokens
    attributes["gen_ai.usage.input_tokens"] = len(prepared.prompt_ids)
