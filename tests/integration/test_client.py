"""The client SDK against the real RabbitMQ and Redis and a running worker: submit and
stream, resume after a lost Redis connection, cancel, generate, dead letters."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import redis.asyncio as aioredis

from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal
from tests.services import ServiceUrls
from tests.tcp_proxy import proxied
from trtllm_worker.client import (
    Client,
    DeadLetter,
    DoneEvent,
    ErrorEvent,
    Event,
    InvalidJobError,
    JobFailed,
    QueueMissing,
    ServiceUnavailable,
    StreamFormatError,
    SyncClient,
    TokenEvent,
)
from trtllm_worker.config import Settings
from trtllm_worker.contract.job import JobLimits, parse_job


def rid() -> str:
    return f"cl-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client_name() -> str:
    return f"test-client-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def client(
    make_settings: Callable[..., Settings],
    client_name: str,
    subscriber: Subscriber,  # removes the test's keys afterwards
    amqp_channel: aio_pika.abc.AbstractChannel,  # deletes the test's queues afterwards
) -> AsyncIterator[Client]:
    async with Client(make_settings(), client_name=client_name) as client:
        yield client


async def collect(client: Client, request_id: str, from_id: str = "0") -> list[Event]:
    async with asyncio.timeout(30):
        return [event async for event in client.stream(request_id, from_id)]


def check_stream(events: list[Event]) -> tuple[list[TokenEvent], DoneEvent]:
    """Tokens 0, 1, 2 … then one `done`, the text adding up to `generated_text`."""
    *tokens, done = events
    assert all(isinstance(e, TokenEvent) for e in tokens)
    assert isinstance(done, DoneEvent), done
    token_events = [e for e in tokens if isinstance(e, TokenEvent)]
    assert [e.index for e in token_events] == list(range(len(token_events)))
    assert "".join(e.text for e in token_events) == done.generated_text
    assert done.generated_tokens == len(token_events)
    assert len({e.entry_id for e in events}) == len(events)
    return token_events, done


async def test_submit_and_stream_round_trip(
    run_worker: WorkerFactory, client: Client, subscriber: Subscriber
) -> None:
    prompt = "Hello, 世界 👋"
    async with run_worker():
        request_id = await client.submit(
            prompt, {"max_new_tokens": 24, "return_logprobs": True}, metadata={"user": "u-1"}
        )
        events = await collect(client, request_id)
    tokens, done = check_stream(events)
    assert done.finish_reason == "length"
    assert done.generated_tokens == 24
    assert done.input_tokens == len(prompt.encode())
    assert done.metadata == {"user": "u-1"}
    assert done.generated_text == (prompt.encode() * 2)[:24].decode(errors="ignore")
    assert [e.token_id for e in tokens] == list((prompt.encode() * 2)[:24])
    assert len(await subscriber.entries(request_id)) == len(events), "every entry, once"


async def test_submit_token_ids_and_given_request_id(
    run_worker: WorkerFactory, client: Client
) -> None:
    request_id = rid()
    async with run_worker():
        assert await client.submit([104, 105], {"max_new_tokens": 3}, request_id=request_id) == (
            request_id
        )
        _, done = check_stream(await collect(client, request_id))
    assert done.generated_text == "hih"
    assert done.input_tokens == 2


async def test_submit_publishes_persistent_confirmed_message(
    client: Client, amqp_channel: aio_pika.abc.AbstractChannel, names: dict[str, str]
) -> None:
    queue = await amqp_channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "quorum"}
    )
    deadline = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    request_id = await client.submit("abc", {"stop": ["\n"]}, deadline=deadline)
    message = await queue.get(no_ack=True)  # it is there: submit returned after the confirm
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.content_type == "application/json"
    assert message.message_id == request_id
    job = parse_job(
        message.body,
        content_type=message.content_type,
        message_id=None,
        limits=JobLimits(max_new_tokens=2048, default_max_new_tokens=256),
    )
    assert (job.request_id, job.inputs, job.deadline) == (request_id, "abc", deadline)
    assert job.parameters.stop == ["\n"]


async def test_submit_carries_the_producers_trace_context(
    client: Client, amqp_channel: aio_pika.abc.AbstractChannel, names: dict[str, str]
) -> None:
    """Submitted inside a span, the job message holds that span's W3C `traceparent` (the
    worker's span for the job will be its child); outside any span, no trace header."""
    from opentelemetry.sdk.trace import TracerProvider

    queue = await amqp_channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "quorum"}
    )
    tracer = TracerProvider().get_tracer("producer")
    with tracer.start_as_current_span("produce") as span:
        await client.submit("traced")
        context = span.get_span_context()
    await client.submit("untraced")
    traced = await queue.get(no_ack=True)
    untraced = await queue.get(no_ack=True)
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
    assert (traced.headers or {}).get("traceparent") == expected
    assert "traceparent" not in (untraced.headers or {})


