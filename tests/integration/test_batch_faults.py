"""Exactly once, tested with real workers: a batch in OpenAI's Batch format runs on the
echo engine while something breaks (a worker killed -9 while it holds lines, lines
paused by interactive jobs, every line's message delivered twice, Redis restarted),
and every input line still ends exactly once, in the output or the errors file, with
counts that match and the text an uninterrupted run gives. Each test proves its fault
really happened."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import signal
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aio_pika
import pytest
import redis.asyncio as aioredis

from tests.integration.conftest import Entry, Spawn, WorkerFactory, terminal, tokens
from tests.integration.test_faults import echo, free_port, http_is, metric, wait_until
from trtllm_worker.app.service import Service
from trtllm_worker.client import Client, ServiceUnavailable
from trtllm_worker.client.batches import BatchObject
from trtllm_worker.config import Settings
from trtllm_worker.contract.batches import batch_key, counts_key, line_request_id
from trtllm_worker.contract.stream import lease_key

Lines = dict[str, tuple[str, int]]
"""custom_id → (prompt, max_tokens), in input order."""


def completion_line(custom_id: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A `/v1/completions` line: a plain prompt, no chat template needed."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "echo", "prompt": prompt, "max_tokens": max_tokens},
    }


def batch_file(path: Path, count: int, max_tokens: int, tag: str) -> tuple[Path, Lines]:
    """`count` lines with distinct prompts (so a line's text is its own)."""
    lines: Lines = {f"{tag}-{i:03d}": (f"{tag} line {i:03d} ", max_tokens) for i in range(count)}
    path.write_text(
        "".join(json.dumps(completion_line(c, p, n)) + "\n" for c, (p, n) in lines.items())
    )
    return path, lines


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def finish(
    client: Client, batch_id: str, tmp_path: Path
) -> tuple[BatchObject, list[dict[str, Any]], list[dict[str, Any]]]:
    """Wait for the batch to end; its Batch object, output lines and error lines."""
    final = await asyncio.wait_for(client.wait_batch(batch_id, poll_s=0.05), 60)
    out, err = tmp_path / f"{batch_id}.out.jsonl", tmp_path / f"{batch_id}.err.jsonl"
    counted = await client.write_batch_results(batch_id, out, err)
    output, errors = read_jsonl(out), read_jsonl(err)
    assert counted == (len(output), len(errors))
    return final, output, errors


def assert_each_line_once(
    lines: Lines, final: BatchObject, output: list[dict[str, Any]], errors: list[dict[str, Any]]
) -> None:
    """Every custom_id once across both files, none failed, the counts those of the file,
    and each line's text exactly the echo engine's for its prompt."""
    seen = Counter(line["custom_id"] for line in output + errors)
    assert seen == Counter(list(lines)), {c: k for c, k in seen.items() if k != 1} or seen
    assert errors == []
    assert final["status"] == "completed", final
    assert final["request_counts"] == {"total": len(lines), "completed": len(lines), "failed": 0}
    assert [line["custom_id"] for line in output] == list(lines)  # input order
    for line in output:
        prompt, n = lines[line["custom_id"]]
        body = line["response"]["body"]
        assert body["choices"][0]["text"] == echo(prompt, n), line["custom_id"]
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == n
        assert body["usage"]["prompt_tokens"] == len(prompt.encode())


async def assert_streams_whole(
    redis: aioredis.Redis, prefix: str, batch_id: str, lines: Lines
) -> None:
    """Each line's stream: indices 0..n-1 once each, one terminal entry, last."""
    for line, (_, n) in enumerate(lines.values()):
        raw = await redis.xrange(prefix + line_request_id(batch_id, line))
        entries = [fields for _, fields in cast(list[tuple[str, Entry]], raw)]
        assert terminal(entries)["event"] == "done"
        assert [int(e["index"]) for e in tokens(entries)] == list(range(n)), line


@dataclass(frozen=True)
class LineState:
    """One line as Redis holds it at one moment."""

    tokens: int
    ended: bool
    lease: str | None

    @property
    def mid_stream(self) -> bool:
        return self.tokens > 0 and not self.ended


async def line_states(
    redis: aioredis.Redis, prefix: str, batch_id: str, count: int
) -> list[LineState]:
    """Every line's token entries, whether its terminal entry is stored, and its lease
    holder, read in one pipeline (one moment)."""
    pipe = redis.pipeline(transaction=True)
    for line in range(count):
        key = prefix + line_request_id(batch_id, line)
        pipe.xlen(key)
        pipe.xrevrange(key, count=1)
        pipe.get(lease_key(key))
    replies = await pipe.execute()
    states = []
    for line in range(count):
        length, tail, lease = replies[3 * line : 3 * line + 3]
        ended = bool(tail) and tail[0][1]["event"] in ("done", "error")
        states.append(LineState(int(length) - int(ended), ended, lease))
    return states


# -- 1. a worker killed -9 while it holds lines -------------------------------------------


def holder(lease: str | None) -> str | None:
    """The worker process a lease token belongs to (its random prefix)."""
    return None if lease is None else lease.partition(":")[0]


async def test_a_worker_killed_mid_batch_the_other_finishes_every_line_once(
    spawn: Spawn,
    make_settings: Callable[..., Settings],
    redis_client: aioredis.Redis,
    names: dict[str, str],
    cleanup_keys: None,
    tmp_path: Path,
) -> None:
    """Two worker processes share a batch; one is killed -9 while lines of its own are
    mid-stream (token entries, no terminal entry, its lease on them). Their messages go
    back to the queue, the other worker resumes each of them where its stream stood, and
    every line ends once. The fault is proven: the killed worker's leases were on lines
    mid-stream at the kill, and the survivor resumed exactly that many streams."""
    prefix = names["stream_prefix"]
    source, lines = batch_file(tmp_path / "in.jsonl", 24, 150, "kill")
    env = {"WORKER_ECHO_STEP_MS": "10", "WORKER_MAX_BATCH": "4"}
    doomed = await spawn(**env)
    async with Client(make_settings()) as client:
        batch_id = await client.submit_batch(source)

        async def holders() -> set[str | None]:
            states = await line_states(redis_client, prefix, batch_id, len(lines))
            return {holder(s.lease) for s in states if s.mid_stream}

        await wait_until(lambda: _nonempty(holders()))
        (doomed_id,) = await holders()  # the only worker yet
        survivor = await spawn(**env)
        # both hold lines mid-stream: the survivor has taken its share of the queue
        await wait_until(lambda: _size_at_least(holders(), 2))
        doomed.signal(signal.SIGKILL)
        assert await doomed.wait() == -signal.SIGKILL
        # nothing the dead worker held changes now: its leases live on for up to 2 s
        at_kill = await line_states(redis_client, prefix, batch_id, len(lines))
        in_flight = {
            line: s.tokens
            for line, s in enumerate(at_kill)
            if s.mid_stream and holder(s.lease) == doomed_id
        }
        assert in_flight, "the killed worker held lines mid-stream"
        final, output, errors = await finish(client, batch_id, tmp_path)
    assert_each_line_once(lines, final, output, errors)
    await assert_streams_whole(redis_client, prefix, batch_id, lines)
    resumed = await metric(survivor.http_port, "worker_jobs_resumed_total")
    # at least: a resumed line the survivor then gives back from its lookout (unrun, to
    # keep it open for interactive jobs) is resumed again when it comes back
    assert resumed >= len(in_flight), "the survivor resumed each line the dead one dropped"
    assert "resuming after" in survivor.log()
    assert survivor.process.returncode is None


async def _nonempty(values: Awaitable[set[str | None]]) -> bool:
    return bool(await values)


async def _true(value: bool) -> bool:
    return value


async def _size_at_least(values: Awaitable[set[str | None]], size: int) -> bool:
    return len(await values) >= size


# -- 2. lines paused by interactive jobs ----------------------------------------------------


async def test_lines_paused_by_interactive_jobs_end_once_with_the_uninterrupted_text(
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    redis_client: aioredis.Redis,
    names: dict[str, str],
    cleanup_keys: None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Batch lines at priority 0 fill both slots of a worker; interactive jobs
    (priority 9) arrive one after another and each pauses a running line, which goes
    back to the queue and later resumes its stream. Every line ends once with the very
    text an uninterrupted run gives. The fault is proven: the worker counted and logged
    its pauses, each of a batch line mid-stream, and resumed those streams."""
    caplog.set_level(logging.INFO, logger="trtllm_worker.pipeline.runner")
    prefix = names["stream_prefix"]
    source, lines = batch_file(tmp_path / "in.jsonl", 6, 100, "pause")
    async with (
        run_worker(max_batch=2, echo_step_ms=15, queue_type="classic") as service,
        Client(make_settings()) as client,
    ):
        batch_id = await client.submit_batch(source, priority=0)

        async def running() -> int:
            # mid-stream and held: in a slot (a paused line lets its lease go)
            states = await line_states(redis_client, prefix, batch_id, len(lines))
            return sum(s.mid_stream and s.lease is not None for s in states)

        interactive = 3
        for i in range(interactive):
            # both slots busy with batch lines, then an interactive job
            await wait_until(lambda: _at_least(running(), 2))
            request_id = await client.submit(f"urgent {i} ", {"max_new_tokens": 5}, priority=9)
            done = await asyncio.wait_for(client.result(request_id), 30)
            assert done.generated_text == echo(f"urgent {i} ", 5)
        final, output, errors = await finish(client, batch_id, tmp_path)
        paused = service.metrics.paused._value.get()
        resumed = service.metrics.resumed._value.get()
    assert_each_line_once(lines, final, output, errors)
    await assert_streams_whole(redis_client, prefix, batch_id, lines)
    assert paused == interactive, "each interactive job paused a running line"
    pauses = [
        getattr(r, "request_id", None)
        for r in caplog.records
        if r.getMessage().startswith("pausing")
    ]
    line_ids = {line_request_id(batch_id, i) for i in range(len(lines))}
    assert len(pauses) == interactive, pauses
    assert set(pauses) <= line_ids, "each pause was a batch line's"
    assert resumed >= len(set(pauses)), "the paused lines continued their streams"


async def _at_least(value: Awaitable[float], floor: float) -> bool:
    return float(await value) >= floor


# -- 3. every line's message delivered twice ------------------------------------------------


async def test_every_line_published_twice_ends_once_and_counts_once(
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    redis_client: aioredis.Redis,
    names: dict[str, str],
    cleanup_keys: None,
    tmp_path: Path,
) -> None:
    """A `submit` that published its lines but died before it saved its progress is run
    again with the same id: every line's job message is published a second time while
    the first copies are ended, running or still queued, on two workers. Each line ends
    once; the counts, the records and the usage are not doubled. The fault is proven:
    each line's message was delivered twice (one delivery ran it, the other found it
    ended or waited for its end and was acknowledged unrun)."""
    prefix = names["stream_prefix"]
    source, lines = batch_file(tmp_path / "in.jsonl", 30, 60, "dup")
    async with (
        run_worker(max_batch=4, echo_step_ms=10) as first,
        run_worker(max_batch=4, echo_step_ms=10) as second,
        Client(make_settings()) as client,
    ):
        batch_id = await client.submit_batch(source)
        states = await _ended_and_running(redis_client, prefix, batch_id, len(lines))
        # the first run's progress lost: as if it died after publishing, before saving
        key = batch_key(prefix, batch_id)
        await redis_client.hset(key, "published", "0")
        await redis_client.hdel(key, "in_progress_at", "invalid")
        assert await client.submit_batch(source, batch_id=batch_id) == batch_id
        assert await redis_client.hget(key, "published") == str(len(lines))
        final, output, errors = await finish(client, batch_id, tmp_path)
        # every copy is settled before the deliveries are counted
        await wait_until(lambda: _deliveries([first, second], 2 * len(lines)))
        skipped = sum(_outcome(w, "skipped") for w in (first, second))
        ran = sum(_outcome(w, "done:length") for w in (first, second))
        usage = await client.usage()
    assert_each_line_once(lines, final, output, errors)
    await assert_streams_whole(redis_client, prefix, batch_id, lines)
    assert states.ended, "copies came for lines that had ended"
    assert states.running, "and for lines that were running"
    assert (ran, skipped) == (len(lines), len(lines)), "each line delivered twice, run once"
    counts = await redis_client.hgetall(counts_key(prefix, batch_id))
    assert counts == {"ok": str(len(lines))}
    assert [(u.jobs, u.generated_tokens) for u in usage] == [(len(lines), 60 * len(lines))]


@dataclass(frozen=True)
class Moment:
    ended: int
    running: int


async def _ended_and_running(
    redis: aioredis.Redis, prefix: str, batch_id: str, count: int
) -> Moment:
    """Wait until some lines have ended and others are mid-stream; that moment."""
    moment = Moment(0, 0)

    async def both() -> bool:
        nonlocal moment
        states = await line_states(redis, prefix, batch_id, count)
        moment = Moment(sum(s.ended for s in states), sum(s.mid_stream for s in states))
        return moment.ended > 0 and moment.running > 0

    await wait_until(both)
    return moment


def _outcome(service: Service, outcome: str) -> int:
    return int(service.metrics.jobs.labels(outcome=outcome)._value.get())


async def _deliveries(services: list[Service], expected: int) -> bool:
    outcomes = ("skipped", "done:length")
    return sum(_outcome(s, o) for s in services for o in outcomes) >= expected


# -- 4. Redis restarted mid-batch -----------------------------------------------------------


@dataclass
class PrivateRedis:
    """A redis-server of this test's own (never the shared one), in the foreground so
    that it is stopped by its pid; it keeps its data (append-only file, fsync always)
    across restarts on the same port and folder."""

    port: int
    data_dir: Path
    process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        assert self.process is None or self.process.returncode is not None
        self.process = await asyncio.create_subprocess_exec(
            "redis-server",
            "--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "no",
            "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", "always",
            "--save", "", "--logfile", str(self.data_dir / "redis.log"),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await wait_until(self.answers, within_s=15)

    async def answers(self) -> bool:
        assert self.process is not None
        if self.process.returncode is not None:
            log = (self.data_dir / "redis.log").read_text(errors="replace")
            raise AssertionError(f"redis-server exited {self.process.returncode}:\n{log}")
        probe = aioredis.Redis(port=self.port, socket_timeout=1)
        try:
            return bool(await probe.ping())
        except (aioredis.ConnectionError, aioredis.TimeoutError, aioredis.ResponseError):
            return False  # not listening yet, or still loading its data
        finally:
            await probe.aclose()

    async def kill(self) -> None:
        """SIGKILL to this server's own pid, and its exit awaited."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)
            await self.process.wait()


@pytest.fixture
async def private_redis(tmp_path: Path) -> AsyncIterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is needed for a private Redis")
    data_dir = tmp_path / "redis"
    data_dir.mkdir()
    server = PrivateRedis(free_port(), data_dir)
    try:
        await server.start()
        yield server
    finally:
        await server.kill()


async def run_id(redis: aioredis.Redis) -> str:
    return str((await redis.info("server"))["run_id"])


async def test_redis_restarted_mid_batch_every_line_ends_once(
    spawn: Spawn,
    make_settings: Callable[..., Settings],
    private_redis: PrivateRedis,
    names: dict[str, str],
    tmp_path: Path,
) -> None:
    """The Redis of the batch, of its lines' streams and of the worker is killed -9 while
    lines are mid-stream and a client waits for the batch, then started again on the
    same data: the worker keeps its jobs in hand until Redis is back, the client's wait
    polls on, and every line ends once. The fault is proven: lines were mid-stream at
    the kill, the worker reported itself unready, the waiting client lost its connection,
    and Redis's run_id changed (a new server process, the same data)."""
    prefix = names["stream_prefix"]
    source, lines = batch_file(tmp_path / "in.jsonl", 16, 150, "redis")
    redis = aioredis.Redis(port=private_redis.port, decode_responses=True)
    try:
        worker = await spawn(
            WORKER_REDIS_URL=private_redis.url, WORKER_ECHO_STEP_MS="10", WORKER_MAX_BATCH="8"
        )
        async with Client(make_settings(redis_url=private_redis.url)) as client:
            batch_id = await client.submit_batch(source)
            before = await run_id(redis)
            # waiting from the start (its first poll needs Redis), across the restart
            waiting = asyncio.create_task(finish(client, batch_id, tmp_path))

            async def running() -> int:
                states = await line_states(redis, prefix, batch_id, len(lines))
                return sum(s.mid_stream for s in states)

            await wait_until(lambda: _at_least(running(), 4))
            mid_stream = await running()
            await private_redis.kill()
            await wait_until(lambda: http_is(worker.http_port, "/readyz", 503))
            # down until the waiting client has met it too (it polls every 50 ms; a
            # shorter outage could fall between two polls on a busy machine)
            await wait_until(lambda: _true(client.reconnects > 0))
            await private_redis.start()
            after = await run_id(redis)
            final, output, errors = await waiting
            reconnects = client.reconnects
        assert_each_line_once(lines, final, output, errors)
        await assert_streams_whole(redis, prefix, batch_id, lines)
    finally:
        await redis.aclose()
    assert after != before, "a new Redis server process"
    assert mid_stream >= 4, "lines were mid-stream when Redis went"
    assert reconnects > 0, "the waiting client lost Redis and polled on"
    assert worker.process.returncode is None
    await wait_until(lambda: http_is(worker.http_port, "/readyz", 200))


async def test_a_wait_for_a_batch_gives_up_on_redis_gone_for_good(
    make_settings: Callable[..., Settings],
    private_redis: PrivateRedis,
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: dict[str, str],
    tmp_path: Path,
) -> None:
    """The other side of polling on: Redis gone for longer than `reconnect_timeout_s`
    ends the wait with `ServiceUnavailable` (no worker runs the batch: it stays
    in progress)."""
    await amqp_channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "quorum"}
    )
    # a line refused at submit counts as ended: the first poll reports it
    source = tmp_path / "in.jsonl"
    refused = {**completion_line("refused", "x", 5), "url": "/v1/chat/completions"}
    source.write_text(
        json.dumps(completion_line("queued", "x", 5)) + "\n" + json.dumps(refused) + "\n"
    )
    polled = asyncio.Event()
    client = Client(make_settings(redis_url=private_redis.url), reconnect_timeout_s=0.3)
    async with client:
        batch_id = await client.submit_batch(source)
        waiting = asyncio.create_task(
            client.wait_batch(batch_id, poll_s=0.05, progress=lambda _: polled.set())
        )
        await asyncio.wait_for(polled.wait(), 10)
        await private_redis.kill()
        with pytest.raises(ServiceUnavailable, match=f"waiting for batch {batch_id}"):
            await asyncio.wait_for(waiting, 10)
    assert client.reconnects > 0
