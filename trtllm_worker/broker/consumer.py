"""RabbitMQ: the job queue, its dead-letter queue and the cancel fanout. A message runs
as one task; how it ended becomes an `Outcome`, which `settle` carries out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)

from trtllm_worker.broker.cancel import CancelListener
from trtllm_worker.broker.settle import ACKNOWLEDGE, HAND_BACK, Outcome, Settler, outcome_of
from trtllm_worker.config import Settings, redact_url
from trtllm_worker.connect import shortstr
from trtllm_worker.connect.amqp import amqp_reply, connect_robust
from trtllm_worker.connect.grants import rabbitmq_refusal
from trtllm_worker.connect.messages import published_ns, undecodable_fields
from trtllm_worker.connect.redis import REDIS_FAILURES
from trtllm_worker.contract.errors import (
    Action,
    ConfigError,
    DeliveryLimitExceeded,
    InvalidJob,
    WorkerError,
)
from trtllm_worker.contract.exits import Unavailable
from trtllm_worker.contract.job import Job, request_id_of
from trtllm_worker.contract.priority import priority_class, priority_of
from trtllm_worker.contract.queues import (
    DELIVERIES_HEADER,
    cancel_queue_name,
    job_queue_arguments,
)
from trtllm_worker.contract.stream import stream_key
from trtllm_worker.ops.log import request_id_var
from trtllm_worker.ops.metrics import Metrics
from trtllm_worker.ops.tracing import (
    HANDED_BACK,
    JobTrace,
    Tracing,
    begin_trace,
    describe_job,
)
from trtllm_worker.pipeline.intake import Intake
from trtllm_worker.pipeline.runner import Admit, JobResult
from trtllm_worker.streams.store import StreamStore

log = logging.getLogger(__name__)

# before the worker connects: a short string that is not UTF-8 (a property, a header key,
# a routing key) would otherwise end the connection it arrives on. The worker's process
# only: the client SDK does not patch its host's pamqp.
shortstr.install()

RunJob = Callable[[Job, float, JobTrace | None, Admit | None, int], Awaitable[JobResult]]
"""The runner's `run`: job, when it was received, its trace, the delivery check, its
priority."""
_AMQP_FAILURES = (aio_pika.exceptions.AMQPError, RuntimeError, ConnectionError)
_VERB = {
    Action.ACK: "ended",
    Action.DEAD_LETTER: "to be dead-lettered",
    Action.REQUEUE: "handed back",
    Action.RETRY: "to be retried",
    Action.RETURN: "returned to the queue",
}
QUORUM_PRIORITIES_SINCE = (4, 0)
"""RabbitMQ orders a quorum queue's messages by priority (two levels) from 4.0 on."""


