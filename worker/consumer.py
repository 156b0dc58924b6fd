"""RabbitMQ: the job queue, its dead-letter queue and the cancel fanout. Whether a
message is acknowledged, dead-lettered or handed back is decided in one place, `_settle`,
from the outcome of running it."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from dataclasses import dataclass
from enum import Enum

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from redis.exceptions import RedisError, ResponseError

from worker.config import Settings, redact_url
from worker.errors import ConfigError, DeadlineExceeded, DeliveryLimitExceeded, HandBack, InvalidJob
from worker.messages import persistent_copy
from worker.metrics import Metrics
from worker.output import error_fields
from worker.publisher import Publisher
from worker.runner import JobRunner
from worker.schema import JobLimits, parse_cancel, parse_job, valid_request_id

log = logging.getLogger(__name__)

CONFIRM_TIMEOUT_S = 15.0
_MAX_HEADER_MESSAGE = 1000


class Action(Enum):
    ACK = "ack"
    DEAD_LETTER = "dead_letter"
    REQUEUE = "requeue"
    RETRY = "retry"


@dataclass(frozen=True, slots=True)
class Outcome:
    action: Action
    error: InvalidJob | None = None


class Consumer:
    """Consumes jobs and cancels; owns the AMQP connection."""

    def __init__(
        self, settings: Settings, runner: JobRunner, publisher: Publisher, metrics: Metrics
    ) -> None:
        self._settings = settings
        self._runner = runner
        self._publisher = publisher
        self._metrics = metrics
        self._limits = JobLimits(settings.max_new_tokens, settings.default_max_new_tokens)
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._cancel_queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._paused = False

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
        """Connect, declare the topology, start consuming."""
        settings = self._settings
        try:
            self._connection = await aio_pika.connect_robust(
                settings.amqp_url,
                client_properties={"connection_name": "trtllm-worker"},
                ssl_context=amqp_ssl_context(settings),
            )
        except (OSError, aiormq.exceptions.AMQPError) as exc:
            raise ConnectionError(
                f"cannot connect to RabbitMQ at {redact_url(settings.amqp_url)}: {exc}"
            ) from None
        self._connection.close_callbacks.add(self._on_connection_lost)
        channel = await self._connection.channel(publisher_confirms=True)
        channel.close_callbacks.add(self._on_connection_lost)
        self._channel = channel
        await channel.set_qos(prefetch_count=settings.max_batch)
        arguments = {"x-queue-type": settings.queue_type}
        try:
            self._queue = await channel.declare_queue(
                settings.queue, durable=True, arguments=arguments
            )
            await channel.declare_queue(settings.dead_queue, durable=True, arguments=arguments)
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise ConfigError(
                f"invalid setting WORKER_QUEUE_TYPE: queue {settings.queue!r} or "
                f"{settings.dead_queue!r} exists with other arguments ({exc})"
            ) from None
        exchange = await channel.declare_exchange(
            settings.cancel_exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
        self._cancel_queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await self._cancel_queue.bind(exchange)
        await self._cancel_queue.consume(self._on_cancel, no_ack=True)
        self._consumer_tag = await self._queue.consume(self._on_message)
        log.info(
            "consuming %s (%s) at %s, prefetch %d",
            settings.queue,
            settings.queue_type,
            redact_url(settings.amqp_url),
            settings.max_batch,
        )

    async def stop_consuming(self) -> None:
        """Take no more jobs; the ones in hand go on."""
        if self._queue is not None and self._consumer_tag is not None:
            tag, self._consumer_tag = self._consumer_tag, None
            try:
                await self._queue.cancel(tag)
            except (aio_pika.exceptions.AMQPError, RuntimeError, ConnectionError) as exc:
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
            except (aio_pika.exceptions.AMQPError, RuntimeError, ConnectionError) as exc:
                self._paused = True
                log.warning("resuming the consumer failed: %s", exc)

    def _on_connection_lost(self, _sender: object, exc: BaseException | None) -> None:
        """The deliveries of that connection died with it: the broker requeues them for
        another worker (or this one, after reconnecting), which continues their streams.
        Stop writing for them now."""
        if self._closing:
            return
        count = self._runner.hand_back_all("the broker connection was lost")
        log.warning("broker connection lost (%s): %d running jobs dropped", exc, count)

    async def wait_jobs(self, within_s: float) -> bool:
        """Wait until every job in hand is settled. True if all were."""
        if not self._tasks:
            return True
        _, pending = await asyncio.wait(list(self._tasks), timeout=within_s)
        return not pending

    async def close(self) -> None:
        self._closing = True
        if self._connection is not None:
            await self._connection.close()

    # -- cancels ----------------------------------------------------------------------

    async def _on_cancel(self, message: AbstractIncomingMessage) -> None:
        request_id = parse_cancel(message.body)
        if request_id is None:
            log.warning("ignoring a cancel message without a valid request_id")
            return
        here = self._runner.cancel(request_id)
        log.info("cancel for %s%s", request_id, " (running here)" if here else "")
        try:
            await self._publisher.mark_cancelled(self._settings.stream_prefix + request_id)
        except RedisError as exc:
            log.warning("could not store the cancel mark of %s: %s", request_id, exc)

    # -- jobs -------------------------------------------------------------------------

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        task = asyncio.create_task(self._handle(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        received_at = time.monotonic()
        if message.timestamp is not None:
            waited = time.time() - message.timestamp.timestamp()
            self._metrics.queue_wait.observe(max(waited, 0.0))
        try:
            outcome = await self._run(message, received_at)
        except asyncio.CancelledError:
            await self._settle(message, Outcome(Action.REQUEUE))
            raise
        await self._settle(message, outcome)

    async def _run(self, message: AbstractIncomingMessage, received_at: float) -> Outcome:
        request_id: str | None = None
        try:
            job = parse_job(
                message.body,
                content_type=message.content_type,
                message_id=message.message_id,
                limits=self._limits,
            )
            request_id = job.request_id
            await self._check_deliveries(message, request_id)
            result = await self._runner.run(job, received_at)
        except InvalidJob as exc:
            return Outcome(Action.DEAD_LETTER, exc)
        except DeadlineExceeded as exc:
            await self._store_error(exc.request_id, exc.code, exc.message)
            self._metrics.jobs.labels(outcome=f"error:{exc.code}").inc()
            log.info("job %s: error %s: %s", request_id, exc.code, exc.message)
            return Outcome(Action.ACK)
        except HandBack as exc:
            log.info("job %s handed back: %s", request_id, exc.message)
            return Outcome(Action.REQUEUE)
        except (RedisError, OSError) as exc:
            log.warning(
                "job %s: Redis failed (%s); the job goes back to the queue", request_id, exc
            )
            return Outcome(Action.RETRY)
        except Exception:
            # A bug, not the job's fault as far as we know: requeue it counted, so a job
            # that always triggers it ends in the dead-letter queue after the limit.
            log.exception("job %s failed unexpectedly; it goes back to the queue", request_id)
            return Outcome(Action.RETRY)
        if result.terminal is None:
            self._metrics.jobs.labels(outcome="skipped").inc()
            log.info("job %s already has a terminal entry; acknowledged", request_id)
        else:
            terminal = result.terminal
            self._metrics.jobs.labels(outcome=terminal.outcome).inc()
            self._metrics.job_duration.observe(time.monotonic() - received_at)
            log.info(
                "job %s: %s, %d tokens, first token after %s, %.3fs in all",
                request_id,
                terminal.outcome,
                terminal.generated_tokens,
                "-" if result.first_token_s is None else f"{result.first_token_s:.3f}s",
                time.monotonic() - received_at,
            )
        return Outcome(Action.ACK)

    async def _check_deliveries(self, message: AbstractIncomingMessage, request_id: str) -> None:
        """A message delivered more than WORKER_DELIVERY_LIMIT times is not run again.
        Quorum queues count earlier deliveries in `x-delivery-count`; for classic queues
        the worker counts them in Redis (a redelivered message only says it was)."""
        count = (message.headers or {}).get("x-delivery-count")
        if isinstance(count, int):
            deliveries = count + 1
        elif self._settings.queue_type == "classic":
            key = self._settings.stream_prefix + request_id
            deliveries = await self._publisher.count_delivery(key)
        else:
            deliveries = 1
        if deliveries > self._settings.delivery_limit:
            raise DeliveryLimitExceeded(
                f"delivered {deliveries} times without finishing "
                f"(WORKER_DELIVERY_LIMIT={self._settings.delivery_limit})",
                request_id=request_id,
            )

    async def _store_error(self, request_id: str | None, code: str, text: str) -> None:
        if request_id is None:
            return
        key = self._settings.stream_prefix + request_id
        try:
            await self._publisher.append_terminal(key, error_fields(code, text))
        except ResponseError as exc:  # the key is not a stream: the dead letter says why
            log.warning("cannot append the error entry of %s: %s", request_id, exc)

    async def _settle(self, message: AbstractIncomingMessage, outcome: Outcome) -> None:
        """The one place that acknowledges, dead-letters or hands a message back."""
        try:
            if outcome.action is Action.DEAD_LETTER and outcome.error is not None:
                await self._dead_letter(message, outcome.error)
                await message.ack()
            elif outcome.action is Action.ACK:
                await message.ack()
            elif outcome.action is Action.REQUEUE:
                await message.nack(requeue=True)
            else:
                await message.reject(requeue=True)
        except (aio_pika.exceptions.AMQPError, RuntimeError, ConnectionError) as exc:
            # The channel that delivered it is gone; the broker redelivers the message and
            # the stream's terminal entry (if stored) makes the rerun a no-op.
            log.warning("settling a message failed (%s); it will be redelivered", exc)
        except (RedisError, OSError) as exc:
            log.warning("dead-lettering failed (%s); the message goes back", exc)
            await message.reject(requeue=True)

    async def _dead_letter(self, message: AbstractIncomingMessage, error: InvalidJob) -> None:
        """Copy the message to `<queue>.dead` with the reason, after writing the `error`
        entry when the request id is known."""
        request_id = error.request_id or valid_request_id(message.message_id)
        await self._store_error(request_id, error.code, error.message)
        reason = " ".join(error.message.split())[:_MAX_HEADER_MESSAGE]
        headers = dict(message.headers or {})
        headers.update({"x-error-code": error.code, "x-error-message": reason})
        copy = persistent_copy(message, headers)
        assert self._channel is not None
        async with asyncio.timeout(CONFIRM_TIMEOUT_S):
            await self._channel.default_exchange.publish(
                copy, routing_key=self._settings.dead_queue, mandatory=True
            )
        self._metrics.jobs.labels(outcome="dead_lettered").inc()
        log.info("message %s dead-lettered: %s: %s", request_id or "-", error.code, reason)


def amqp_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """TLS for `amqps://` from the CA and client-certificate settings (None: aio-pika's
    defaults, or the URL's own `cafile`/`certfile`/`keyfile` query parameters)."""
    if not settings.amqp_url.startswith("amqps://"):
        return None
    if not (settings.amqp_ca_file or settings.amqp_cert_file):
        return None
    context = ssl.create_default_context(
        cafile=str(settings.amqp_ca_file) if settings.amqp_ca_file else None
    )
    if settings.amqp_cert_file:
        context.load_cert_chain(
            str(settings.amqp_cert_file),
            str(settings.amqp_key_file) if settings.amqp_key_file else None,
        )
    return context