async def test_submit_without_opentelemetry_installed_sends_no_trace_header(
    client: Client,
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # import opentelemetry fails
    queue = await amqp_channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "quorum"}
    )
    await client.submit("plain")
    message = await queue.get(no_ack=True)
    assert "traceparent" not in (message.headers or {})  # and submit did not fail


@pytest.mark.parametrize(
    ("kwargs", "mentions"),
    [
        ({"inputs": "hi", "parameters": {"top_k": 0}}, "parameters.top_k"),
        ({"inputs": "hi", "parameters": {"colour": "red"}}, "parameters.colour: unknown field"),
        ({"inputs": "hi", "input_ids": [1]}, "exactly one of"),
        ({"inputs": ""}, "inputs"),
        ({"inputs": "hi", "parameters": {"max_new_tokens": 5000}}, "at most 2048"),
        ({"inputs": "hi", "request_id": "no spaces please"}, "request_id"),
        ({"inputs": "hi", "deadline": datetime(2030, 1, 1)}, "deadline"),  # naive: no offset
        ({"inputs": "hi", "metadata": {"x": "y" * 5000}}, "metadata"),
    ],
)
async def test_submit_rejects_an_invalid_job_before_publishing(
    client: Client, kwargs: dict[str, Any], mentions: str
) -> None:
    # No queue exists: had anything been published, submit would raise QueueMissing.
    with pytest.raises(InvalidJobError) as info:
        await client.submit(**kwargs)
    assert mentions in str(info.value)
    assert "\n" not in str(info.value)


async def test_submit_without_a_queue_says_so(client: Client, names: dict[str, str]) -> None:
    with pytest.raises(QueueMissing) as info:
        await client.submit("hi")
    assert names["queue"] in str(info.value)


async def test_unreachable_services_raise_service_unavailable(names: dict[str, str]) -> None:
    async with Client(
        amqp_url="amqp://guest:s3cret@127.0.0.1:1/",
        redis_url="redis://:s3cret@127.0.0.1:1/0",
        queue=names["queue"],
    ) as client:
        with pytest.raises(ServiceUnavailable) as amqp:
            await client.submit("hi")
        with pytest.raises(ServiceUnavailable) as redis:
            await collect(client, "r1")
    for info in (amqp, redis):
        assert "127.0.0.1:1" in str(info.value)
        assert "s3cret" not in str(info.value)


async def test_stream_resumes_after_its_connection_is_killed(
    run_worker: WorkerFactory,
    client: Client,
    client_name: str,
    redis_client: aioredis.Redis,
) -> None:
    seen_tokens = asyncio.Event()

    async def kill_blocked_xread() -> int:
        """Kill the client's connection while it blocks in XREAD (so the read itself
        fails, not a later command on a stale connection)."""
        await seen_tokens.wait()
        while True:
            for info in await redis_client.client_list():
                blocked = info.get("cmd") == "xread" and "b" in str(info.get("flags", ""))
                if info.get("name") == client_name and blocked:
                    await redis_client.client_kill_filter(_id=info["id"])
                    return int(info["id"])
            await asyncio.sleep(0)

    events: list[Event] = []
    async with run_worker(echo_step_ms=25):
        request_id = await client.submit("abcdefg", {"max_new_tokens": 60})
        killer = asyncio.create_task(kill_blocked_xread())
        async with asyncio.timeout(30):
            async for event in client.stream(request_id):
                events.append(event)
                if len(events) == 5:
                    seen_tokens.set()
        killed = await killer
    assert killed
    assert client.reconnects >= 1, "the read failed and was resumed"
    tokens, done = check_stream(events)
    assert done.generated_tokens == 60
    assert "".join(t.text for t in tokens) == ("abcdefg" * 9)[:60]


