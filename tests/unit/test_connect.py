"""Connecting to RabbitMQ: a failed attempt leaves nothing behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trtllm_worker.connect.amqp import connect


def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def open_sockets() -> int:
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            continue
    return count


PROGRAM = """
import asyncio, gc, logging, sys
from trtllm_worker.connect.amqp import connect

logging.disable(logging.CRITICAL)  # aio-pika logs each refused attempt; that is expected

async def main(url: str) -> None:
    try:
        await connect(url, settings=None, name="test")
    except ConnectionError as exc:
        print(exc)

asyncio.run(main(sys.argv[1]))
gc.collect()
"""


def two_refused_nodes() -> str:
    port = closed_port()
    return f"amqp://guest:guest@127.0.0.1:{port}/,amqp://guest:guest@127.0.0.1:{port}/"


def test_a_program_whose_connection_failed_ends_quietly() -> None:
    """aio-pika's `connect` leaves a failed `Connection` open; freed later, its `__del__`
    schedules a `close()` that a program about to end never awaits ("coroutine
    'Connection.close' was never awaited" on the stderr of `trtllm-worker check` with an
    unreachable broker). Run as `check` is, in a process of its own (-X dev shows every
    such warning): its stderr stays empty."""
    result = subprocess.run(
        [sys.executable, "-X", "dev", "-c", PROGRAM, two_refused_nodes()],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "cannot connect to RabbitMQ" in result.stdout
    assert result.stderr == ""


async def test_a_failed_attempt_keeps_no_socket_open() -> None:
    before = open_sockets()
    with pytest.raises(ConnectionError, match="cannot connect to RabbitMQ"):
        await connect(two_refused_nodes(), settings=None, name="test")
    assert open_sockets() == before
