"""The suite leaves nothing on the shared RabbitMQ: every test's queue, dead-letter queue
and cancel exchange are deleted after it, whoever declared them. Leftovers once piled up
run after run until the broker ran out of file handles and CI hung."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aio_pika
import aiormq
import pytest

from tests.services import ServiceUrls
from trtllm_worker.contract.queues import cancel_exchange_name, dead_queue_name

REPO = Path(__file__).resolve().parents[2]

INNER_CONFTEST = """
from tests.conftest import delete_test_queues, names, services  # noqa: F401
"""

# declares its topology itself, as a worker started without the amqp_channel fixture does
INNER_TEST = """
import asyncio
from pathlib import Path

import aio_pika

from trtllm_worker.contract.queues import cancel_exchange_name, dead_queue_name


async def declare(url, queue):
    connection = await aio_pika.connect(url)
    channel = await connection.channel()
    await channel.declare_queue(queue, durable=True)
    await channel.declare_queue(dead_queue_name(queue), durable=True)
    await channel.declare_exchange(
        cancel_exchange_name(queue), aio_pika.ExchangeType.FANOUT, durable=True
    )
    await connection.close()


def test_declares(names, services):
    asyncio.run(declare(services.amqp, names["queue"]))
    Path("queue-name").write_text(names["queue"])
"""


async def _exists(url: str, kind: str, name: str) -> bool:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        if kind == "queue":
            await channel.declare_queue(name, passive=True)
        else:
            await channel.declare_exchange(name, passive=True)
        return True
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    finally:
        await connection.close()


async def test_a_tests_queues_are_deleted_after_it(tmp_path: Path, services: ServiceUrls) -> None:
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    inner = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
        *("--rootdir", str(tmp_path), "test_inner.py"),
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(inner.communicate(), 50)
    assert inner.returncode == 0, output.decode()
    queue = (tmp_path / "queue-name").read_text()
    assert queue.startswith("test-")
    assert not await _exists(services.amqp, "queue", queue)
    assert not await _exists(services.amqp, "queue", dead_queue_name(queue))
    assert not await _exists(services.amqp, "exchange", cancel_exchange_name(queue))


@pytest.mark.parametrize("kind", ["queue", "exchange"])
async def test_the_check_sees_what_exists(
    services: ServiceUrls, names: dict[str, str], kind: str
) -> None:
    """The existence check above can answer yes: a declared queue and amq.direct."""
    connection = await aio_pika.connect(services.amqp)
    channel = await connection.channel()
    await channel.declare_queue(names["queue"], auto_delete=True)
    name = names["queue"] if kind == "queue" else "amq.direct"
    assert await _exists(services.amqp, kind, name)
    await connection.close()