async def test_a_stream_on_a_connection_redis_drops_as_it_is_taken_reads_on(
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    services: ServiceUrls,
    subscriber: Subscriber,  # removes the test's keys afterwards
    amqp_channel: aio_pika.abc.AbstractChannel,  # deletes the test's queues afterwards
) -> None:
    """Redis (or a proxy before it) closes an idle pooled connection just as a new stream
    takes it: the SDK tries a fresh connection before it reports Redis lost. It once
    raised `ServiceUnavailable` at the first command (its Redis client has no retry of
    its own)."""
    async with (
        proxied(services.redis) as (redis_url, proxy),
        Client(make_settings(), redis_url=redis_url) as client,
        run_worker(),
    ):
        first = await collect(client, await client.submit("again", {"max_new_tokens": 8}))
        proxy.drop_at_next_command()
        second = await collect(client, await client.submit("again", {"max_new_tokens": 8}))
    assert proxy.dropped == 1, "the stream's first command went over a dropped connection"
    _, done = check_stream(second)
    assert done.generated_text == check_stream(first)[1].generated_text


async def test_a_first_redis_connection_dropped_as_it_is_made_is_made_again(
    make_settings: Callable[..., Settings], services: ServiceUrls
) -> None:
    """The client's very first connection to Redis is dropped at its first command (a
    proxy or a server restarting just then): a second one is made before Redis is
    reported lost. It once raised `ServiceUnavailable` at once (the gateway's first
    answer got a 503)."""
    async with proxied(services.redis) as (redis_url, proxy):
        proxy.drop_new_connections(1)
        async with Client(make_settings(), redis_url=redis_url) as client:
            await client.answering_redis()
    assert proxy.dropped == 1, "the first connection was not dropped"
    assert proxy.connections >= 2


async def test_stream_from_an_entry_id_skips_unknown_events(
    client: Client, redis_client: aioredis.Redis, names: dict[str, str]
) -> None:
    request_id = rid()
    key = names["stream_prefix"] + request_id
    await redis_client.xadd(
        key, {"event": "token", "index": 0, "token_id": 104, "text": "h"}, "0-1"
    )
    await redis_client.xadd(key, {"event": "progress", "percent": "50"}, "0-2")
    await redis_client.xadd(
        key,
        {"event": "token", "index": 1, "token_id": 105, "text": "i", "logprob": -0.25},
        "0-3",
    )
    await redis_client.xadd(
        key,
        {
            "event": "done",
            "finish_reason": "length",
            "generated_tokens": 2,
            "input_tokens": 1,
            "generated_text": "hi",
            "future_field": "ignored",
        },
        "0-4",
    )
    events = await collect(client, request_id)
    kinds: list[type[object]] = [TokenEvent, TokenEvent, DoneEvent]  # no join for mypy
    assert [type(e) for e in events] == kinds
    assert [e.entry_id for e in events] == ["0-1", "0-3", "0-4"]
    second = events[1]
    assert isinstance(second, TokenEvent)
    assert second.logprob == -0.25
    resumed = await collect(client, request_id, from_id="0-1")
    assert resumed == events[1:]

    broken = rid()
    await redis_client.xadd(names["stream_prefix"] + broken, {"event": "token", "index": "x"})
    with pytest.raises(StreamFormatError, match="index"):
        await collect(client, broken)


async def test_stream_from_the_terminal_entry_ends_at_once(
    client: Client, redis_client: aioredis.Redis, names: dict[str, str]
) -> None:
    """Resuming from the terminal entry's id (or past it) on a stream that has ended
    gives nothing, at once; from an entry before it, the rest; and a stream that has not
    ended yet is still waited for from its last entry."""
    request_id = rid()
    key = names["stream_prefix"] + request_id
    await redis_client.xadd(
        key, {"event": "token", "index": 0, "token_id": 104, "text": "h"}, "0-1"
    )
    await redis_client.xadd(key, {"event": "error", "code": "engine_error", "message": "x"}, "0-2")
    every = await collect(client, request_id)
    assert [type(e) for e in every] == [TokenEvent, ErrorEvent]
    assert every[-1].entry_id == "0-2"
    for past in ("0-2", "0-3", "1", "1700000000000-0"):
        async with asyncio.timeout(5):
            assert [e async for e in client.stream(request_id, past)] == [], past
    assert await collect(client, request_id, from_id="0-1") == every[1:]

    running = rid()
    key = names["stream_prefix"] + running
    await redis_client.xadd(
        key, {"event": "token", "index": 0, "token_id": 104, "text": "h"}, "0-1"
    )
    reading = asyncio.create_task(collect(client, running, from_id="0-1"))
    await redis_client.xadd(
        key,
        {"event": "done", "finish_reason": "length", "generated_tokens": 1,
         "input_tokens": 1, "generated_text": "h"},
        "0-2",
    )  # fmt: skip
    done = await reading
    assert [(type(e), e.entry_id) for e in done] == [(DoneEvent, "0-2")]


