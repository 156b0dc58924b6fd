"""The one place that acknowledges, requeues or dead-letters a message. What happens
follows from how its job ended: success acknowledges; an error carries its own action
(`WorkerError.action`) and says whether the stream gets an `error` entry first. No other
module acks, nacks or rejects, and nothing here raises: a message whose settling fails
is redelivered by the broker, where the stream makes the rerun a no-op."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from trtllm_worker.config import Settings
from trtllm_worker.connect.messages import fold_delivery_count, persistent_copy
from trtllm_worker.connect.redis import REDIS_FAILURES
from trtllm_worker.contract.errors import Action, RetryLater, StreamUnusable, WorkerError
from trtllm_worker.contract.job import valid_request_id
from trtllm_worker.contract.queues import RETURNS_HEADER
from trtllm_worker.contract.stream import error_fields, stream_key
from trtllm_worker.ops.metrics import Metrics
from trtllm_worker.ops.tracing import DEAD_LETTERED, TERMINAL, JobTrace
from trtllm_worker.streams.store import Ended, StreamStore

log = logging.getLogger(__name__)

CONFIRM_TIMEOUT_S = 15.0
MAX_HEADER_MESSAGE = 1000
_AMQP_FAILURES = (aio_pika.exceptions.AMQPError, RuntimeError, ConnectionError, TimeoutError)
_FAILURES: tuple[type[Exception], ...] = (*REDIS_FAILURES, *_AMQP_FAILURES)
_ACKED = frozenset({Action.ACK, Action.DEAD_LETTER, Action.RETURN})
"""Actions that end with the message acknowledged (a dead letter or a returned job's
copy was confirmed by the broker first)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a job ended, as far as its message is concerned."""

    action: Action
    error: WorkerError | None = None


ACKNOWLEDGE = Outcome(Action.ACK)
HAND_BACK = Outcome(Action.REQUEUE)


def outcome_of(exc: Exception) -> Outcome:
    """The outcome of a job that raised `exc`: a `WorkerError` says its own action;
    Redis or the network failing, or a bug, retries the job counted (so a job that always
    fails ends in the dead-letter queue after the limit)."""
    if isinstance(exc, WorkerError):
        return Outcome(exc.action, exc)
    if isinstance(exc, REDIS_FAILURES):
        return Outcome(Action.RETRY, RetryLater(f"Redis failed: {exc}"))
    return Outcome(Action.RETRY, RetryLater(f"{type(exc).__name__}: {exc}"))


@dataclass(slots=True)
class _Delivered:
    """One channel's deliveries not yet passed by its multiple-ack front."""

    channel: object
    order: deque[int] = field(default_factory=deque)
    settled: set[int] = field(default_factory=set)
    to_ack: dict[int, AbstractIncomingMessage] = field(default_factory=dict)


