"""Priorities with real workers: the queue delivers higher priorities first, a full worker
pauses a running job of lower priority for an interactive one, and a paused job continues
its stream whole, never counted as a delivery (the contract's Priorities section)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import cast

import aio_pika
import pytest

from tests.integration.conftest import (
    Entry,
    Producer,
    Subscriber,
    WorkerFactory,
    terminal,
    tokens,
    xread,
)
from tests.services import ServiceUrls
from trtllm_worker.broker.consumer import broker_version as broker_version_of
from trtllm_worker.client import Client
from trtllm_worker.config import Settings
from trtllm_worker.engine.base import EngineRequest
from trtllm_worker.pipeline.slots import Ticket

LONG = 150  # tokens of a batch job: 3 s at 20 ms a step, far longer than a pause takes


def rid(tag: str) -> str:
    return f"pr-{tag}-{uuid.uuid4().hex[:8]}"


def job(
    request_id: str, max_new_tokens: int, inputs: str = "abcdefg", tenant: str | None = None
) -> dict[str, object]:
    body: dict[str, object] = {
        "request_id": request_id,
        "inputs": inputs,
        "parameters": {"max_new_tokens": max_new_tokens},
    }
    if tenant is not None:
        body["tenant"] = tenant
    return body


def assert_whole(entries: list[dict[str, str]], count: int, inputs: str = "abcdefg") -> None:
    """Every index once, in order, one terminal entry whose text is the tokens' texts."""
    assert [int(e["index"]) for e in tokens(entries)] == list(range(count))
    done = terminal(entries)
    assert done["event"] == "done"
    assert done["generated_tokens"] == str(count)
    expected = (inputs * (count // len(inputs) + 1))[:count]
    assert "".join(e["text"] for e in tokens(entries)) == done["generated_text"] == expected


async def end_order(subscriber: Subscriber, request_ids: list[str]) -> dict[str, int]:
    """The order in which the streams' terminal entries arrive (one slot: run order)."""
    last = {subscriber.key(r): "0" for r in request_ids}
    by_key = {subscriber.key(r): r for r in request_ids}
    ended: dict[str, int] = {}
    async with asyncio.timeout(30):
        while last:
            for key, items in await xread(subscriber.redis, dict(last), count=1000):
                for entry_id, fields in items:
                    last[key] = entry_id
                    if fields["event"] in ("done", "error"):
                        ended[by_key[key]] = len(ended)
                        del last[key]
                        break
    return ended


async def has_terminal(subscriber: Subscriber, request_id: str) -> bool:
    return any(e["event"] in ("done", "error") for e in await subscriber.entries(request_id))


async def both_resumed(subscriber: Subscriber, batch: list[str], urgent: str) -> None:
    """Until each batch job has a token after the urgent job's end: the paused one is back
    in the engine (on a busy machine it may still be on its way back when the next urgent
    job comes, which would find its slot free and pause nothing)."""
    [(ended, _)] = cast(
        list[tuple[str, Entry]], await subscriber.redis.xrevrange(subscriber.key(urgent), count=1)
    )
    async with asyncio.timeout(30):
        for request_id in batch:
            while not await xread(subscriber.redis, {subscriber.key(request_id): ended}, 1):
                pass


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
async def test_interactive_job_pauses_a_batch_job_which_resumes_whole_and_uncounted(
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    producer: Producer,
    subscriber: Subscriber,
    queue_type: str,
) -> None:
    """Two slots busy with batch jobs; three interactive jobs arrive one after another.
    Each pauses a batch job at once (its first token comes while both batch jobs are
    unfinished), and the paused jobs end whole although the delivery limit is 1: a pause
    never counts as a delivery, on either queue type."""
    batch = [rid("batch"), rid("batch")]
    async with run_worker(
        max_batch=2, echo_step_ms=20, queue_type=queue_type, delivery_limit=1
    ) as service:
        for request_id in batch:
            await producer.publish(job(request_id, LONG, tenant="bulk"), priority=0)
        for request_id in batch:
            await subscriber.first_entry(request_id)
        for _ in range(3):
            urgent = rid("urgent")
            await producer.publish(job(urgent, 5, tenant="chat"), priority=9)
            await subscriber.first_entry(urgent)
            # it started while both batch jobs still ran: one of them made room
            assert not [b for b in batch if await has_terminal(subscriber, b)]
            assert_whole(await subscriber.read_until_terminal(urgent), 5)
            await both_resumed(subscriber, batch, urgent)
        results = await subscriber.read_many(batch)
        paused = service.metrics.paused._value.get()
    assert paused == 3
    for request_id in batch:
        assert_whole(results[request_id], LONG)
    # each job counted once for its tenant, paused ones included, every token once
    async with Client(make_settings()) as client:
        usage = {
            u.tenant: (u.jobs, u.input_tokens, u.generated_tokens) for u in await client.usage()
        }
    assert usage == {"bulk": (2, 2 * 7, 2 * LONG), "chat": (3, 3 * 7, 3 * 5)}


async def test_no_pause_for_a_job_below_the_preempt_priority(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """Priority 4 is below WORKER_PREEMPT_PRIORITY (5): it waits for a free slot."""
    batch = rid("batch")
    async with run_worker(max_batch=1, echo_step_ms=10, queue_type="classic") as service:
        await producer.publish(job(batch, 60), priority=0)
        await subscriber.first_entry(batch)
        waiting = rid("waiting")
        await producer.publish(job(waiting, 3), priority=4)
        await subscriber.read_until_terminal(waiting)
        batch_entries = await subscriber.entries(batch)
        paused = service.metrics.paused._value.get()
    assert paused == 0
    assert_whole(batch_entries, 60)  # it ran to its end before the other started


async def test_pausing_off_at_10(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    batch = rid("batch")
    async with run_worker(
        max_batch=1, echo_step_ms=10, queue_type="classic", preempt_priority=10
    ) as service:
        await producer.publish(job(batch, 40), priority=0)
        await subscriber.first_entry(batch)
        urgent = rid("urgent")
        await producer.publish(job(urgent, 3), priority=9)
        await subscriber.read_until_terminal(urgent)
        assert await has_terminal(subscriber, batch)
        paused = service.metrics.paused._value.get()
    assert paused == 0


async def test_the_queue_delivers_higher_priorities_first(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """A classic queue is declared with x-max-priority: jobs waiting in it leave it by
    priority (pausing off, one slot: the order is the queue's alone)."""
    first = rid("first")
    async with run_worker(max_batch=1, echo_step_ms=5, queue_type="classic", preempt_priority=10):
        await producer.publish(job(first, 40), priority=0)
        await subscriber.first_entry(first)
        # published while the only slot is busy and the only delivery is taken
        order = [(rid("p0"), 0), (rid("p3"), 3), (rid("p9"), 9), (rid("p6"), 6)]
        for request_id, priority in order:
            await producer.publish(job(request_id, 10), priority=priority)
        ended = await end_order(subscriber, [r for r, _ in order])
    assert [priority for request_id, priority in sorted(order, key=lambda o: ended[o[0]])] == [
        9,
        6,
        3,
        0,
    ]


async def test_an_existing_classic_queue_without_priorities_is_one_line(
    run_worker: WorkerFactory, amqp_channel: aio_pika.abc.AbstractChannel, names: dict[str, str]
) -> None:
    from trtllm_worker.contract.errors import ConfigError

    await amqp_channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "classic"}
    )
    with pytest.raises(ConfigError) as raised:
        async with run_worker(queue_type="classic"):
            pass
    line = str(raised.value)
    assert "\n" not in line
    assert "without priorities" in line
    assert "Migrating a queue to priorities" in line
    assert "x-max-priority" in line


async def test_priority_above_9_is_clamped(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """The property is an octet: 200 is treated as 9, as the queue treats it."""
    batch = rid("batch")
    async with run_worker(max_batch=1, echo_step_ms=20, queue_type="classic") as service:
        await producer.publish(job(batch, LONG), priority=0)
        await subscriber.first_entry(batch)
        urgent = rid("urgent")
        await producer.publish(job(urgent, 3), priority=200)
        await subscriber.read_until_terminal(urgent)
        assert not await has_terminal(subscriber, batch)
        assert service.metrics.paused._value.get() == 1
        assert_whole(await subscriber.read_until_terminal(batch), LONG)


async def test_a_cancelled_job_waiting_for_a_slot_ends_at_once(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = rid("batch")
    async with run_worker(max_batch=1, echo_step_ms=20, queue_type="classic") as service:
        await producer.publish(job(batch, LONG), priority=0)
        await subscriber.first_entry(batch)
        held = rid("held")
        runner = service._runner
        assert runner is not None
        monkeypatch.setattr(runner.slots, "_armed_for_s", 0)  # held, never given back
        waiting = asyncio.Event()
        acquire = runner.slots.acquire

        async def acquire_and_say(request_id: str, priority: int) -> Ticket | None:
            if request_id == held:
                waiting.set()  # the slot is busy: it waits from here on, synchronously
            return await acquire(request_id, priority)

        monkeypatch.setattr(runner.slots, "acquire", acquire_and_say)
        await producer.publish(job(held, 5), priority=1)
        async with asyncio.timeout(10):
            await waiting.wait()
        assert runner.slots.waiting == 1
        await producer.cancel(held)
        entries = await subscriber.read_until_terminal(held)
        assert terminal(entries)["finish_reason"] == "cancelled"
        assert not await has_terminal(subscriber, batch)


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
async def test_a_full_worker_with_a_backlog_sees_an_interactive_job(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    services: ServiceUrls,
    queue_type: str,
) -> None:
    """One slot, a backlog of batch jobs: the worker runs one and holds the next in the
    lookout. Once interactive jobs are about, the held job is given back (uncounted) so
    that the broker can hand over the interactive one, which pauses the running job."""
    if queue_type == "quorum" and await broker_version(services.amqp) < (4, 0):
        pytest.skip("a quorum queue orders priorities from RabbitMQ 4.0 on (test-servers)")
    async with run_worker(
        max_batch=1, echo_step_ms=20, queue_type=queue_type, delivery_limit=1
    ) as service:
        warm = rid("warm")  # an interactive job on the idle worker opens the lookout
        await producer.publish(job(warm, 2), priority=9)
        await subscriber.read_until_terminal(warm)
        backlog = [rid("batch") for _ in range(4)]
        for request_id in backlog:
            await producer.publish(job(request_id, 80), priority=0)
        await subscriber.first_entry(backlog[0])
        urgent = rid("urgent")
        await producer.publish(job(urgent, 3), priority=9)
        await subscriber.first_entry(urgent)
        assert not await has_terminal(subscriber, backlog[0])  # it made room
        results = await subscriber.read_many([urgent, *backlog])
        given_back = service.metrics.given_back._value.get()
        paused = service.metrics.paused._value.get()
    assert given_back >= 1
    assert paused == 1
    assert_whole(results[urgent], 3)
    for request_id in backlog:
        assert_whole(results[request_id], 80)


async def test_the_engine_gets_the_priority_over_nine_and_the_tenant_as_cache_salt(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TensorRT-LLM's request priority is 0 to 1: the job's 0-9 divided by 9."""
    async with run_worker(queue_type="classic") as service:
        looper = service._looper
        assert looper is not None
        submitted: list[EngineRequest] = []
        submit = looper.submit

        def record(request: EngineRequest) -> None:
            submitted.append(request)
            submit(request)

        monkeypatch.setattr(looper, "submit", record)
        jobs = [(rid("p9"), 9), (rid("p0"), 0), (rid("p3"), 3)]
        for request_id, priority in jobs:
            await producer.publish(job(request_id, 2), priority=priority)
            await subscriber.read_until_terminal(request_id)
        absent = rid("absent")  # no priority property: 0
        await producer.publish({**job(absent, 2), "tenant": "acme"})
        await subscriber.read_until_terminal(absent)
    assert [r.priority for r in submitted] == [1.0, 0.0, 3 / 9, 0.0]
    # the tenant is TensorRT-LLM's cache salt: tenants never share KV-cache blocks
    assert [r.cache_salt for r in submitted] == [None, None, None, "acme"]


async def broker_version(amqp_url: str) -> tuple[int, ...]:
    connection = await aio_pika.connect(amqp_url)
    try:
        version = broker_version_of(connection)
    finally:
        await connection.close()
    assert version is not None
    return version


async def test_a_quorum_queue_on_a_broker_that_ignores_priorities_is_said_at_start(
    run_worker: WorkerFactory, services: ServiceUrls, caplog: pytest.LogCaptureFixture
) -> None:
    """RabbitMQ orders a quorum queue's priorities from 4.0 on; before, the worker says
    at start that the broker ignores them (and says nothing on 4.0)."""
    version = await broker_version(services.amqp)
    with caplog.at_level(logging.WARNING, logger="trtllm_worker.broker.consumer"):
        async with run_worker(queue_type="quorum"):
            pass
    said = [
        r.getMessage() for r in caplog.records if "ignores message priorities" in r.getMessage()
    ]
    if version < (4, 0):
        assert len(said) == 1
        assert "jobs leave the queue in arrival order" in said[0]
    else:
        assert said == []


async def test_a_quorum_queue_delivers_the_high_level_first_on_rabbitmq_4(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber, services: ServiceUrls
) -> None:
    """RabbitMQ 4.0's quorum queues serve priorities 5-9 before 0-4 (weighted 2:1, so a
    normal job is not starved): jobs waiting in the queue start high ones first."""
    if await broker_version(services.amqp) < (4, 0):
        pytest.skip("quorum queues order priorities from RabbitMQ 4.0 on (test-servers runs it)")
    first = rid("first")
    async with run_worker(max_batch=1, echo_step_ms=5, queue_type="quorum", preempt_priority=10):
        await producer.publish(job(first, 40), priority=0)
        await subscriber.first_entry(first)
        order = [(rid("n"), 0), (rid("n"), 2), (rid("n"), 4), (rid("h"), 5), (rid("h"), 9)]
        for request_id, priority in order:
            await producer.publish(job(request_id, 10), priority=priority)
        ended = await end_order(subscriber, [r for r, _ in order])
    ran = [p for _, p in sorted(order, key=lambda item: ended[item[0]])]
    assert ran[0] >= 5, ran
    high = [position for position, p in enumerate(ran) if p >= 5]
    low = [position for position, p in enumerate(ran) if p < 5]
    assert sum(high) / len(high) < sum(low) / len(low), ran


async def test_the_sdk_submits_with_a_priority(
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    producer: Producer,
    subscriber: Subscriber,
) -> None:
    batch = rid("batch")
    async with run_worker(max_batch=1, echo_step_ms=20, queue_type="classic") as service:
        await producer.publish(job(batch, LONG), priority=0)
        await subscriber.first_entry(batch)
        async with Client(make_settings()) as client:
            with pytest.raises(ValueError, match="priority must be 0 to 9"):
                await client.submit("x", priority=10)
            urgent = await client.submit("hi", {"max_new_tokens": 2}, priority=9)
            done = await asyncio.wait_for(client.result(urgent), 30)
        assert done.generated_text == "hi"
        assert not await has_terminal(subscriber, batch)
        assert service.metrics.paused._value.get() == 1


async def test_no_job_is_given_back_where_the_broker_ignores_priorities(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber, services: ServiceUrls
) -> None:
    """A quorum queue before RabbitMQ 4.0 delivers in arrival order: a job given back
    would only go to the back of the queue, so the worker never gives one back."""
    if await broker_version(services.amqp) >= (4, 0):
        pytest.skip("RabbitMQ 4.0 orders a quorum queue's priorities")
    first, held = rid("first"), rid("held")
    async with run_worker(max_batch=1, echo_step_ms=20, queue_type="quorum") as service:
        await producer.publish(job(first, 30), priority=0)
        await subscriber.first_entry(first)
        await producer.publish(job(held, 3), priority=0)
        # the held job waits for the whole first job, ten times the lookout's 50 ms
        entries = await subscriber.read_until_terminal(held)
        given_back = service.metrics.given_back._value.get()
    assert terminal(entries)["event"] == "done"
    assert given_back == 0