async def test_cancel_a_running_request(run_worker: WorkerFactory, client: Client) -> None:
    events: list[Event] = []
    async with run_worker(echo_step_ms=10):
        request_id = await client.submit("abc", {"max_new_tokens": 2000})
        async with asyncio.timeout(30):
            async for event in client.stream(request_id):
                events.append(event)
                if len(events) == 1:
                    await client.cancel(request_id)
    _, done = check_stream(events)
    assert done.finish_reason == "cancelled"
    assert 1 <= done.generated_tokens < 2000


async def test_cancel_before_any_worker_took_the_job(
    run_worker: WorkerFactory, client: Client
) -> None:
    async with run_worker():
        pass  # declares the queue, then stops: nobody is bound to the cancel fanout
    request_id = await client.submit("abc", {"max_new_tokens": 50})
    await client.cancel(request_id)
    async with run_worker():
        done = await asyncio.wait_for(client.result(request_id), 30)
    assert (done.finish_reason, done.generated_tokens, done.generated_text) == ("cancelled", 0, "")


async def test_generate_returns_the_result_or_raises_the_error(
    run_worker: WorkerFactory, client: Client
) -> None:
    async with run_worker(echo_fault_token_id=ord("!")):
        done = await asyncio.wait_for(client.generate("ok", {"max_new_tokens": 5}), 30)
        assert (done.generated_text, done.finish_reason) == ("okoko", "length")
        request_id = rid()
        with pytest.raises(JobFailed) as info:
            await asyncio.wait_for(client.generate("boom!", request_id=request_id), 30)
    assert info.value.code == "engine_error"
    assert info.value.request_id == request_id
    assert info.value.message
    assert f"request {request_id} failed: engine_error" in str(info.value)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_dead_letters_listed_in_place_then_requeued(
    run_worker: WorkerFactory,
    client: Client,
    producer: Producer,
    subscriber: Subscriber,
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: dict[str, str],
    queue_type: str,
) -> None:
    fixable = rid()
    async with run_worker(max_input_tokens=4, queue_type=queue_type):
        await producer.publish(b"not json")
        await producer.publish({"request_id": rid(), "inputs": "hi", "extra": 1})
        await client.submit("abcdefgh", {"max_new_tokens": 4}, request_id=fixable)
        with pytest.raises(JobFailed) as info:
            await asyncio.wait_for(client.result(fixable), 30)
        assert info.value.code == "input_too_long"
    # The worker has stopped: every message it took is settled (dead-lettered).
    first = await client.dead_letters()
    assert len(first) == 3
    by_code = {letter.code: letter for letter in first}
    assert set(by_code) == {"invalid_request", "input_too_long"}
    assert by_code["input_too_long"].request_id == fixable
    assert "4" in by_code["input_too_long"].message
    reasons = sorted(letter.message for letter in first if letter.code == "invalid_request")
    assert "JSON" in reasons[0] or "JSON" in reasons[1]
    assert any("extra: unknown field" in r for r in reasons)
    not_json = [letter for letter in first if letter.body == b"not json"]
    assert len(not_json) == 1
    # aio-pika gave it a message_id, which the worker takes for its request id
    assert not_json[0].request_id == not_json[0].message_id
    for _ in range(3):  # listing leaves them in place and in order
        assert await client.dead_letters() == first
    assert await client.dead_letters(limit=2) == first[:2]

    async with run_worker(queue_type=queue_type, delivery_limit=1):
        requeued = await client.requeue_dead_letters([fixable])
        assert [letter.request_id for letter in requeued] == [fixable]
        done = await asyncio.wait_for(client.result(fixable), 30)
    assert (done.finish_reason, done.generated_text) == ("length", "abcd")
    assert terminal(await subscriber.entries(fixable))["event"] == "done"
    assert await client.dead_letters() == [
        letter for letter in first if letter.request_id != fixable
    ]


async def test_requeue_keeps_the_dead_copy_when_the_job_queue_is_gone(
    run_worker: WorkerFactory,
    client: Client,
    producer: Producer,
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: dict[str, str],
) -> None:
    async with run_worker():
        await producer.publish({"request_id": rid(), "inputs": ""})
    await amqp_channel.queue_delete(names["queue"])
    before = await client.dead_letters()
    assert len(before) == 1
    with pytest.raises(QueueMissing):
        await client.requeue_dead_letters()
    assert await client.dead_letters() == before