class Consumer:
    """Consumes jobs and cancels; owns the AMQP connection."""

    def __init__(
        self,
        settings: Settings,
        intake: Intake,
        run_job: RunJob,
        cancels: CancelListener,
        store: StreamStore,
        metrics: Metrics,
        on_connection_lost: Callable[[str], int],
        name: str = "trtllm-worker",
        prefetch: int | None = None,
        tracing: Tracing | None = None,
        model_name: str = "echo",
    ) -> None:
        self._settings = settings
        self._intake = intake
        self._run_job = run_job
        self._cancels = cancels
        self._store = store
        self._metrics = metrics
        self._on_lost = on_connection_lost
        self._name = name
        self._prefetch = prefetch or settings.max_batch
        """What the engine really schedules at once: the broker hands no more."""
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._paused = False
        self._settler = Settler(settings, store, metrics, lambda: self._channel)
        self._tracing = tracing
        self._model_name = model_name
        self.orders_priorities = True
        """Whether the broker delivers the job queue by priority (known once started)."""

    @property
    def connected(self) -> bool:
        connection = self._connection
        return (
            connection is not None
            and not connection.is_closed
            and self._channel is not None
            and not self._channel.is_closed
        )

    @property
    def jobs_in_hand(self) -> int:
        return len(self._tasks)

    async def start(self) -> None:
        """Connect, declare the topology, start consuming. A permission the broker
        refuses is `Unavailable` with one line naming it."""
        try:
            await self._start()
        except aiormq.exceptions.ChannelAccessRefused as exc:
            raise Unavailable(rabbitmq_refusal(amqp_reply(exc))) from None

    async def _start(self) -> None:
        settings = self._settings
        self._connection = await connect_robust(settings, self._name)
        self._connection.close_callbacks.add(self._connection_lost)
        channel = await self._connection.channel(publisher_confirms=True)
        channel.close_callbacks.add(self._connection_lost)
        self._channel = channel
        await channel.set_qos(prefetch_count=self._prefetch)
        try:
            self._queue = await channel.declare_queue(
                settings.queue,
                durable=True,
                arguments={**job_queue_arguments(settings.queue_type)},
            )
            await channel.declare_queue(
                settings.dead_queue,
                durable=True,
                arguments={"x-queue-type": settings.queue_type},
            )
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise ConfigError(queue_mismatch(settings, amqp_reply(exc))) from None
        self._say_if_priorities_are_ignored()
        exchange = await channel.declare_exchange(
            settings.cancel_exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
        # named after the exchange, so that one permission pattern covers it (an
        # unnamed queue gets a random `amq_…` name from aio-pika)
        cancel_queue = await channel.declare_queue(
            cancel_queue_name(settings.cancel_exchange), exclusive=True, auto_delete=True
        )
        await cancel_queue.bind(exchange)
        await cancel_queue.consume(self._cancels.on_message, no_ack=True)
        self._consumer_tag = await self._queue.consume(self._on_message)
        log.info(
            "consuming %s (%s) at %s, prefetch %d",
            settings.queue,
            settings.queue_type,
            redact_url(settings.amqp_url),
            self._prefetch,
        )

    def _say_if_priorities_are_ignored(self) -> None:
        """A quorum queue on RabbitMQ before 4.0 delivers in arrival order: say so once,
        at start (the worker still starts held jobs by priority and pauses for them)."""
        if self._settings.queue_type != "quorum" or self._connection is None:
            return
        version = broker_version(self._connection)
        if version is not None and version < QUORUM_PRIORITIES_SINCE:
            self.orders_priorities = False
            log.warning(
                "RabbitMQ %s ignores message priorities on quorum queue %r (ordered from "
                "4.0 on): jobs leave the queue in arrival order; the worker still starts "
                "the jobs it holds by priority and pauses for interactive ones",
                ".".join(map(str, version)),
                self._settings.queue,
            )

    async def stop_consuming(self) -> None:
        """Take no more jobs; the ones in hand go on."""
        if self._queue is not None and self._consumer_tag is not None:
            tag, self._consumer_tag = self._consumer_tag, None
            try:
                await self._queue.cancel(tag)
            except _AMQP_FAILURES as exc:
                log.warning("cancelling the consumer failed: %s", exc)

    async def pause(self) -> None:
        """Take no new jobs for now (Redis is unreachable): the broker gives them to
        other workers. The jobs in hand wait for Redis."""
        if not self._paused and not self._closing:
            self._paused = True
            log.warning("pausing: no new jobs until Redis answers again")
            await self.stop_consuming()

    async def resume(self) -> None:
        if self._paused and not self._closing and self._queue is not None:
            self._paused = False
            log.info("resuming: consuming %s again", self._settings.queue)
            try:
                self._consumer_tag = await self._queue.consume(self._on_message)
            except _AMQP_FAILURES as exc:
                self._paused = True
                log.warning("resuming the consumer failed: %s", exc)

    def _connection_lost(self, _sender: object, exc: BaseException | None) -> None:
        """The deliveries of that connection died with it: the broker requeues them for
        another worker (or this one, after reconnecting), which continues their streams.
        Stop writing for them now."""
        if self._closing:
            return
        count = self._on_lost("the broker connection was lost")
        log.warning("broker connection lost (%s): %d running jobs dropped", exc, count)
        if "delivery acknowledgement" in str(exc):
            log.warning(
                "the broker's consumer timeout ended a job that ran longer: queue %r was "
                "declared before the worker set x-consumer-timeout on it, a policy sets a "
                "lower consumer-timeout, or RabbitMQ is older than 3.12 (node-wide "
                "consumer_timeout only); see README 'Delivery and acknowledgement'",
                self._settings.queue,
            )

    async def wait_jobs(self, within_s: float) -> bool:
        """Wait until every job in hand is settled. True if all were."""
        if not self._tasks:
            return True
        _, pending = await asyncio.wait(list(self._tasks), timeout=within_s)
        return not pending

    async def close(self) -> None:
        self._closing = True
        await self._settler.acks.drain()
        if self._connection is not None:
            await self._connection.close()

    # -- jobs -------------------------------------------------------------------------

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        self._settler.acks.delivered(message)
        task = asyncio.create_task(self._handle(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        """One message, in a task of its own (so its log lines carry its request id)."""
        undecodable = undecodable_fields(message)
        if undecodable:
            await self._refuse_undecodable(message, undecodable)
            return
        received_at = time.monotonic()
        priority = priority_of(message.priority)
        klass = priority_class(priority, self._settings.preempt_priority)
        published = published_ns(message)
        if published is not None:
            waited = time.time() - published / 1e9
            self._metrics.by_class(self._metrics.queue_wait, klass).observe(max(waited, 0.0))
        trace = None
        if self._tracing is not None:
            trace = begin_trace(
                message.headers,
                published,
                received_at,
                self._settings.queue,
                message.message_id,
            )
            trace.attributes["trtllm_worker.priority"] = priority
        try:
            outcome = await self._run(message, received_at, trace, priority)
        except asyncio.CancelledError:
            await self._settler.settle(message, HAND_BACK, trace)
            self._finish_trace(trace, HAND_BACK, Action.REQUEUE)
            raise
        action = await self._settler.settle(message, outcome, trace)
        self._finish_trace(trace, outcome, action)

    async def _refuse_undecodable(
        self, message: AbstractIncomingMessage, fields: list[str]
    ) -> None:
        """A message whose AMQP short strings are not UTF-8 (`trtllm_worker.connect.shortstr`) is
        invalid: dead-lettered without them, the reason naming them and their bytes, and
        acknowledged. Its stream gets the `error` entry if its body names a request id.
        Nothing of it reaches logs or traces but that reason."""
        request_id = request_id_of(message.body)
        request_id_var.set(request_id)
        error = InvalidJob(
            "AMQP properties or header keys are not UTF-8 (left out of the dead letter): "
            + "; ".join(fields),
            request_id=request_id,
        )
        log.info("%s: %s: %s", _VERB[error.action], error.code, error.message)
        await self._settler.settle(message, Outcome(error.action, error))

    def _finish_trace(self, trace: JobTrace | None, outcome: Outcome, action: Action) -> None:
        if trace is None or self._tracing is None:
            return
        error = outcome.error
        attributes = trace.attributes
        if error is not None and action is not Action.RETURN:  # a pause is no error
            attributes["error.type"] = error.code
        if action in (Action.REQUEUE, Action.RETRY, Action.RETURN):
            trace.event(HANDED_BACK, attributes={"trtllm_worker.action": action.value})
        # an error that ends the job (its stream has an error entry) marks the span failed
        self._tracing.finish(trace, error if action in (Action.ACK, Action.DEAD_LETTER) else None)

    async def _run(
        self,
        message: AbstractIncomingMessage,
        received_at: float,
        trace: JobTrace | None,
        priority: int,
    ) -> Outcome:
        request_id_var.set(message.message_id)
        try:
            job = self._intake.read(
                message.body, content_type=message.content_type, message_id=message.message_id
            )
            request_id_var.set(job.request_id)
            if trace is not None:
                describe_job(trace, job, self._model_name)
            request_id = job.request_id
            # checked once the job holds its lease, after a finished stream (a duplicate)
            # was acknowledged: the error entry then goes through that lease
            result = await self._run_job(
                job,
                received_at,
                trace,
                lambda: self._check_deliveries(message, request_id),
                priority,
            )
        except Exception as exc:
            outcome = outcome_of(exc)
            error = outcome.error
            assert error is not None
            if error.request_id:
                request_id_var.set(error.request_id)
            if outcome.action is Action.RETURN:  # no error: made room for a job
                log.info("%s: %s", _VERB[outcome.action], error.message)
            elif isinstance(exc, WorkerError):
                log.info("%s: %s: %s", _VERB[outcome.action], error.code, error.message)
            elif isinstance(exc, REDIS_FAILURES):
                log.warning("Redis failed (%s); the job goes back to the queue", exc)
            else:
                log.exception("the job failed unexpectedly; it goes back to the queue")
            return outcome
        self._log_result(result, received_at)
        if trace is not None:
            trace_result(trace, result)
        return ACKNOWLEDGE

    def _log_result(self, result: JobResult, received_at: float) -> None:
        if result.terminal is None:
            self._metrics.jobs.labels(outcome="skipped").inc()
            log.info("already has a terminal entry; acknowledged")
            return
        terminal = result.terminal
        elapsed = time.monotonic() - received_at
        self._metrics.jobs.labels(outcome=terminal.outcome).inc()
        self._metrics.job_duration.observe(elapsed)
        log.info(
            "%s, %d tokens, first token after %s, %.3fs in all",
            terminal.outcome,
            terminal.generated_tokens,
            "-" if result.first_token_s is None else f"{result.first_token_s:.3f}s",
            elapsed,
        )

    async def _check_deliveries(self, message: AbstractIncomingMessage, request_id: str) -> None:
        """A message delivered more than WORKER_DELIVERY_LIMIT times is not run again
        (called by the runner once the job holds its lease and its stream is unfinished:
        a copy of a finished job is acknowledged before it is counted).
        Quorum queues count earlier deliveries in `x-delivery-count`; for classic queues
        the worker counts the request's redeliveries in Redis (a redelivered message only
        says it was). A first delivery is never counted: an extra copy of a job (a
        producer's retry) is not a failed delivery of it."""
        headers = message.headers or {}
        count = headers.get("x-delivery-count")
        carried = headers.get(DELIVERIES_HEADER)
        # a copy put back to make room for a more urgent job starts counting again from
        # 0 at the broker: it carries the failed deliveries before it
        earlier = carried if isinstance(carried, int) and carried > 0 else 0
        if isinstance(count, int):
            deliveries = earlier + count + 1
        elif self._settings.queue_type == "classic":
            deliveries = 1
            if message.redelivered:
                key = stream_key(self._settings.stream_prefix, request_id)
                deliveries += await self._store.count_delivery(key)
        else:
            deliveries = earlier + 1
        if deliveries > self._settings.delivery_limit:
            raise DeliveryLimitExceeded(
                f"delivered {deliveries} times without finishing "
                f"(WORKER_DELIVERY_LIMIT={self._settings.delivery_limit})",
                request_id=request_id,
            )


def queue_mismatch(settings: Settings, reply: str) -> str:
    """The one line for a job or dead-letter queue that exists with other arguments than
    the worker declares: for a classic queue without priorities, what to do."""
    if "x-max-priority" in reply:
        return (
            f"queue {settings.queue!r} exists without priorities (a classic queue orders "
            f"them only if declared with x-max-priority, which cannot be added later): "
            f"migrate it as the docs' 'Migrating a queue to priorities' says, or set "
            f"WORKER_QUEUE to a new queue ({reply})"
        )
    return (
        f"invalid setting WORKER_QUEUE_TYPE: queue {settings.queue!r} or "
        f"{settings.dead_queue!r} exists with other arguments ({reply})"
    )


def broker_version(connection: AbstractConnection) -> tuple[int, ...] | None:
    """RabbitMQ's version from the connection's server properties, if it says."""
    underlay = getattr(connection.transport, "connection", None)
    version = (getattr(underlay, "server_properties", None) or {}).get("version")
    if isinstance(version, bytes):
        version = version.decode(errors="replace")
    if not isinstance(version, str):
        return None
    parts = []
    for part in version.split(".")[:3]:
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts) or None


def trace_result(trace: JobTrace, result: JobResult) -> None:
    """The span's GenAI usage and response attributes, from the terminal entry."""
    terminal = result.terminal
    attributes = trace.attributes
    if terminal is None:
        attributes["trtllm_worker.outcome"] = "skipped"
        return
    attributes["trtllm_worker.outcome"] = terminal.outcome
    attributes["gen_ai.usage.output_tokens"] = terminal.generated_tokens
    finish = terminal.fields.get("finish_reason")
    if finish is not None:
        attributes["gen_ai.response.finish_reasons"] = (str(finish),)
    if result.first_token_s is not None:
        attributes["trtllm_worker.time_to_first_token_s"] = result.first_token_s
