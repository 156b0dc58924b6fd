"""Messages that cannot run end in `<queue>.dead` with the reason; the worker goes on."""

from __future__ import annotations

import json
import uuid
from typing import Any

import aio_pika
import pytest

from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal
from trtllm_worker.contract.job import MAX_BODY_BYTES
from trtllm_worker.contract.stream import deliveries_key


def rid() -> str:
    return f"dl-{uuid.uuid4().hex[:10]}"


@pytest.mark.parametrize(
    ("body", "properties", "code", "mentions"),
    [
        (b"not json", {}, "invalid_request", "JSON"),
        (b'{"request_id": "x1", "inputs": ""}', {}, "invalid_request", "inputs"),
        (b'["a list"]', {}, "invalid_request", "object"),
        (b"\xff\xfe\xfd", {}, "invalid_request", "JSON"),
        (
            b'{"request_id": "x2", "inputs": "hi"}',
            {"content_type": "text/plain"},
            "invalid_request",
            "content_type",
        ),
        (
            b'{"request_id": "x3", "inputs": "hi", "parameters": {"top_k": 0}}',
            {},
            "invalid_request",
            "parameters.top_k",
        ),
        (
            b'{"request_id": "x5", "inputs": "hi", "parameters": {"top_logprobs": 3}}',
            {},
            "invalid_request",
            "parameters.top_logprobs: needs parameters.return_logprobs",
        ),
        (
            b'{"request_id": "x6", "inputs": "hi", '
            b'"parameters": {"return_logprobs": true, "top_logprobs": 21}}',
            {},
            "invalid_request",
            "parameters.top_logprobs",
        ),
        (b'{"request_id": "x4", "inputs": "hi", "extra": 1}', {}, "invalid_request", "extra"),
        (b" " * (MAX_BODY_BYTES + 1), {}, "invalid_request", "limit"),
    ],
    ids=[
        "not-json",
        "empty-inputs",
        "not-object",
        "bad-utf8",
        "content-type",
        "top_k",
        "top_logprobs-without-return_logprobs",
        "top_logprobs-21",
        "unknown-field",
        "too-large",
    ],
)
async def test_unrunnable_message_is_dead_lettered_with_reason(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    body: bytes,
    properties: dict[str, Any],
    code: str,
    mentions: str,
) -> None:
    after = rid()
    properties.setdefault("content_type", "application/json")
    async with run_worker():
        await producer.publish(
            body, headers={"x-producer": "test"}, correlation_id="c-1", **properties
        )
        dead = await producer.get_dead()
        # the worker keeps running
        await producer.publish(
            {"request_id": after, "inputs": "ok", "parameters": {"max_new_tokens": 2}}
        )
        entries = await subscriber.read_until_terminal(after)
    assert terminal(entries)["generated_text"] == "ok"
    assert dead.body == body
    assert dead.headers["x-error-code"] == code
    assert mentions in str(dead.headers["x-error-message"])
    assert dead.headers["x-producer"] == "test"
    assert dead.correlation_id == "c-1"
    assert dead.content_type == properties["content_type"]


