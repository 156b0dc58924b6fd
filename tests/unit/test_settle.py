"""Settling messages (`trtllm_worker/broker/settle.py`) and the consumer's handler around it,
with fakes for the AMQP message, channel and store: what matters here is which AMQP
call is made and that nothing escapes, which a real broker would only make slower to
see. The two defects fixed in the reshape each have a test here:

1. a `DeadlineExceeded` whose error entry then failed with a Redis connection error
   left the message unsettled (its prefetch slot lost until the channel closed);
2. settling's own `reject` could raise out of the handler."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import aiormq
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from redis.exceptions import ConnectionError as RedisConnectionError

from trtllm_worker.broker.cancel import CancelListener
from trtllm_worker.broker.consumer import Consumer
from trtllm_worker.broker.settle import AckBatcher, Settler, outcome_of
from trtllm_worker.config import Settings
from trtllm_worker.contract.errors import (
    Action,
    DeadlineExceeded,
    HandBack,
    InvalidJob,
    RetryLater,
    StreamUnusable,
)
from trtllm_worker.contract.job import Job
from trtllm_worker.contract.stream import Fields
from trtllm_worker.ops.metrics import Metrics
from trtllm_worker.pipeline.intake import Intake
from trtllm_worker.pipeline.runner import JobResult
from trtllm_worker.streams.store import Ended, StreamStore
from trtllm_worker.tokenizer import load_tokenizer


class FakeMessage:
    """What the consumer reads of an incoming message, and the settle calls it gets."""

    def __init__(self, body: bytes, *, message_id: str | None = None, fail: str = "") -> None:
        self.body = body
        self.message_id = message_id
        self.content_type = "application/json"
        self.headers: dict[str, Any] = {}
        self.timestamp = None
        self.calls: list[str] = []
        self._fail = fail

    async def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self._fail:
            raise aiormq.exceptions.ChannelInvalidStateError("channel closed")

    async def ack(self) -> None:
        await self._call("ack")

    async def nack(self, requeue: bool = True) -> None:
        await self._call("nack" if requeue else "nack-drop")

    async def reject(self, requeue: bool = False) -> None:
        await self._call("reject" if requeue else "reject-drop")

    # the fields persistent_copy reads
    content_encoding = priority = correlation_id = reply_to = type = app_id = None


class FakeStore:
    """The store's `end`, recorded; `fail` makes it raise like a lost Redis."""

    def __init__(self, fail: BaseException | None = None, ended: Ended = Ended.STORED) -> None:
        self.ends: list[tuple[str, Fields]] = []
        self.tenants: list[str | None] = []
        self._fail = fail
        self._ended = ended

    async def end(
        self,
        key: str,
        fields: Fields,
        lease: str = "",
        seq_id: str = "",
        *,
        tenant: str | None = None,
        adapter: str | None = None,
    ) -> Ended:
        if self._fail is not None:
            raise self._fail
        self.ends.append((key, fields))
        self.tenants.append(tenant)
        return self._ended

    async def count_delivery(self, key: str) -> int:
        return 1

    async def mark_cancelled(self, key: str) -> None:
        pass


class FakeExchange:
    def __init__(self, fail: bool) -> None:
        self.published: list[tuple[Any, str]] = []
        self._fail = fail

    async def publish(self, message: Any, routing_key: str, mandatory: bool = False) -> None:
        if self._fail:
            raise aiormq.exceptions.ChannelInvalidStateError("channel closed")
        self.published.append((message, routing_key))


class FakeChannel:
    def __init__(self, fail: bool = False) -> None:
        self.default_exchange = FakeExchange(fail)


@pytest.fixture
def settings() -> Settings:
    return Settings(_env_file=None, queue="q", stream_prefix="p:")


def settler(settings: Settings, store: FakeStore, channel: FakeChannel | None) -> Settler:
    return Settler(
        settings,
        cast(StreamStore, store),
        Metrics(),
        lambda: cast(AbstractChannel | None, channel),
    )


def incoming(message: FakeMessage) -> AbstractIncomingMessage:
    return cast(AbstractIncomingMessage, message)


