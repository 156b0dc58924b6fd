"""Connecting to RabbitMQ: a failed attempt leaves nothing behind."""

from __future__ import annotations

import gc
import socket

import aio_pika
import pytest

from worker.broker.connect import connect


def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_failed_connection_attempt_is_closed() -> None:
    """aio-pika's `connect` leaves a failed `Connection` open: when the garbage collector
    finds it, its `__del__` schedules `close()` as a task, which a program that then
    ends never awaits ("coroutine 'Connection.close' was never awaited" on the stderr of
    `trtllm-worker check` with an unreachable broker)."""
    port = closed_port()
    url = f"amqp://guest:guest@127.0.0.1:{port}/,amqp://guest:guest@127.0.0.1:{port}/"
    before = {id(o) for o in gc.get_objects() if isinstance(o, aio_pika.Connection)}
    with pytest.raises(ConnectionError, match="cannot connect to RabbitMQ"):
        await connect(url, settings=None, name="test")
    attempts = [
        o for o in gc.get_objects() if isinstance(o, aio_pika.Connection) and id(o) not in before
    ]
    assert len(attempts) == 2
    assert all(attempt.is_closed for attempt in attempts)
