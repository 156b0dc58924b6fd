"""Secrets in URLs never printed: every place the worker, `check`, `tail` and the SDK
print a RabbitMQ, Redis or OTLP URL, with the secret in the userinfo or in the query
string (redis-py reads `?password=` and `?ssl_password=`; an OTLP endpoint may carry
`?token=`). A private redis-server with a password (never the shared one) lets the
success lines print a URL whose password really was used."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Producer, Spawn, Subscriber
from tests.integration.test_cli import Cli, no_traceback
from tests.integration.test_faults import free_port
from tests.otlp import Collected, http_receiver
from tests.services import ServiceUrls
from trtllm_worker.client import Client, QueueMissing, ServiceUnavailable

SECRET = "qu3ry-s3cret"
"""The Redis password, given in the URL's query string."""
WRONG = "wr0ng-s3cret"
TOKEN = "0tlp-t0ken"


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[int]:
    """A private redis-server that requires `SECRET`; yields its port."""
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", SECRET,
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:  # another process: polled until it listens
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert time.monotonic() < deadline, "the private redis-server did not start"
            time.sleep(0.05)
        yield port
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


@pytest.fixture
async def otlp_endpoint() -> AsyncIterator[str]:
    """An OTLP/HTTP traces endpoint whose URL carries a token in its query string."""
    with http_receiver(Collected(asyncio.get_running_loop()), keep=False) as url:
        yield f"{url}/v1/traces?token={TOKEN}"


@pytest.fixture
def cli(
    services: ServiceUrls,
    names: dict[str, str],
    tmp_path: Path,
    subscriber: Subscriber,  # removes the test's keys afterwards
    producer: Producer,  # deletes the test's queues afterwards
) -> Cli:
    return Cli(services, names, tmp_path)


def secret_free(text: str) -> None:
    for secret in (SECRET, WRONG, TOKEN):
        assert secret not in text, text


async def test_serve_log_lines(
    spawn: Spawn, services: ServiceUrls, private_redis: int, otlp_endpoint: str
) -> None:
    """The startup lines name the broker and the trace endpoint: their secrets hidden."""
    worker = await spawn(
        WORKER_AMQP_URL=f"{services.amqp}?auth_token={TOKEN}",
        WORKER_REDIS_URL=f"redis://127.0.0.1:{private_redis}/0?password={SECRET}",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=otlp_endpoint,
    )
    log = worker.log()  # the lines before "ready" (the fixture stops the worker)
    assert "?auth_token=***" in log, log  # "consuming … at <amqp url>"
    assert "/v1/traces?token=***" in log, log  # "traces: OTLP … to <endpoint>"
    secret_free(log)


async def test_serve_refused_by_redis(spawn: Spawn, private_redis: int) -> None:
    worker = await spawn(
        ready=False, WORKER_REDIS_URL=f"redis://127.0.0.1:{private_redis}/0?password={WRONG}"
    )
    assert await worker.wait() == 69, worker.log()
    assert f":{private_redis}/0?password=***" in worker.log(), worker.log()
    secret_free(worker.log())


async def test_check_success_and_problem_lines(cli: Cli, private_redis: int) -> None:
    url = f"redis://127.0.0.1:{private_redis}/0"
    ok = await cli.run("check", WORKER_REDIS_URL=f"{url}?password={SECRET}")
    no_traceback(ok)
    redis_line = next(line for line in ok.stdout.splitlines() if "Redis" in line)
    assert redis_line.startswith("ok Redis"), ok.stdout
    assert f"{url}?password=***" in redis_line, redis_line
    secret_free(ok.stdout + ok.stderr)

    refused = await cli.run("check", WORKER_REDIS_URL=f"{url}?db=0&password={WRONG}")
    assert refused.code == 1, refused
    no_traceback(refused)
    assert f"problem Redis: cannot connect to Redis at {url}?db=0&password=***" in refused.stdout
    secret_free(refused.stdout + refused.stderr)

    broker = await cli.run(
        "check", WORKER_AMQP_URL=f"amqp://guest:guest@127.0.0.1:1/?token={TOKEN}"
    )
    assert broker.code == 1, broker
    assert "amqp://guest:***@127.0.0.1:1/?token=***" in broker.stdout, broker.stdout
    secret_free(broker.stdout + broker.stderr)


async def test_tail_errors(cli: Cli, private_redis: int) -> None:
    for url in (
        f"redis://127.0.0.1:{private_redis}/0?password={WRONG}",  # refused
        f"redis://127.0.0.1:1/0?password={SECRET}",  # unreachable
    ):
        result = await cli.run("tail", "some-request", WORKER_REDIS_URL=url)
        assert result.code == 69, result
        no_traceback(result)
        assert len(result.stderr_lines) == 1, result.stderr
        assert "?password=***" in result.stderr, result.stderr
        secret_free(result.stderr + result.stdout)


async def test_sdk_error_messages(
    services: ServiceUrls, names: dict[str, str], private_redis: int
) -> None:
    queue = f"test-missing-{uuid.uuid4().hex[:8]}"
    async with Client(
        amqp_url=f"{services.amqp}?access_token={TOKEN}",
        redis_url=f"redis://127.0.0.1:{private_redis}/0?password={WRONG}",
        queue=queue,
        stream_prefix=names["stream_prefix"],
    ) as client:
        with pytest.raises(ServiceUnavailable) as refused:
            async for _ in client.stream("some-request"):
                pass
        assert "?password=***" in str(refused.value), refused.value
        secret_free(str(refused.value))
        with pytest.raises(QueueMissing) as missing:  # no worker declared this queue
            await client.submit("hello")
        assert "?access_token=***" in str(missing.value), missing.value
        secret_free(str(missing.value))
    async with Client(
        amqp_url=f"amqp://guest:guest@127.0.0.1:1/?api_key={TOKEN}",
        redis_url=services.redis,
        queue=queue,
        stream_prefix=names["stream_prefix"],
    ) as client:
        with pytest.raises(ServiceUnavailable) as unreachable:
            await client.submit("hello")
        assert "?api_key=***" in str(unreachable.value), unreachable.value
        secret_free(str(unreachable.value))