@pytest.mark.parametrize(
    ("error", "action", "calls"),
    [
        (InvalidJob("bad", request_id="r"), Action.DEAD_LETTER, ["ack"]),
        (DeadlineExceeded("late", request_id="r"), Action.ACK, ["ack"]),
        (HandBack("stopping", request_id="r"), Action.REQUEUE, ["nack"]),
        (RetryLater("redis refused"), Action.RETRY, ["reject"]),
    ],
)
async def test_each_error_carries_its_action(
    settings: Settings, error: Exception, action: Action, calls: list[str]
) -> None:
    message = FakeMessage(b"{}")
    store, channel = FakeStore(), FakeChannel()
    taken = await settler(settings, store, channel).settle(incoming(message), outcome_of(error))
    assert (taken, message.calls) == (action, calls)
    wrote_entry = action in (Action.DEAD_LETTER, Action.ACK)
    assert [key for key, _ in store.ends] == (["p:r"] if wrote_entry else [])
    dead = [key for _, key in channel.default_exchange.published]
    assert dead == (["q.dead"] if action is Action.DEAD_LETTER else [])


def test_unexpected_errors_are_retried_counted() -> None:
    assert outcome_of(KeyError("bug")).action is Action.RETRY
    assert outcome_of(RedisConnectionError("gone")).action is Action.RETRY
    assert outcome_of(StreamUnusable("not a stream")).action is Action.DEAD_LETTER


async def test_dead_letter_carries_the_reason_headers(settings: Settings) -> None:
    message = FakeMessage(b"{}", message_id="m1")
    channel = FakeChannel()
    error = InvalidJob("parameters.top_p: too\nlarge", request_id="m1")
    await settler(settings, FakeStore(), channel).settle(incoming(message), outcome_of(error))
    ((copy, routing_key),) = channel.default_exchange.published
    assert routing_key == "q.dead"
    assert copy.headers["x-error-code"] == "invalid_request"
    assert copy.headers["x-error-message"] == "parameters.top_p: too large"


async def test_deadline_whose_error_entry_fails_is_still_settled(settings: Settings) -> None:
    """Defect 1: the error entry of a passed deadline fails (Redis gone): the message is
    handed back counted instead of staying unsettled."""
    message = FakeMessage(b"{}")
    store = FakeStore(fail=RedisConnectionError("Connection closed by server."))
    error = DeadlineExceeded("deadline passed", request_id="r")
    taken = await settler(settings, store, FakeChannel()).settle(
        incoming(message), outcome_of(error)
    )
    assert (taken, message.calls) == (Action.RETRY, ["reject"])


async def test_settling_never_raises(settings: Settings) -> None:
    """Defect 2: the dead letter fails (Redis gone) and so does the fallback `reject`
    (the channel closed): the handler gets no exception; the broker redelivers."""
    message = FakeMessage(b"{}", fail="reject")
    store = FakeStore(fail=RedisConnectionError("gone"))
    outcome = outcome_of(InvalidJob("bad", request_id="r"))
    taken = await settler(settings, store, FakeChannel()).settle(incoming(message), outcome)
    assert (taken, message.calls) == (Action.RETRY, ["reject"])


async def test_a_dead_letter_that_cannot_be_published_goes_back(settings: Settings) -> None:
    message = FakeMessage(b"{}")
    outcome = outcome_of(InvalidJob("bad", request_id="r"))
    taken = await settler(settings, FakeStore(), FakeChannel(fail=True)).settle(
        incoming(message), outcome
    )
    assert (taken, message.calls) == (Action.RETRY, ["reject"])


async def test_an_error_entry_refused_by_the_fence_still_dead_letters(settings: Settings) -> None:
    """Another worker holds the request's lease: its stream is not touched, the message
    is dead-lettered all the same."""
    message = FakeMessage(b"{}")
    channel = FakeChannel()
    outcome = outcome_of(InvalidJob("bad", request_id="r"))
    store = FakeStore(ended=Ended.NOT_OURS)
    taken = await settler(settings, store, channel).settle(incoming(message), outcome)
    assert (taken, message.calls) == (Action.DEAD_LETTER, ["ack"])
    assert len(channel.default_exchange.published) == 1


def consumer(
    settings: Settings, store: FakeStore, run_job: Callable[[Job, float, Any, Any, int], Any]
) -> Consumer:
    fake_store = cast(StreamStore, store)
    made = Consumer(
        settings,
        Intake(settings, load_tokenizer(None, None)),
        run_job,
        CancelListener(settings, fake_store, lambda _: False),
        fake_store,
        Metrics(),
        on_connection_lost=lambda _: 0,
    )
    made._channel = cast(AbstractChannel, FakeChannel())
    return made


