"""Nothing lost, nothing duplicated: real worker processes, broken for real (kill -9,
dropped broker connections, a Redis that goes away, SIGTERM, a poison job)."""

from __future__ import annotations

import asyncio
import functools
import re
import shutil
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.integration.conftest import (
    Entry,
    Producer,
    Spawn,
    Subscriber,
    terminal,
    tokens,
    xread,
)
from tests.services import ServiceUrls
from trtllm_worker.contract.stream import lease_key


def rid() -> str:
    return f"flt-{uuid.uuid4().hex[:10]}"


def echo(prompt: str, n: int) -> str:
    """What the echo engine makes of `prompt` with the byte-level tokenizer."""
    data = prompt.encode()
    return (data * (n // len(data) + 1))[:n].decode("utf-8", errors="replace")


def assert_exact(entries: list[Entry], prompt: str, n: int) -> None:
    """One terminal entry, last; indices 0..n-1 once each; the exact echo text."""
    assert entries, f"no entries for prompt {prompt!r}"
    done = terminal(entries)
    assert done["event"] == "done", done
    token_entries = tokens(entries)
    assert [int(e["index"]) for e in token_entries] == list(range(n))
    text = "".join(e["text"] for e in token_entries)
    assert text == done["generated_text"] == echo(prompt, n)
    assert done["generated_tokens"] == str(n)


async def wait_for_entries(subscriber: Subscriber, request_id: str, count: int) -> None:
    """Until the stream holds `count` entries (XREAD blocks; no sleeping)."""
    last_id, seen = "0", 0
    async with asyncio.timeout(30):
        while seen < count:
            reply = await xread(subscriber.redis, {subscriber.key(request_id): last_id}, 1000)
            for _, items in reply:
                seen += len(items)
                last_id = items[-1][0]


async def test_kill_9_mid_stream_then_another_worker_resumes(
    spawn: Spawn, producer: Producer, subscriber: Subscriber
) -> None:
    request_id, prompt, n = rid(), "Resume me, 日本! ", 300
    first = await spawn(WORKER_ECHO_STEP_MS="10")
    await producer.publish(
        {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": n}}
    )
    await wait_for_entries(subscriber, request_id, 40)
    first.signal(signal.SIGKILL)
    assert await first.wait() == -signal.SIGKILL
    partial = await subscriber.entries(request_id)
    assert partial
    assert all(e["event"] == "token" for e in partial)
    await spawn(WORKER_ECHO_STEP_MS="1")
    entries = await subscriber.read_until_terminal(request_id, wait_s=60)
    assert_exact(entries, prompt, n)
    assert entries[: len(partial)] == partial  # what was published stays as it was


async def test_broker_connections_closed_during_a_run(
    spawn: Spawn, producer: Producer, subscriber: Subscriber, services: ServiceUrls
) -> None:
    """The broker closes both workers' connections while their jobs are mid-stream:
    their deliveries go back, the workers reconnect, and every job ends exactly once,
    resumed where its stream stood. The test proves the fault happened: the connections
    it closed were the workers', jobs were running when they went (their streams had
    tokens and no end), and some jobs were resumed."""
    if shutil.which("rabbitmqctl") is None:
        pytest.fail("rabbitmqctl is needed to close the broker's connections")
    workers = [await spawn(WORKER_ECHO_STEP_MS="20", WORKER_MAX_BATCH="32") for _ in range(2)]
    jobs = {rid(): f"job {n:03d} " for n in range(200)}
    for request_id, prompt in jobs.items():
        await producer.publish(
            {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": 60}}
        )
    await wait_for_entries(subscriber, next(iter(jobs)), 10)
    closed = await close_connections_of([w.pid for w in workers])
    mid_stream = [i for i in jobs if await is_mid_stream(subscriber, i)]
    assert closed == 2, "each worker's connection was closed"
    assert mid_stream, "jobs were mid-stream when their connections went"
    results = list((await subscriber.read_many(list(jobs), wait_s=120)).values())
    for prompt, entries in zip(jobs.values(), results, strict=True):
        assert_exact(entries, prompt, 60)
    assert all(w.process.returncode is None for w in workers), "the workers keep running"
    dropped = [int(n) for w in workers for n in DROPPED.findall(w.log())]
    assert len(dropped) >= 2, "both workers saw their connection go"
    assert sum(dropped) > 0, "running jobs were dropped with it"
    for port in [w.http_port for w in workers]:  # reconnected and consuming again
        await wait_until(functools.partial(http_is, port, "/readyz", 200))
    resumed = sum([await metric(w.http_port, "worker_jobs_resumed_total") for w in workers])
    assert resumed > 0, "dropped jobs continued their streams"


async def test_several_broker_urls_the_worker_moves_to_another_node(
    spawn: Spawn, producer: Producer, subscriber: Subscriber, services: ServiceUrls
) -> None:
    """WORKER_AMQP_URL lists three nodes: the first never answers, so the worker starts
    on the second; when that connection goes, the worker tries the next node (down),
    then the one after (up), consumes again, and every job ends exactly once. (The same
    broker stands for two of the nodes: the path through the list is what is tested; a
    real 3-node cluster is not started here.)"""
    if shutil.which("rabbitmqctl") is None:
        pytest.fail("rabbitmqctl is needed to close the broker's connections")
    down, down_too = free_port(), free_port()
    urls = ",".join(
        (f"amqp://guest:guest@127.0.0.1:{down}/", services.amqp,
         f"amqp://guest:guest@127.0.0.1:{down_too}/", services.amqp)
    )  # fmt: skip
    # 120 jobs, 16 at a time, 1 s each: work in hand whenever the connection goes
    worker = await spawn(WORKER_ECHO_STEP_MS="10", WORKER_MAX_BATCH="16", WORKER_AMQP_URL=urls)
    jobs = {rid(): f"job {n:03d} " for n in range(120)}
    for request_id, prompt in jobs.items():
        await producer.publish(
            {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": 100}}
        )
    await wait_for_entries(subscriber, next(iter(jobs)), 5)
    assert await close_connections_of([worker.pid]) == 1, "the worker's connection was closed"
    assert [i for i in jobs if await is_mid_stream(subscriber, i)], "jobs were mid-stream"
    results = list((await subscriber.read_many(list(jobs), wait_s=120)).values())
    for prompt, entries in zip(jobs.values(), results, strict=True):
        assert_exact(entries, prompt, 100)
    await wait_until(functools.partial(http_is, worker.http_port, "/readyz", 200))
    moves = MOVED.findall(worker.log())
    broker = services.amqp.rpartition("@")[2].rstrip("/")
    assert moves[:1] == [(f"127.0.0.1:{down}", broker)], moves
    assert (broker, f"127.0.0.1:{down_too}") in moves, "the lost connection moved on"
    assert moves[-1][1] == broker, "it ended on a node that answers"


MOVED = re.compile(
    r"RabbitMQ node amqp://guest:\*\*\*@(\S+?)/ is gone .*; next attempt on amqp://guest:\*\*\*@(\S+?)/"
)
DROPPED = re.compile(r"broker connection lost .*: (\d+) running jobs dropped")


async def close_connections_of(pids: list[int]) -> int:
    """Close, with rabbitmqctl, the broker connections of these worker processes only
    (their connection names carry their pid); returns how many were closed."""
    listing = await output("rabbitmqctl", "list_connections", "pid", "client_properties", "-q")
    closed = 0
    for line in listing.splitlines():
        connection, _, properties = line.partition("\t")
        if any(f'"trtllm-worker {socket.gethostname()}:{pid}:' in properties for pid in pids):
            assert await run("rabbitmqctl", "close_connection", connection, "fault injection") == 0
            closed += 1
    return closed


async def is_mid_stream(subscriber: Subscriber, request_id: str) -> bool:
    entries = await subscriber.entries(request_id)
    return bool(entries) and entries[-1]["event"] == "token"


async def metric(port: int, name: str) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    body = (await reader.read()).decode()
    writer.close()
    values = [float(line.split()[-1]) for line in body.splitlines() if line.startswith(name + " ")]
    return sum(values)


async def output(*command: str) -> str:
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    stdout, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, command
    return stdout.decode()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def start_redis(port: int, data_dir: Path) -> None:
    """A private redis-server (never the shared one) that keeps its data across restarts."""
    assert (
        await run(
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--daemonize",
            "yes",
            "--dir",
            str(data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--logfile",
            str(data_dir / "redis.log"),
        )
        == 0
    )
    await wait_until(lambda: redis_answers(port))


async def run(*command: str) -> int:
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    return await asyncio.wait_for(process.wait(), 60)


async def redis_answers(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


async def http_is(port: int, path: str, status: int) -> bool:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head = await reader.read()
    writer.close()
    return int(head.split()[1]) == status


async def wait_until(condition: Callable[[], Awaitable[bool]], within_s: float = 30) -> None:
    """Poll another process's state (it offers no event to wait on)."""
    async with asyncio.timeout(within_s):
        while not await condition():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    "buffer_entries", ["100000", "20"], ids=["buffered", "buffer-full-hands-back"]
)
async def test_redis_stopped_and_restarted_mid_run(
    spawn: Spawn, producer: Producer, tmp_path: Path, names: dict[str, str], buffer_entries: str
) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is needed for a private Redis")
    import redis.asyncio as aioredis

    from tests.integration.conftest import Subscriber as Reader

    port = free_port()
    await start_redis(port, tmp_path)
    private = aioredis.Redis(port=port, decode_responses=True)
    reader = Reader(private, names["stream_prefix"])
    try:
        worker = await spawn(
            WORKER_REDIS_URL=f"redis://127.0.0.1:{port}/0",
            WORKER_ECHO_STEP_MS="5",
            WORKER_REDIS_BUFFER_ENTRIES=buffer_entries,
        )
        jobs = {rid(): f"r{n:02d}-" for n in range(30)}
        for request_id, prompt in jobs.items():
            await producer.publish(
                {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": 150}}
            )
        await wait_for_entries(reader, next(iter(jobs)), 20)
        await run("redis-cli", "-p", str(port), "shutdown")
        await wait_until(lambda: http_is(worker.http_port, "/readyz", 503))
        await start_redis(port, tmp_path)
        results = list((await reader.read_many(list(jobs), wait_s=120)).values())
        for prompt, entries in zip(jobs.values(), results, strict=True):
            assert_exact(entries, prompt, 150)
        await wait_until(lambda: http_is(worker.http_port, "/readyz", 200))
        if buffer_entries == "20":
            assert "buffer is full" in worker.log()
    finally:
        await private.aclose()
        await run("redis-cli", "-p", str(port), "shutdown", "nosave")


async def test_sigterm_hands_unfinished_jobs_to_the_other_worker(
    spawn: Spawn, producer: Producer, subscriber: Subscriber
) -> None:
    leaving = await spawn(WORKER_ECHO_STEP_MS="5", WORKER_DRAIN_TIMEOUT_S="0.5")
    jobs = {rid(): f"s{n:02d} " for n in range(20)}
    for request_id, prompt in jobs.items():
        await producer.publish(
            {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": 400}}
        )
    await wait_for_entries(subscriber, next(iter(jobs)), 20)
    # at once: starting the other worker first took longer than the jobs on a loaded
    # machine, and they had all ended before the signal
    leaving.signal(signal.SIGTERM)
    assert await leaving.wait() == 0
    assert "handed back" in leaving.log()
    staying = await spawn(WORKER_ECHO_STEP_MS="1")
    results = list((await subscriber.read_many(list(jobs), wait_s=120)).values())
    for prompt, entries in zip(jobs.values(), results, strict=True):
        assert_exact(entries, prompt, 400)
    assert staying.process.returncode is None


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_poison_job_that_kills_workers_ends_in_the_dead_letter_queue(
    spawn: Spawn,
    producer: Producer,
    subscriber: Subscriber,
    services: ServiceUrls,
    queue_type: str,
) -> None:
    """Quorum queues count the deliveries, the worker counts a classic queue's
    redeliveries in Redis: either way the third delivery is past the limit."""
    request_id = rid()
    env = {
        "WORKER_ECHO_CRASH_TOKEN_ID": "255",
        "WORKER_DELIVERY_LIMIT": "2",
        "WORKER_QUEUE_TYPE": queue_type,
    }
    first = await spawn(**env)
    await producer.publish({"request_id": request_id, "input_ids": [97, 255]})
    assert await first.wait() == 3  # the engine died on it
    second = await spawn(**env)
    try:
        assert await second.wait() == 3
    except TimeoutError:
        raise AssertionError(second.log() + "\nFIRST:\n" + first.log()) from None
    third = await spawn(**env)  # the third delivery is past the limit: not run
    dead = await producer.get_dead(wait_s=30)
    assert dead.headers["x-error-code"] == "internal_error"
    assert "delivered 3 times" in str(dead.headers["x-error-message"])
    entries = await subscriber.read_until_terminal(request_id)
    assert terminal(entries)["event"] == "error"
    assert third.process.returncode is None


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_a_job_past_its_limit_while_its_dead_workers_lease_lives_gets_its_end(
    spawn: Spawn, producer: Producer, subscriber: Subscriber, queue_type: str
) -> None:
    """A worker dies mid-job without a word (kill -9: its lease lives on until it
    expires) and the redelivery is past WORKER_DELIVERY_LIMIT. The worker that gets it
    waits the stale lease out and takes it, as a resuming job does, and writes the
    `error` entry through it: one terminal entry after the stored tokens, the stream's
    TTL, then the dead letter."""
    request_id = rid()
    key = subscriber.key(request_id)
    env = {
        "WORKER_DELIVERY_LIMIT": "1",
        "WORKER_QUEUE_TYPE": queue_type,
        "WORKER_STREAM_TTL_S": "600",
    }
    first = await spawn(WORKER_ECHO_STEP_MS="20", **env)
    await producer.publish(
        {"request_id": request_id, "inputs": "ab", "parameters": {"max_new_tokens": 2000}}
    )
    await wait_for_entries(subscriber, request_id, 3)
    second = await spawn(**env)
    first.signal(signal.SIGKILL)
    await first.wait()
    assert await subscriber.redis.pttl(lease_key(key)) > 0  # the dead worker's, still live
    dead = await producer.get_dead(wait_s=30)
    assert dead.headers["x-error-code"] == "internal_error"
    assert "delivered 2 times" in str(dead.headers["x-error-message"])
    entries = await subscriber.entries(request_id)  # stored before the dead letter
    error = terminal(entries)
    assert error["event"] == "error", second.log()
    assert error["code"] == "internal_error"
    assert [int(e["index"]) for e in tokens(entries)] == list(range(len(entries) - 1))
    assert 0 < await subscriber.redis.ttl(key) <= 600
    assert not await subscriber.redis.exists(lease_key(key))
    assert second.process.returncode is None
