"""One worker process through one workload: start it, publish the jobs, read every
stream as a subscriber does, measure the worker (CPU, memory, its own histograms) and
clean up after it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import aio_pika
import redis.asyncio as aioredis
from aio_pika.abc import AbstractChannel, AbstractConnection
from redis.asyncio.cluster import RedisCluster
from tqdm import tqdm

from bench import settings
from bench.procfs import children_cpu_s, peak_rss_mib, proc_stat, thread_cpu_s
from bench.readers import PerKeyReader, Reader, Reply, multi_key_reader
from bench.services import free_port, worker_package
from bench.settings import AMQP_URL, REDIS_URL

ENGINE_THREAD = "engine-looper"


@dataclass(frozen=True)
class Workload:
    """What one worker is put through; its name names its result files and log."""

    name: str
    streams: int  # jobs in all
    tokens: int  # max_new_tokens of each
    step_ms: float
    batch: int
    concurrency: int  # jobs published before waiting (the rest follow as jobs end)
    description: str
    tokens_per_step: int = 1  # the echo engine's, as with speculative decoding or MTP
    source: Path | None = None  # the worker's code: a baseline checkout, else this one
    prefill: bool = False  # every job queued before the worker starts (a backlog to drain)
    env: tuple[tuple[str, str], ...] = ()  # more of the worker's environment


@dataclass
class Result:
    scenario: str
    description: str
    jobs: int
    tokens: int
    seconds: float
    tokens_per_s: float
    jobs_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    emit_ms_p50: float | None
    emit_ms_p99: float | None
    cpu_s_per_1000_tokens: float
    engine_thread_cpu_s_per_1000_tokens: float
    """Of that, the engine thread's (the echo engine standing in for the GPU, and the
    loop that hands its outputs over)."""
    children_cpu_s_per_1000_tokens: float
    """Of the worker's child processes (the trace exporter), not in the figure above."""
    rss_peak_mib: float
    rss_start_mib: float
    rss_warm_mib: float
    rss_end_mib: float
    rss_growth_pct: float
    redis_xadd_per_s: float
    ratio: float
    machine: str = field(default_factory=lambda: f"{os.cpu_count()} cores")
    ttft_ms: list[float] = field(default_factory=list, repr=False)
    tokens_over_time: list[tuple[float, int]] = field(default_factory=list, repr=False)


def start_worker(
    workload: Workload, queue: str, prefix: str, port: int, redis_url: str = REDIS_URL
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        WORKER_AMQP_URL=AMQP_URL,
        WORKER_REDIS_URL=redis_url,
        WORKER_QUEUE=queue,
        WORKER_STREAM_PREFIX=prefix,
        WORKER_HTTP_PORT=str(port),
        WORKER_HTTP_HOST="127.0.0.1",
        WORKER_ECHO_STEP_MS=str(workload.step_ms),
        WORKER_ECHO_TOKENS_PER_STEP=str(workload.tokens_per_step),
        WORKER_MAX_BATCH=str(workload.batch),
        WORKER_MAX_NEW_TOKENS=str(max(workload.tokens, 16)),
        WORKER_DEFAULT_MAX_NEW_TOKENS=str(max(workload.tokens, 16)),
        WORKER_LOG_LEVEL="WARNING",
        WORKER_STREAM_TTL_S="600",
    )
    env.update(workload.env)
    cwd, package = None, "trtllm_worker"
    if workload.source is not None:  # the checkout's package, not the installed one
        env["PYTHONPATH"] = str(workload.source)
        cwd, package = workload.source, worker_package(workload.source)
    log = open(settings.RESULTS / f"{workload.name}.worker.log", "wb")  # noqa: SIM115 (lives with the process)
    return subprocess.Popen([sys.executable, "-m", package, "serve"], env=env, stderr=log, cwd=cwd)


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()