async def test_handler_settles_a_deadline_job_when_redis_fails(settings: Settings) -> None:
    """Defect 1, end to end through the consumer's handler (before the fix the Redis
    error escaped `_run` and the message was never settled)."""
    past = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()

    async def run_job(
        job: Job, received_at: float, trace: object, admit: object, priority: int
    ) -> JobResult:
        raise DeadlineExceeded("deadline passed", request_id=job.request_id)

    store = FakeStore(fail=RedisConnectionError("Connection closed by server."))
    message = FakeMessage(b'{"request_id": "r1", "inputs": "x", "deadline": "%s"}' % past.encode())
    await consumer(settings, store, run_job)._handle(incoming(message))
    assert message.calls == ["reject"]


async def test_handler_dead_letters_an_invalid_job(settings: Settings) -> None:
    async def run_job(
        job: Job, received_at: float, trace: object, admit: object, priority: int
    ) -> JobResult:
        raise AssertionError("an invalid job never runs")

    store = FakeStore()
    message = FakeMessage(b'{"request_id": "r2", "inputs": "x", "colour": 1}')
    await consumer(settings, store, run_job)._handle(incoming(message))
    assert message.calls == ["ack"]
    assert store.ends[0][0] == "p:r2"
    assert store.ends[0][1]["code"] == "invalid_request"


async def test_an_invalid_jobs_error_entry_counts_under_its_readable_tenant(
    settings: Settings,
) -> None:
    async def run_job(
        job: Job, received_at: float, trace: object, admit: object, priority: int
    ) -> JobResult:
        raise AssertionError("an invalid job never runs")

    store = FakeStore()
    for body in (
        b'{"request_id": "r4", "inputs": "x", "tenant": "acme", "colour": 1}',
        b'{"request_id": "r5", "inputs": "x", "tenant": "no spaces"}',
    ):
        await consumer(settings, store, run_job)._handle(incoming(FakeMessage(body)))
    assert store.tenants == ["acme", None]  # a malformed tenant counts as `-`
    assert "tenant" in str(store.ends[1][1]["message"])


async def test_a_cancelled_handler_hands_its_message_back(settings: Settings) -> None:
    started = asyncio.Event()

    async def run_job(
        job: Job, received_at: float, trace: object, admit: object, priority: int
    ) -> JobResult:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    message = FakeMessage(b'{"request_id": "r3", "inputs": "x"}')
    task = asyncio.create_task(consumer(settings, FakeStore(), run_job)._handle(incoming(message)))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert message.calls == ["nack"]


class SlowAckMessage:
    """A delivered message whose ack waits for the socket (`sent` lets it through), as
    aiormq's ack does under back-pressure; the order acks reach the socket is recorded."""

    def __init__(self, channel: object, tag: int, wire: list[tuple[int, bool]],
                 sent: asyncio.Event) -> None:  # fmt: skip
        self.channel = channel
        self.delivery_tag = tag
        self._wire = wire
        self._sent = sent

    async def ack(self, multiple: bool = False) -> None:
        await self._sent.wait()
        await asyncio.sleep(0)  # the drain yields to the event loop
        self._wire.append((self.delivery_tag, multiple))


async def test_a_multiple_ack_never_overtakes_earlier_single_acks() -> None:
    """Single acks (the front still running) are on their way when the front settles and
    a multiple ack covers them: it must reach the socket after them, or the broker finds
    a single ack for a tag already acknowledged and closes the channel (the bench's
    short jobs hit this: 'PRECONDITION_FAILED - unknown delivery tag')."""
    channel, sent = object(), asyncio.Event()
    wire: list[tuple[int, bool]] = []
    batcher = AckBatcher()
    messages = [SlowAckMessage(channel, tag, wire, sent) for tag in range(1, 6)]
    for message in messages:
        batcher.delivered(cast(AbstractIncomingMessage, message))
    for message in messages[1:4]:
        batcher.ack(cast(AbstractIncomingMessage, message))
    await asyncio.sleep(0)  # that turn's flush: single acks of 2, 3, 4, waiting on the socket
    batcher.ack(cast(AbstractIncomingMessage, messages[0]))
    batcher.ack(cast(AbstractIncomingMessage, messages[4]))
    await asyncio.sleep(0)  # the next flush: one multiple ack of 5
    sent.set()
    await batcher.drain()
    assert wire == [(2, False), (3, False), (4, False), (5, True)]
