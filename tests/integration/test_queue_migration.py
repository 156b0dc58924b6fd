"""`trtllm-worker migrate-queue`: an old job queue (a classic queue declared without
priorities) becomes what the worker declares, every job kept with its priority and
headers; refused while workers consume; an interrupted run finishes when run again."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import pytest

from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal
from tests.integration.test_cli import Cli
from tests.integration.test_priorities import end_order
from tests.services import ServiceUrls
from trtllm_worker.client import Client
from trtllm_worker.client.migrate import MigrationRefused, migrating_queue_name
from trtllm_worker.config import Settings
from trtllm_worker.contract.queues import job_queue_arguments


def rid(tag: str) -> str:
    return f"mq-{tag}-{uuid.uuid4().hex[:8]}"


def job(request_id: str) -> dict[str, object]:
    return {"request_id": request_id, "inputs": "abc", "parameters": {"max_new_tokens": 6}}


async def old_queue(channel: aio_pika.abc.AbstractChannel, name: str) -> None:
    """A job queue as an earlier version declared it: classic, no x-max-priority."""
    await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "classic"})


@pytest.fixture
def cli(
    services: ServiceUrls,
    names: dict[str, str],
    tmp_path: Path,
    subscriber: Subscriber,  # removes the test's keys afterwards
    producer: Producer,  # deletes the test's queues afterwards
) -> Cli:
    return Cli(services, names, tmp_path)


@pytest.fixture
async def connection(services: ServiceUrls) -> AsyncIterator[aio_pika.abc.AbstractConnection]:
    made = await aio_pika.connect(services.amqp)
    yield made
    await made.close()


async def exists(connection: aio_pika.abc.AbstractConnection, name: str) -> bool:
    try:
        async with connection.channel() as channel:
            await channel.declare_queue(name, passive=True)
    except aio_pika.exceptions.ChannelNotFoundEntity:
        return False
    return True


async def count(channel: aio_pika.abc.AbstractChannel, name: str) -> int:
    declared = await channel.declare_queue(name, passive=True)
    return declared.declaration_result.message_count or 0


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
async def test_an_old_queue_migrated_keeps_every_job_and_its_priority(
    make_settings: object,
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    amqp_channel: aio_pika.abc.AbstractChannel,
    connection: aio_pika.abc.AbstractConnection,
    names: dict[str, str],
    queue_type: str,
) -> None:
    await old_queue(amqp_channel, names["queue"])
    jobs = [(rid("p0"), 0), (rid("p7"), 7), (rid("p2"), 2), (rid("p9"), 9), (rid("p4"), 4)]
    for request_id, priority in jobs:
        await producer.publish(job(request_id), priority=priority, headers={"tag": request_id})
    settings: Settings = make_settings(queue_type=queue_type)  # type: ignore[operator]
    notes: list[str] = []
    async with Client(settings) as client:
        done = await client.migrate_queue(report=notes.append)
        again = await client.migrate_queue()
    assert (done.migrated, done.moved) == (True, 5)
    assert any("declared again" in note for note in notes)
    assert (again.migrated, again.moved) == (False, 0)
    assert await count(amqp_channel, names["queue"]) == 5
    # the queue now takes the worker's own declaration
    await amqp_channel.declare_queue(
        names["queue"], durable=True, arguments={**job_queue_arguments(queue_type)}
    )
    assert not await exists(connection, migrating_queue_name(names["queue"]))
    kept = []
    async with connection.channel() as looking:  # closed unacknowledged: they go back
        queue = await looking.declare_queue(names["queue"], passive=True)
        for _ in range(5):
            message = await queue.get(no_ack=False)
            kept.append((message.priority, (message.headers or {}).get("tag")))
    assert sorted((tag, priority) for priority, tag in kept) == sorted(jobs)
    async with run_worker(max_batch=1, preempt_priority=10, queue_type=queue_type):
        ended = await end_order(subscriber, [r for r, _ in jobs])
    if queue_type == "classic":  # ordered by priority now (quorum: from RabbitMQ 4.0)
        in_order = sorted(jobs, key=lambda j: ended[j[0]])
        assert [p for _, p in in_order] == [9, 7, 4, 2, 0]
    for request_id, _ in jobs:
        assert terminal(await subscriber.entries(request_id))["event"] == "done"


async def test_refused_while_a_worker_consumes(
    make_settings: object,
    producer: Producer,
    amqp_channel: aio_pika.abc.AbstractChannel,
    connection: aio_pika.abc.AbstractConnection,
    names: dict[str, str],
) -> None:
    await old_queue(amqp_channel, names["queue"])
    await producer.publish(job(rid("kept")))
    consumer_channel = await connection.channel()
    await consumer_channel.set_qos(prefetch_count=0)
    queue = await consumer_channel.declare_queue(names["queue"], passive=True)
    seen: list[aio_pika.abc.AbstractIncomingMessage] = []

    async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        seen.append(message)

    tag = await queue.consume(take)
    settings: Settings = make_settings(queue_type="classic")  # type: ignore[operator]
    async with Client(settings) as client:
        with pytest.raises(MigrationRefused, match="1 consumers: stop the workers first"):
            await client.migrate_queue()
    await queue.cancel(tag)
    await consumer_channel.close()  # its unacknowledged job goes back
    assert await count(amqp_channel, names["queue"]) == 1


async def test_an_interrupted_migration_finishes_when_run_again(
    cli: Cli,
    producer: Producer,
    amqp_channel: aio_pika.abc.AbstractChannel,
    connection: aio_pika.abc.AbstractConnection,
    names: dict[str, str],
) -> None:
    """Killed after the swap: the queue is new, three jobs still wait in
    `<queue>.migrating`. The command run again moves them back and removes it."""
    queue, temp = names["queue"], migrating_queue_name(names["queue"])
    await amqp_channel.declare_queue(
        queue, durable=True, arguments={**job_queue_arguments("classic")}
    )
    await amqp_channel.declare_queue(
        temp, durable=True, arguments={**job_queue_arguments("classic")}
    )
    for _ in range(3):
        await amqp_channel.default_exchange.publish(
            aio_pika.Message(b"{}", priority=3), routing_key=temp
        )
    await producer.publish(job(rid("new")))
    result = await cli.run("migrate-queue", WORKER_QUEUE_TYPE="classic")
    assert result.code == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f"moved 3 jobs from {temp!r} to {queue!r}" in result.stderr
    assert await count(amqp_channel, queue) == 4
    assert not await exists(connection, temp)


async def test_the_command_migrates_then_has_nothing_to_do(
    cli: Cli, producer: Producer, amqp_channel: aio_pika.abc.AbstractChannel, names: dict[str, str]
) -> None:
    await old_queue(amqp_channel, names["queue"])
    for _ in range(2):
        await producer.publish(job(rid("j")))
    first = await cli.run("migrate-queue", WORKER_QUEUE_TYPE="classic")
    second = await cli.run("migrate-queue", WORKER_QUEUE_TYPE="classic")
    assert first.code == second.code == 0
    assert f"queue {names['queue']!r} migrated: 2 jobs kept" in first.stderr
    assert "nothing to do" in second.stderr
