"""The worker as operators run it: `python -m trtllm_worker`, stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator

import pytest

from tests.integration.conftest import (
    Producer,
    Spawn,
    Subscriber,
    WorkerFactory,
    terminal,
    worker_env,
)
from tests.services import ServiceUrls
from trtllm_worker.app.service import event_loop_factory
from trtllm_worker.contract.errors import ConfigError


def rid() -> str:
    return f"proc-{uuid.uuid4().hex[:10]}"


async def wait_for_line(stream: asyncio.StreamReader, needle: str, wait_s: float = 20) -> str:
    """The output up to and including the first line holding `needle`."""
    seen = []
    async with asyncio.timeout(wait_s):
        while line := (await stream.readline()).decode():
            seen.append(line)
            if needle in line:
                return "".join(seen)
    raise AssertionError(f"{needle!r} not in output: {''.join(seen)}")


@pytest.fixture
async def worker_process(
    services: ServiceUrls, names: dict[str, str], tmp_path: os.PathLike[str]
) -> AsyncIterator[asyncio.subprocess.Process]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "trtllm_worker",
        "serve",
        env=worker_env(services, names, WORKER_ECHO_STEP_MS="10", WORKER_DRAIN_TIMEOUT_S="1.5"),
        cwd=tmp_path,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    await wait_for_line(process.stderr, "ready:")
    yield process
    if process.returncode is None:
        process.kill()
        await process.wait()


async def test_sigterm_drains_then_exits_zero(
    worker_process: asyncio.subprocess.Process,
    producer: Producer,
    subscriber: Subscriber,
    names: dict[str, str],
) -> None:
    short, long = rid(), rid()
    await producer.publish(
        {"request_id": short, "inputs": "ab", "parameters": {"max_new_tokens": 50}}
    )
    await producer.publish(
        {"request_id": long, "inputs": "ab", "parameters": {"max_new_tokens": 2000}}
    )
    await subscriber.first_entry(short)
    await subscriber.first_entry(long)
    worker_process.send_signal(signal.SIGTERM)
    async with asyncio.timeout(20):
        code = await worker_process.wait()
    assert code == 0
    # the short job finished during the drain; the long one went back unacknowledged
    assert terminal(await subscriber.read_until_terminal(short))["finish_reason"] == "length"
    long_entries = await subscriber.entries(long)
    assert long_entries
    assert all(fields["event"] == "token" for fields in long_entries)
    queue = await producer.channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "quorum"}
    )
    assert queue.declaration_result.message_count == 1


async def test_unreachable_broker_is_one_line_and_nonzero(
    services: ServiceUrls, names: dict[str, str], tmp_path: os.PathLike[str]
) -> None:
    env = worker_env(services, names, WORKER_AMQP_URL="amqp://guest:s3cret@127.0.0.1:1/")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "trtllm_worker",
        env=env,
        cwd=tmp_path,
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        _, stderr = await process.communicate()
    text = stderr.decode()
    assert process.returncode == 69
    assert "cannot connect to RabbitMQ" in text
    assert "s3cret" not in text
    assert "Traceback" not in text


@pytest.mark.parametrize("reachable", [True, False], ids=["running", "unreachable"])
async def test_passwords_never_reach_the_logs(
    services: ServiceUrls,
    names: dict[str, str],
    tmp_path: os.PathLike[str],
    producer: Producer,
    subscriber: Subscriber,
    reachable: bool,
) -> None:
    """Passwords in the URLs appear in no log line and no error, at DEBUG too."""
    # Redis' default user takes any password, so a password in the URL still connects
    redis_url = services.redis.replace("redis://", "redis://:Sup3r-s3cret@", 1)
    if not reachable:
        redis_url = "redis://:Sup3r-s3cret@127.0.0.1:1/0"
    env = worker_env(services, names, WORKER_REDIS_URL=redis_url, WORKER_LOG_LEVEL="DEBUG")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "trtllm_worker",
        env=env,
        cwd=tmp_path,
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    head = ""
    if reachable:
        assert process.stderr is not None
        head = await wait_for_line(process.stderr, "ready:")
        request_id = rid()
        await producer.publish({"request_id": request_id, "inputs": "pw", "parameters": {}})
        await subscriber.read_until_terminal(request_id, wait_s=30)
        process.send_signal(signal.SIGTERM)
    async with asyncio.timeout(30):
        stdout, stderr = await process.communicate()
    text = head + (stdout + stderr).decode()
    assert process.returncode == (0 if reachable else 69), text
    assert "Sup3r-s3cret" not in text
    assert ":guest@" not in text
    assert "guest:***@" in text or not reachable


@pytest.mark.parametrize(("setting", "loop"), [(None, "uvloop"), ("asyncio", "asyncio")])
async def test_the_worker_runs_on_uvloop_when_installed_unless_told_otherwise(
    spawn: Spawn,
    producer: Producer,
    subscriber: Subscriber,
    setting: str | None,
    loop: str,
) -> None:
    """WORKER_EVENT_LOOP=auto (the default) takes uvloop, which the test environment
    installs as the image does; `asyncio` keeps asyncio's own loop. Jobs run on either."""
    worker = await spawn(**({} if setting is None else {"WORKER_EVENT_LOOP": setting}))
    assert f"event loop {loop}" in worker.log()
    request_id = rid()
    await producer.publish(
        {"request_id": request_id, "inputs": "loop", "parameters": {"max_new_tokens": 8}}
    )
    done = terminal(await subscriber.read_until_terminal(request_id))
    assert (done["event"], done["generated_tokens"]) == ("done", "8")


def test_uvloop_asked_for_but_not_installed_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now fails
    assert event_loop_factory("auto") is None
    assert event_loop_factory("asyncio") is None
    with pytest.raises(ConfigError, match="WORKER_EVENT_LOOP: uvloop is not installed"):
        event_loop_factory("uvloop")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_http_port_in_use_is_one_line_before_any_job_is_taken(
    run_worker: WorkerFactory, spawn: Spawn, producer: Producer, names: dict[str, str], loop: str
) -> None:
    """The HTTP port is bound before anything else: one taken by another process stops
    the worker with one line and exit 2, and the job waiting in the queue is never
    delivered (not taken, not handed back, its delivery not counted)."""
    async with run_worker():  # declares the queue as a worker does
        pass
    request_id = rid()
    await producer.publish(
        {"request_id": request_id, "inputs": "ab", "parameters": {"max_new_tokens": 50}}
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = await spawn(
            ready=False,
            WORKER_HTTP_PORT=str(port),
            WORKER_EVENT_LOOP=loop,
            WORKER_ECHO_STEP_MS="20",
        )
        code = await worker.wait()
    assert worker.lines == [
        f"trtllm-worker: invalid setting WORKER_HTTP_PORT: cannot listen on 127.0.0.1:{port}: "
        "address already in use\n"
    ], worker.log()
    assert code == 2
    queue = await producer.channel.declare_queue(names["queue"], passive=True)
    assert queue.declaration_result.message_count == 1
    message = await queue.get(no_ack=True)
    assert message is not None
    assert not message.redelivered
    assert not (message.headers or {}).get("x-delivery-count")
    assert json.loads(message.body)["request_id"] == request_id