class AckBatcher:
    """Acknowledges in as few frames as delivery order allows, once per event-loop turn:
    the run of settled messages at the front of what a channel delivered goes as one
    ack with `multiple` (its last tag), the other acks one by one, so that a long job at
    the front never holds the prefetch window of the short ones behind it. Only
    messages registered by `delivered` are batched."""

    def __init__(self) -> None:
        self._channels: dict[int, _Delivered] = {}
        self._scheduled = False
        self._outbox: deque[tuple[AbstractIncomingMessage, bool]] = deque()
        self._sender: asyncio.Task[None] | None = None
        """One task sends every ack in the order decided: a multiple ack overtaking an
        earlier single ack of a tag it covers would make that one an unknown tag, which
        closes the channel."""

    def delivered(self, message: AbstractIncomingMessage) -> None:
        channel = message.channel
        entry = self._channels.get(id(channel))
        if entry is None or entry.channel is not channel:
            entry = self._channels[id(channel)] = _Delivered(channel)
        entry.order.append(message.delivery_tag or 0)

    def _entry(self, message: AbstractIncomingMessage) -> _Delivered | None:
        if not self._channels:  # nothing registered (a settler outside a consumer)
            return None
        try:
            channel = message.channel
        except _AMQP_FAILURES:  # aio-pika raises ChannelInvalidStateError once it closed
            return None
        entry = self._channels.get(id(channel))
        return entry if entry is not None and entry.channel is channel else None

    def batches(self, message: AbstractIncomingMessage) -> bool:
        return self._entry(message) is not None

    def ack(self, message: AbstractIncomingMessage) -> None:
        entry = self._entry(message)
        assert entry is not None
        entry.to_ack[message.delivery_tag or 0] = message
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def settled(self, message: AbstractIncomingMessage) -> None:
        """A registered message was nacked or rejected (one by one, at once)."""
        entry = self._entry(message)
        if entry is not None:
            entry.settled.add(message.delivery_tag or 0)

    def _flush(self) -> None:
        self._scheduled = False
        sends: list[tuple[AbstractIncomingMessage, bool]] = []
        for key, entry in list(self._channels.items()):
            last = None
            while entry.order and (
                entry.order[0] in entry.to_ack or entry.order[0] in entry.settled
            ):
                tag = entry.order.popleft()
                entry.settled.discard(tag)
                last = entry.to_ack.pop(tag, last)
            if last is not None:
                sends.append((last, True))
            for tag, message in entry.to_ack.items():
                sends.append((message, False))
                entry.settled.add(tag)
            entry.to_ack.clear()
            if not entry.order:
                del self._channels[key]
        if sends:
            self._outbox.extend(sends)
            if self._sender is None or self._sender.done():
                self._sender = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        while self._outbox:
            message, multiple = self._outbox.popleft()
            try:
                await message.ack(multiple=multiple)
            except _AMQP_FAILURES as exc:
                # The channel that delivered it is gone; the broker redelivers and the
                # stream's terminal entry makes the rerun a no-op.
                log.warning("acknowledging failed (%s); the message will be redelivered", exc)

    async def drain(self) -> None:
        """Send what is batched now (before the connection closes)."""
        if self._scheduled:
            self._flush()
        if self._sender is not None:
            await asyncio.gather(self._sender, return_exceptions=True)


