"""RabbitMQ's consumer (delivery acknowledgement) timeout: the broker closes the channel
of a consumer that holds a delivery longer than `consumer_timeout` (30 minutes by default)
and requeues the message. A job that runs longer must still end exactly once: no
duplicate stream entry, no second terminal entry, no dead letter."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Iterator

import aio_pika
import pytest

from tests.integration.conftest import Subscriber, WorkerFactory, terminal, tokens
from tests.private_rabbitmq import PrivateNode, private_rabbitmq

TIMEOUT_MS = 2000


@pytest.fixture(scope="module")
def short_timeout_broker() -> Iterator[PrivateNode]:
    """A private node whose node-wide consumer timeout is 2 s, checked every 200 ms."""
    with private_rabbitmq(
        config=f"consumer_timeout = {TIMEOUT_MS}\n",
        advanced="{rabbit, [{channel_tick_interval, 200}]}",
    ) as node:
        yield node


def version(connection: aio_pika.abc.AbstractConnection) -> tuple[int, ...]:
    properties = connection.transport.connection.server_properties  # type: ignore[union-attr]
    raw = properties["version"]
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return tuple(int(part) for part in text.split(".")[:2])


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_a_job_longer_than_the_consumer_timeout_ends_once(
    short_timeout_broker: PrivateNode,
    run_worker: WorkerFactory,
    subscriber: Subscriber,
    names: dict[str, str],
    queue_type: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"amqp://guest:guest@127.0.0.1:{short_timeout_broker.port}/"
    request_id = f"long-{uuid.uuid4().hex[:8]}"
    steps = 60  # 60 tokens at 100 ms: 6 s, three times the broker's timeout
    caplog.set_level(logging.WARNING, logger="trtllm_worker.broker.consumer")
    connection = await aio_pika.connect(url)
    async with connection:
        broker = version(connection)
        async with run_worker(amqp_url=url, queue_type=queue_type, echo_step_ms=100):
            channel = await connection.channel()
            body = {
                "request_id": request_id,
                "inputs": "x" * steps,
                "parameters": {"max_new_tokens": steps, "min_new_tokens": steps},
            }
            loop = asyncio.get_running_loop()
            started = loop.time()
            await channel.default_exchange.publish(
                aio_pika.Message(json.dumps(body).encode()), routing_key=names["queue"]
            )
            entries = await subscriber.read_until_terminal(request_id, wait_s=60)
            took = loop.time() - started
            end = terminal(entries)
            assert end["event"] == "done", end
            assert [int(e["index"]) for e in tokens(entries)] == list(range(steps))
            dead = await channel.declare_queue(f"{names['queue']}.dead", passive=True)
            assert dead.declaration_result.message_count == 0
    assert took > 2 * TIMEOUT_MS / 1000  # the job did run longer than the broker allows
    timed_out = "timed out" in short_timeout_broker.log()
    if broker >= (3, 12):
        # the worker declared its queue with x-consumer-timeout: the broker kept the
        # channel open, and the job ran once, start to end
        assert not timed_out
        assert "running jobs dropped" not in caplog.text
    else:
        # node-wide timeout only: the channel was closed under the job (the fault), the
        # worker said why, and the job resumed where it stopped
        assert timed_out
        assert "the broker's consumer timeout ended a job" in caplog.text