async def test_dead_letters_of_a_queue_never_declared(client: Client) -> None:
    assert await client.dead_letters() == []
    assert await client.requeue_dead_letters() == []


def test_dead_letter_model_is_plain_data() -> None:
    letter = DeadLetter(request_id=None, code="invalid_request", message="m", body=b"x")
    assert json.loads(letter.model_dump_json())["code"] == "invalid_request"


async def test_sync_client_for_scripts(
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    subscriber: Subscriber,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    settings = make_settings()

    def script() -> tuple[DoneEvent, list[Event], list[DeadLetter]]:
        with SyncClient(settings) as client:
            done = client.generate("xyz", {"max_new_tokens": 4})
            request_id = client.submit("ab", {"max_new_tokens": 3})
            events = list(client.stream(request_id))
            with pytest.raises(JobFailed):
                client.generate("abcd", {"max_new_tokens": 1}, deadline=datetime.now(UTC))
            return done, events, client.dead_letters()

    async with run_worker():
        done, events, dead = await asyncio.wait_for(asyncio.to_thread(script), 30)
    assert done.generated_text == "xyzx"
    assert [e.text for e in events if isinstance(e, TokenEvent)] == ["a", "b", "a"]
    assert isinstance(events[-1], DoneEvent)
    assert dead == []


async def test_deadline_passed_is_an_error_event(run_worker: WorkerFactory, client: Client) -> None:
    async with run_worker():
        request_id = await client.submit("abc", deadline=datetime.now(UTC) - timedelta(seconds=1))
        events = await collect(client, request_id)
    assert len(events) == 1
    event = events[0]
    assert isinstance(event, ErrorEvent)
    assert event.code == "deadline_exceeded"


async def test_a_chat_job_through_the_sdk(
    run_worker: WorkerFactory, client: Client, sentencepiece_model: Path
) -> None:
    messages = [{"role": "user", "content": "Weather?"}]
    async with run_worker(tokenizer=sentencepiece_model):
        done = await client.generate(
            messages=messages,
            parameters={"max_new_tokens": 8, "grammar": {"type": "regex", "value": "[A-Z]+"}},
        )
    assert done.generated_text.startswith("[INST] Weather")
    with pytest.raises(InvalidJobError, match=r"messages\.0\.content"):
        await client.submit(messages=[{"role": "user", "content": 3}])
    with pytest.raises(InvalidJobError, match="tools: only with messages"):
        await client.submit("hi", tools=[{"type": "function"}])


async def test_cancel_when_no_worker_ever_declared_the_cancel_exchange(
    run_worker: WorkerFactory,
    client: Client,
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: dict[str, str],
) -> None:
    """The SDK does not declare the cancel fanout (a producer needs no configure
    permission): with no worker ever started it is missing, the broker closes the
    publishing channel, and the mark in Redis alone cancels the job."""
    await amqp_channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "quorum"}
    )
    request_id = await client.submit("abc", {"max_new_tokens": 50})
    await client.cancel(request_id)
    with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):  # never declared
        await amqp_channel.get_exchange(f"{names['queue']}.cancel")
    other = await client.submit("def", {"max_new_tokens": 3})  # on a channel opened anew
    async with run_worker():
        done = await asyncio.wait_for(client.result(request_id), 30)
        assert (await asyncio.wait_for(client.result(other), 30)).generated_text == "def"
    assert (done.finish_reason, done.generated_tokens) == ("cancelled", 0)


async def test_a_requeued_dead_letter_forgets_the_deliveries_a_paused_copy_carried(
    run_worker: WorkerFactory, client: Client, producer: Producer
) -> None:
    """A job paused, then failed into the dead-letter queue, carries its failed
    deliveries in `x-trtllm-deliveries`; requeued by an operator, it starts afresh."""
    request_id = rid()
    async with run_worker(delivery_limit=1):
        producer.queue = f"{producer.queue}.dead"
        await producer.publish(
            {"request_id": request_id, "inputs": "hi", "parameters": {"max_new_tokens": 2}},
            headers={"x-error-code": "internal_error", "x-trtllm-deliveries": 5},
        )
        requeued = await client.requeue_dead_letters([request_id])
        assert [letter.request_id for letter in requeued] == [request_id]
        done = await asyncio.wait_for(client.result(request_id), 30)
    assert done.finish_reason == "length"