class Settler:
    """Settles messages of one consumer (its channel publishes the dead letters)."""

    def __init__(
        self,
        settings: Settings,
        store: StreamStore,
        metrics: Metrics,
        channel: Callable[[], AbstractChannel | None],
    ) -> None:
        self._settings = settings
        self._store = store
        self._metrics = metrics
        self._channel = channel
        self.acks = AckBatcher()

    async def settle(
        self, message: AbstractIncomingMessage, outcome: Outcome, trace: JobTrace | None = None
    ) -> Action:
        """Carry out the outcome; returns the action taken (a failed error entry or dead
        letter turns into a counted retry)."""
        action = outcome.action
        error = outcome.error
        try:
            if (
                error is not None
                and error.writes_error_entry
                and await self._error_entry(message, error)
                and trace is not None
            ):
                trace.event(TERMINAL)
            if action is Action.DEAD_LETTER and error is not None:
                await self._dead_letter(message, error)
                if trace is not None:
                    trace.event(DEAD_LETTERED, attributes={"error.type": error.code})
            if action is Action.RETURN:
                if await self._return_in_place(message, error):
                    await self._amqp(message, Action.REQUEUE)
                    return action
                await self._put_back(message)
        except _FAILURES as exc:
            if action is Action.RETURN:
                # no copy in the queue: the message itself goes back (a quorum queue
                # counts that one as a delivery; the job still runs once)
                log.warning("putting a copy back failed (%s); the message goes back", exc)
                action = Action.REQUEUE
            else:
                log.warning("%s failed (%s); the message goes back", action.value, exc)
                action = Action.RETRY
        if error is not None and action is Action.ACK:
            self._metrics.jobs.labels(outcome=f"error:{error.code}").inc()
        await self._amqp(message, action)
        return action

    async def _return_in_place(
        self, message: AbstractIncomingMessage, error: WorkerError | None
    ) -> bool:
        """On a classic queue a returned job goes back with a requeue: at once (no copy
        to confirm), and to its place in the queue. RabbitMQ does not count it there,
        and the worker, which counts a classic queue's redeliveries itself, is told
        first that the redelivery coming is not a failed one. Redis failing, the job
        goes back as a copy instead (quorum queues always: they count every requeue)."""
        if self._settings.queue_type != "classic":
            return False
        request_id = (error.request_id if error is not None else None) or valid_request_id(
            message.message_id
        )
        if request_id is None:
            return False
        try:
            await self._store.credit_delivery(stream_key(self._settings.stream_prefix, request_id))
        except REDIS_FAILURES as exc:
            log.warning("Redis failed (%s); the job goes back as a copy", exc)
            return False
        return True

    async def _amqp(self, message: AbstractIncomingMessage, action: Action) -> None:
        if action in _ACKED and self.acks.batches(message):
            self.acks.ack(message)
            return
        self.acks.settled(message)
        try:
            if action in _ACKED:
                await message.ack()
            elif action is Action.REQUEUE:
                await message.nack(requeue=True)
            else:
                await message.reject(requeue=True)
        except _AMQP_FAILURES as exc:
            # The channel that delivered it is gone; the broker redelivers the message and
            # the stream's terminal entry (if stored) makes the rerun a no-op.
            log.warning(
                "settling the message (%s) failed (%s); it will be redelivered", action.value, exc
            )

    async def _error_entry(self, message: AbstractIncomingMessage, error: WorkerError) -> bool:
        """The `error` entry, through the store's one fenced end: with the lease the job
        held, or, with none, only where no worker owns the stream. True if it is stored
        now; raises on Redis failures."""
        request_id = error.request_id or valid_request_id(message.message_id)
        if request_id is None:
            return False
        key = stream_key(self._settings.stream_prefix, request_id)
        try:
            ended = await self._store.end(
                key,
                error_fields(error.code, error.message),
                error.lease,
                tenant=error.tenant,
                adapter=error.adapter,
            )
        except StreamUnusable as exc:  # the key is not a stream: the dead letter says why
            log.warning("cannot append the error entry: %s", exc.message)
            return False
        if ended is Ended.NOT_OURS:
            log.warning("error entry not written: another worker holds the request's lease")
        return ended is Ended.STORED

    async def _put_back(self, message: AbstractIncomingMessage) -> None:
        """Put a copy of the message back in its queue, confirmed by the broker, before
        the original is acknowledged: a requeue would count as a delivery on a quorum
        queue (RabbitMQ 4.0 counts every return, and drops a message past its delivery
        limit). The copy keeps the priority and carries the failed deliveries so far.
        Killed between the two, both copies run: the stream's lease and terminal entry
        make the second a no-op."""
        headers = fold_delivery_count(dict(message.headers or {}))
        returns = headers.get(RETURNS_HEADER)
        headers[RETURNS_HEADER] = (returns if isinstance(returns, int) else 0) + 1
        channel = self._channel()
        if channel is None:
            raise ConnectionError("no channel to put the job back on")
        async with asyncio.timeout(CONFIRM_TIMEOUT_S):
            await channel.default_exchange.publish(
                persistent_copy(message, headers),
                routing_key=self._settings.queue,
                mandatory=True,
            )

    async def _dead_letter(self, message: AbstractIncomingMessage, error: WorkerError) -> None:
        """Copy the message to `<queue>.dead` with the reason, confirmed by the broker."""
        reason = " ".join(error.message.split())[:MAX_HEADER_MESSAGE]
        headers = dict(message.headers or {})
        headers.update({"x-error-code": error.code, "x-error-message": reason})
        channel = self._channel()
        if channel is None:
            raise ConnectionError("no channel to publish the dead letter on")
        async with asyncio.timeout(CONFIRM_TIMEOUT_S):
            await channel.default_exchange.publish(
                persistent_copy(message, headers),
                routing_key=self._settings.dead_queue,
                mandatory=True,
            )
        self._metrics.jobs.labels(outcome="dead_lettered").inc()
        log.info("message dead-lettered: %s: %s", error.code, reason)