def start_profiler(workload: Workload, pid: int) -> subprocess.Popen[bytes] | None:
    """With BENCH_PROFILE set: py-spy's collapsed stacks of the worker, for hot spots
    (BENCH_PROFILE=gil: only the thread holding the GIL, which is where Python spends
    CPU; threads waiting on a lock or a socket are left out)."""
    mode = os.environ.get("BENCH_PROFILE")
    if not mode:
        return None
    profile = settings.RESULTS / f"{workload.name}.profile.txt"
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--format", "raw", "-o", str(profile),
         "-r", "1000", "--nonblocking", *(["--gil"] if mode == "gil" else [])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


async def http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    raw = (await reader.read()).decode()
    writer.close()
    head, _, body = raw.partition("\r\n\r\n")
    return int(head.split()[1]), body


async def wait_ready(port: int, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if (await http_get(port, "/readyz"))[0] == 200:
                return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("the worker did not become ready")


def histogram_quantiles(metrics: str, name: str) -> tuple[float | None, float | None]:
    """p50 and p99 (ms) of a Prometheus histogram, interpolated within buckets."""
    buckets = [
        (float("inf") if le == "+Inf" else float(le), float(count))
        for le, count in re.findall(rf'{name}_bucket{{le="([^"]+)"}} ([\d.e+]+)', metrics)
    ]
    if not buckets or buckets[-1][1] == 0:
        return None, None
    total = buckets[-1][1]

    def quantile(q: float) -> float:
        rank, previous_le, previous_count = q * total, 0.0, 0.0
        for le, count in buckets:
            if count >= rank:
                if le == float("inf"):
                    return previous_le * 1000
                span = count - previous_count
                fraction = (rank - previous_count) / span if span else 1.0
                return (previous_le + (le - previous_le) * fraction) * 1000
            previous_le, previous_count = le, count
        return previous_le * 1000

    return quantile(0.5), quantile(0.99)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


class _Usage(NamedTuple):
    """What the worker had used up to a moment: CPU seconds of the process, of its child
    processes and of its engine thread, and its RSS in MiB."""

    cpu: float
    rss: float
    children: float
    engine: float

    @classmethod
    def of(cls, pid: int) -> _Usage:
        cpu, rss = proc_stat(pid)
        return cls(cpu, rss, children_cpu_s(pid), thread_cpu_s(pid, ENGINE_THREAD))


class _Traffic:
    """The jobs of one run: publishing them (with publisher confirms) and tallying what
    the subscriber reads of their streams."""

    def __init__(self, workload: Workload, channel: AbstractChannel, queue: str, run_id: str):
        self.workload, self.channel, self.queue = workload, channel, queue
        self.prefix = f"bench:{run_id}:"
        self.ids = [f"{run_id}-{n}" for n in range(workload.streams)]
        self.pending = list(reversed(self.ids))
        self.published: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.open_keys: dict[str, str] = {}  # stream -> the last entry read
        self.tokens_seen = 0
        self.timeline: list[tuple[float, int]] = []
        self.started = 0.0

    def _message(self, request_id: str) -> aio_pika.Message:
        body = {
            "request_id": request_id,
            "inputs": "bench ",
            "parameters": {"max_new_tokens": self.workload.tokens},
        }
        return aio_pika.Message(
            json.dumps(body).encode(),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            content_type="application/json",
        )

    async def publish(self, count: int) -> None:
        batch = [self.pending.pop() for _ in range(min(count, len(self.pending)))]
        for request_id in batch:
            self.published[request_id] = time.monotonic()
            self.open_keys[self.prefix + request_id] = "0"
        exchange = self.channel.default_exchange
        await asyncio.gather(
            *(exchange.publish(self._message(r), routing_key=self.queue) for r in batch)
        )

    def take(self, reply: Reply, now: float) -> int:
        """Tallies one read; returns how many jobs it saw end."""
        finished = 0
        for key, items in reply:
            request_id = key[len(self.prefix) :]
            for entry_id, fields in items:
                event = fields["event"]
                if event == "token":
                    self.tokens_seen += 1
                    self.first_token.setdefault(request_id, now)
                elif event in ("done", "error"):
                    finished += 1
                    del self.open_keys[key]
                    break
                self.open_keys[key] = entry_id
        if not self.timeline or now - self.started - self.timeline[-1][0] >= 0.02:
            self.timeline.append((now - self.started, self.tokens_seen))
        return finished

    def ttft_ms(self) -> list[float]:
        return [
            (self.first_token[r] - self.published[r]) * 1000
            for r in self.ids
            if r in self.first_token
        ]


async def run_workload(
    workload: Workload, ceiling: float, redis_url: str = REDIS_URL, per_key: bool = False
) -> Result:
    """One worker through `workload`; `per_key`: the subscriber reads one stream per XREAD
    (as it must on a cluster); a `redis_url` of a cluster node: the worker and the
    subscriber on that Redis Cluster."""
    run_id = uuid.uuid4().hex[:8]
    queue, port = f"bench-{run_id}", free_port()
    cluster = redis_url != REDIS_URL
    redis: aioredis.Redis | RedisCluster = (
        RedisCluster.from_url(redis_url, decode_responses=True)
        if cluster
        else aioredis.Redis.from_url(redis_url, decode_responses=True)
    )
    per_key_reader = PerKeyReader(redis)
    read = per_key_reader if per_key or isinstance(redis, RedisCluster) else multi_key_reader(redis)
    if isinstance(redis, RedisCluster):
        await redis.initialize()  # the slot map, before the first read asks for a node
    connection = await aio_pika.connect(AMQP_URL)
    worker: subprocess.Popen[bytes] | None = None
    try:
        channel = await connection.channel(publisher_confirms=True)
        traffic = _Traffic(workload, channel, queue, run_id)
        if workload.prefill:  # a backlog the worker drains: the publisher's cost is not in it
            await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
            await traffic.publish(workload.concurrency)
        worker = start_worker(workload, queue, traffic.prefix, port, redis_url)
        await wait_ready(port)
        return await _measure(traffic, worker, port, read, ceiling)
    finally:
        if worker is not None:
            stop_worker(worker)
        if isinstance(redis, aioredis.Redis):  # a cluster goes with its keys
            await _delete_streams(redis, f"bench:{run_id}:")
        await delete_queue(connection, queue)
        await connection.close()
        await per_key_reader.aclose()
        await redis.aclose()


async def _measure(
    traffic: _Traffic, worker: subprocess.Popen[bytes], port: int, read: Reader, ceiling: float
) -> Result:
    """Publishes and reads the whole workload against a ready worker."""
    workload = traffic.workload
    profiler = start_profiler(workload, worker.pid)
    before = _Usage.of(worker.pid)
    progress = tqdm(total=workload.streams, desc=workload.name, unit="job", leave=False)
    traffic.started = time.monotonic()
    if not workload.prefill:
        await traffic.publish(workload.concurrency)
    done = 0
    warm_at = max(workload.streams // 10, 1)  # growth is measured after a warm-up
    rss_warm = before.rss
    while done < workload.streams:
        reply = await read(dict(list(traffic.open_keys.items())[:2000]))
        finished = traffic.take(reply, time.monotonic())
        if finished:
            if done < warm_at <= done + finished:
                rss_warm = proc_stat(worker.pid)[1]
            done += finished
            progress.update(finished)
            if traffic.pending:
                await traffic.publish(finished)
    seconds = time.monotonic() - traffic.started
    progress.close()
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)
        profiler.wait(60)
    after = _Usage.of(worker.pid)
    rss_peak = peak_rss_mib(worker.pid)
    _, metrics = await http_get(port, "/metrics")
    emit = histogram_quantiles(metrics, "worker_token_emit_delay_seconds")
    return _result(traffic, seconds, before, after, (rss_warm, rss_peak), emit, ceiling)


def _result(
    traffic: _Traffic,
    seconds: float,
    before: _Usage,
    after: _Usage,
    rss_warm_peak: tuple[float, float],
    emit: tuple[float | None, float | None],
    ceiling: float,
) -> Result:
    workload, tokens = traffic.workload, traffic.tokens_seen
    rss_warm, rss_peak = rss_warm_peak
    emit_p50, emit_p99 = emit
    ttft = traffic.ttft_ms()
    rate = tokens / seconds

    def per_1000_tokens(cpu_s: float) -> float:
        return round(cpu_s / max(tokens, 1) * 1000, 4)

    return Result(
        scenario=workload.name,
        description=workload.description,
        jobs=workload.streams,
        tokens=tokens,
        seconds=round(seconds, 3),
        tokens_per_s=round(rate, 1),
        jobs_per_s=round(workload.streams / seconds, 1),
        ttft_ms_p50=round(percentile(ttft, 0.5), 3),
        ttft_ms_p99=round(percentile(ttft, 0.99), 3),
        emit_ms_p50=None if emit_p50 is None else round(emit_p50, 3),
        emit_ms_p99=None if emit_p99 is None else round(emit_p99, 3),
        cpu_s_per_1000_tokens=per_1000_tokens(after.cpu - before.cpu),
        engine_thread_cpu_s_per_1000_tokens=per_1000_tokens(after.engine - before.engine),
        children_cpu_s_per_1000_tokens=per_1000_tokens(after.children - before.children),
        rss_peak_mib=round(rss_peak, 1),
        rss_start_mib=round(before.rss, 1),
        rss_end_mib=round(after.rss, 1),
        rss_warm_mib=round(rss_warm, 1),
        rss_growth_pct=round((after.rss - rss_warm) / rss_warm * 100, 2),
        redis_xadd_per_s=round(ceiling, 1),
        ratio=round(rate / ceiling, 4),
        ttft_ms=ttft,
        tokens_over_time=traffic.timeline,
    )


async def _delete_streams(redis: aioredis.Redis, prefix: str) -> None:
    keys = [k async for k in redis.scan_iter(match=prefix + "*", count=10_000)]
    for start in range(0, len(keys), 10_000):
        await redis.delete(*keys[start : start + 10_000])


async def delete_queue(connection: AbstractConnection, queue: str) -> None:
    """The queue a worker consumed, its dead-letter queue and its cancel exchange."""
    channel = await connection.channel()
    for name in (queue, f"{queue}.dead"):
        await channel.queue_delete(name)
    await channel.exchange_delete(f"{queue}.cancel")


async def idle_cpu(seconds: float = 10.0) -> dict[str, float]:
    """CPU of an idle worker over `seconds`: its engine loop thread and the whole process,
    in % of a core."""
    workload = Workload("idle", 0, 1, 0, 64, 0, f"no jobs for {seconds:.0f} s")
    run_id = uuid.uuid4().hex[:8]
    queue, port = f"bench-{run_id}", free_port()
    worker = start_worker(workload, queue, f"bench:{run_id}:", port)
    try:
        await wait_ready(port)
        await asyncio.sleep(1)  # let start-up settle
        looper_before, (process_before, _) = (
            thread_cpu_s(worker.pid, ENGINE_THREAD),
            proc_stat(worker.pid),
        )
        await asyncio.sleep(seconds)
        looper_after, (process_after, _) = (
            thread_cpu_s(worker.pid, ENGINE_THREAD),
            proc_stat(worker.pid),
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
        connection = await aio_pika.connect(AMQP_URL)
        await delete_queue(connection, queue)
        await connection.close()
    return {
        "looper_cpu_pct": round((looper_after - looper_before) / seconds * 100, 3),
        "process_cpu_pct": round((process_after - process_before) / seconds * 100, 3),
    }