async def test_readable_request_id_also_gets_an_error_entry(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker():
        await producer.publish(
            {"request_id": request_id, "inputs": "hi", "parameters": {"temperature": -1}}
        )
        entries = await subscriber.read_until_terminal(request_id)
        dead = await producer.get_dead()
    assert entries == [
        {
            "event": "error",
            "code": "invalid_request",
            "message": dead.headers["x-error-message"],
        }
    ]
    assert "parameters.temperature" in entries[0]["message"]
    ttl = await subscriber.redis.ttl(subscriber.key(request_id))
    assert ttl > 0


async def test_message_id_gives_the_stream_when_the_body_is_unreadable(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker():
        await producer.publish(b"{broken", message_id=request_id)
        entries = await subscriber.read_until_terminal(request_id)
        await producer.get_dead()
    assert entries[0]["event"] == "error"
    assert entries[0]["code"] == "invalid_request"


async def test_input_too_long(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker(max_input_tokens=10):
        await producer.publish({"request_id": request_id, "inputs": "x" * 11})
        entries = await subscriber.read_until_terminal(request_id)
        dead = await producer.get_dead()
    assert entries[0]["code"] == "input_too_long"
    assert dead.headers["x-error-code"] == "input_too_long"
    assert json.loads(dead.body)["request_id"] == request_id


async def test_message_delivered_too_often_is_dead_lettered(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """Quorum queues count failed deliveries in `x-delivery-count`; a message past
    WORKER_DELIVERY_LIMIT is not run again."""
    request_id = rid()
    async with run_worker(delivery_limit=2):
        await producer.publish(
            {"request_id": request_id, "inputs": "hi"}, headers={"x-delivery-count": 2}
        )
        entries = await subscriber.read_until_terminal(request_id)
        dead = await producer.get_dead()
    assert entries[0]["event"] == "error"
    assert "delivered 3 times" in entries[0]["message"]
    assert dead.headers["x-error-code"] == entries[0]["code"]


async def test_the_workers_limit_applies_at_rabbitmqs_own(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: dict[str, str],
) -> None:
    """RabbitMQ 4.0 drops a quorum queue's message after its 21st delivery (its default
    delivery-limit, 20, without a dead-letter exchange). Returned 20 times for real (as
    20 crashed workers would), the message comes to a worker whose WORKER_DELIVERY_LIMIT
    is the highest allowed, 20: it ends as the worker's dead letter, with its reason and
    the stream's error entry, not dropped by the broker."""
    request_id = rid()
    queue = await amqp_channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "quorum"}
    )
    await producer.publish({"request_id": request_id, "inputs": "hi"})
    for returned in range(20):
        message = await queue.get(timeout=5, fail=False)
        assert message is not None, f"the broker dropped it after {returned} returns"
        await message.reject(requeue=True)
    async with run_worker(delivery_limit=20):
        entries = await subscriber.read_until_terminal(request_id)
        dead = await producer.get_dead()
    assert entries[0]["event"] == "error"
    assert "delivered 21 times" in entries[0]["message"]
    assert dead.headers["x-error-code"] == entries[0]["code"]
    assert json.loads(dead.body)["request_id"] == request_id


async def test_stream_key_of_another_type_dead_letters_the_job(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id, after = rid(), rid()
    await subscriber.redis.set(subscriber.key(request_id), "not a stream")
    async with run_worker():
        await producer.publish({"request_id": request_id, "inputs": "hi"})
        dead = await producer.get_dead()
        await producer.publish(
            {"request_id": after, "inputs": "ok", "parameters": {"max_new_tokens": 2}}
        )
        entries = await subscriber.read_until_terminal(after)
    assert dead.headers["x-error-code"] == "internal_error"
    assert "WRONGTYPE" in str(dead.headers["x-error-message"])
    assert terminal(entries)["generated_text"] == "ok"
    assert await subscriber.redis.get(subscriber.key(request_id)) == "not a stream"


async def test_copies_of_a_finished_job_on_a_classic_queue_are_not_dead_lettered(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: dict[str, str],
) -> None:
    """A classic queue does not count deliveries: the worker counts a request's
    redeliveries in Redis. Extra copies of a job that completed (a producer's retries)
    are first deliveries: each is acknowledged as a duplicate, never counted against
    WORKER_DELIVERY_LIMIT nor dead-lettered."""
    request_id = rid()
    job = {"request_id": request_id, "inputs": "ab", "parameters": {"max_new_tokens": 3}}
    async with run_worker(queue_type="classic", delivery_limit=1) as service:
        await producer.publish(job)
        entries = await subscriber.read_until_terminal(request_id)
        for _ in range(3):
            await producer.publish(job)
        marker = rid()  # delivered after the copies: they are in hand when it ends
        await producer.publish({"request_id": marker, "inputs": "z"})
        await subscriber.read_until_terminal(marker)
        # the worker stops only once it has settled what it holds
    assert service.metrics.jobs.labels(outcome="skipped")._value.get() == 3
    assert service.metrics.jobs.labels(outcome="dead_lettered")._value.get() == 0
    assert await subscriber.entries(request_id) == entries
    for queue_name in (names["queue"], f"{names['queue']}.dead"):
        declared = await amqp_channel.declare_queue(queue_name, durable=True, passive=True)
        assert declared.declaration_result.message_count == 0, queue_name
    assert not await subscriber.redis.exists(deliveries_key(subscriber.key(request_id)))


async def test_a_copy_put_back_carries_its_failed_deliveries(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """A paused job's copy starts again at x-delivery-count 0 at the broker; the failed
    deliveries before it, in `x-trtllm-deliveries`, still count towards the limit."""
    request_id = rid()
    async with run_worker(delivery_limit=3):
        await producer.publish(
            {"request_id": request_id, "inputs": "hi"},
            headers={"x-trtllm-deliveries": 2, "x-delivery-count": 1, "x-trtllm-returns": 4},
        )
        entries = await subscriber.read_until_terminal(request_id)
    assert entries[0]["event"] == "error"
    assert "delivered 4 times" in entries[0]["message"]


async def test_returns_alone_never_count(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """Paused 50 times and never failed: the job runs (delivery limit 1)."""
    request_id = rid()
    async with run_worker(delivery_limit=1):
        await producer.publish(
            {"request_id": request_id, "inputs": "hi", "parameters": {"max_new_tokens": 2}},
            headers={"x-trtllm-returns": 50},
        )
        entries = await subscriber.read_until_terminal(request_id)
    assert entries[-1]["event"] == "done"
