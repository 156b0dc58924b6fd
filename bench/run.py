"""trtllm-worker benchmark: real worker processes (echo engine standing in for a GPU),
jobs published through RabbitMQ with publisher confirms, every stream read with XREAD as
a subscriber does. `make bench` runs every scenario; `python bench/run.py --help`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from tqdm import tqdm

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).parent.parent
BASELINE_REF = os.environ.get("BENCH_BASELINE", "1866419fe8a5afeeada680f2e8f92af0f857b52b")
"""The code CPU per token is compared with: the worker before issue 15's per-token work
(any git ref of this repository; BENCH_BASELINE overrides it)."""
AMQP_URL = os.environ.get("WORKER_TEST_AMQP_URL", "amqp://guest:guest@localhost:5672/")
REDIS_URL = os.environ.get("WORKER_TEST_REDIS_URL", "redis://localhost:6379/0")


@dataclass(frozen=True)
class Scenario:
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


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("throughput", 256, 256, 0, 256, 256, "256 streams x 256 tokens, 0 ms step"),
        Scenario("latency", 200, 16, 0, 1, 1, "one stream at a time, 0 ms step"),
        Scenario("realistic", 64, 512, 20, 64, 64, "64 streams x 512 tokens, 20 ms step"),
        Scenario(
            "short", 5000, 1, 0, 256, 5000, "a backlog of 5,000 jobs of 1 token", prefill=True
        ),
        Scenario("soak", 100_000, 1, 0, 256, 2000, "100,000 jobs of 1 token: RSS growth"),
        Scenario(
            "multitoken",
            256,
            1024,
            0,
            256,
            256,
            "256 streams x 256 steps of 4 tokens vs. 256 steps of 1 token, same run",
            tokens_per_step=4,
        ),
        Scenario(
            "baseline",
            256,
            1024,
            0,
            256,
            256,
            f"256 streams x 1,024 tokens and 5,000 jobs of 1 token, this code vs."
            f" {BASELINE_REF[:12]}, same run",
        ),
        Scenario(
            "tracing",
            256,
            256,
            0,
            256,
            256,
            "256 streams x 1,024 tokens and 5,000 jobs of 1 token, traced over OTLP vs. not,"
            " same run",
        ),
        Scenario(
            "cluster",
            256,
            1024,
            0,
            256,
            256,
            "throughput on a local 3-master Redis Cluster vs. the single node, same run",
        ),
    )
}


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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def proc_stat(pid: int) -> tuple[float, float]:
    """(cpu seconds, rss MiB) of a process."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return cpu, rss / 1024


def children_cpu_s(pid: int) -> float:
    """CPU seconds of the process's child processes now running (the trace exporter)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            children = [int(each) for each in listing.read().split()]
    except OSError:
        return 0.0
    total = 0.0
    for child in children:
        with contextlib.suppress(OSError):
            total += proc_stat(child)[0]
    return total


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def redis_xadd_ceiling(requests: int = 300_000) -> float:
    """Redis' own pipelined XADD rate for entries shaped like ours (redis-benchmark)."""
    key = f"bench:ceiling:{uuid.uuid4().hex}"
    out = subprocess.run(
        [
            "redis-benchmark",
            "-q",
            "-n",
            str(requests),
            "-P",
            "64",
            "XADD",
            key,
            "*",
            "event",
            "token",
            "index",
            "1",
            "token_id",
            "97",
            "text",
            "a",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    subprocess.run(["redis-cli", "del", key], capture_output=True, check=False)
    rates = re.findall(r"([\d.]+) requests per second", out)
    return float(rates[-1])


def start_worker(
    scenario: Scenario, queue: str, prefix: str, port: int, redis_url: str = REDIS_URL
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        WORKER_AMQP_URL=AMQP_URL,
        WORKER_REDIS_URL=redis_url,
        WORKER_QUEUE=queue,
        WORKER_STREAM_PREFIX=prefix,
        WORKER_HTTP_PORT=str(port),
        WORKER_HTTP_HOST="127.0.0.1",
        WORKER_ECHO_STEP_MS=str(scenario.step_ms),
        WORKER_ECHO_TOKENS_PER_STEP=str(scenario.tokens_per_step),
        WORKER_MAX_BATCH=str(scenario.batch),
        WORKER_MAX_NEW_TOKENS=str(max(scenario.tokens, 16)),
        WORKER_DEFAULT_MAX_NEW_TOKENS=str(max(scenario.tokens, 16)),
        WORKER_LOG_LEVEL="WARNING",
        WORKER_STREAM_TTL_S="600",
    )
    env.update(scenario.env)
    cwd = None
    if scenario.source is not None:  # its `worker` package before the installed one
        env["PYTHONPATH"] = str(scenario.source)
        cwd = scenario.source
    log = open(RESULTS / f"{scenario.name}.worker.log", "wb")  # noqa: SIM115 (lives with the process)
    return subprocess.Popen(
        [sys.executable, "-m", "trtllm_worker", "serve"], env=env, stderr=log, cwd=cwd
    )


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """The `worker` package as it was at `ref`, in a temporary folder (git archive: the
    working tree is not touched)."""
    root = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", ref, "worker"],
            capture_output=True,
            check=False,
        )
        if archive.returncode != 0:
            raise SystemExit(
                f"baseline {ref!r} cannot be checked out: {archive.stderr.decode().strip()}"
                " (set BENCH_BASELINE to a ref of this repository)"
            )
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(root, filter="data")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def start_profiler(scenario: Scenario, pid: int) -> subprocess.Popen[bytes] | None:
    """With BENCH_PROFILE set: py-spy's collapsed stacks of the worker, for hot spots
    (BENCH_PROFILE=gil: only the thread holding the GIL, which is where Python spends
    CPU; threads waiting on a lock or a socket are left out)."""
    mode = os.environ.get("BENCH_PROFILE")
    if not mode:
        return None
    profile = RESULTS / f"{scenario.name}.profile.txt"
    return subprocess.Popen(
        [
            "py-spy",
            "record",
            "--pid",
            str(pid),
            "--format",
            "raw",
            "-o",
            str(profile),
            "-r",
            "1000",
            "--nonblocking",
            *(["--gil"] if mode == "gil" else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


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


Reply = list[tuple[str, list[tuple[str, dict[str, str]]]]]
Reader = Callable[[dict[str, str]], Awaitable[Reply]]


def multi_key_reader(redis: aioredis.Redis) -> Reader:
    """One XREAD for every open stream, as a subscriber of a single node can."""

    async def read(streams: dict[str, str]) -> Reply:
        return await redis.xread(streams, block=1000, count=5000)  # type: ignore[arg-type,no-any-return]

    return read


class PerKeyReader:
    """One XREAD per stream, pipelined; on a cluster (where a multi-key XREAD would span
    slots) one plain pipeline per node, so that reading costs the bench's subscriber,
    which shares the worker's cores, the same per stream on both (redis-py's cluster
    pipeline costs several times more). After a round that found nothing, one blocking
    XREAD on the oldest open stream waits for the worker instead of polling."""

    def __init__(self, redis: aioredis.Redis | RedisCluster) -> None:
        self.redis = redis
        self.nodes: dict[str, aioredis.Redis] = {}

    def _client(self, key: str) -> aioredis.Redis:
        if isinstance(self.redis, aioredis.Redis):
            return self.redis
        node = self.redis.get_node_from_key(key)
        if node.name not in self.nodes:
            self.nodes[node.name] = aioredis.Redis(
                host=node.host, port=int(node.port), decode_responses=True
            )
        return self.nodes[node.name]

    async def __call__(self, streams: dict[str, str]) -> Reply:
        pipes: dict[int, Any] = {}
        for key, last in streams.items():
            client = self._client(key)
            pipe = pipes.setdefault(id(client), client.pipeline(transaction=False))
            pipe.xread({key: last}, count=5000)
        results = await asyncio.gather(*(pipe.execute() for pipe in pipes.values()))
        reply = [item for replies in results for result in replies for item in result or []]
        if reply or not streams:
            return reply
        key, last = next(iter(streams.items()))
        return await self._client(key).xread({key: last}, block=1000, count=5000)  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        for client in self.nodes.values():
            await client.aclose()


def redis_cli(port: int, *args: str) -> str:
    return subprocess.run(
        ["redis-cli", "-p", str(port), *args], capture_output=True, text=True
    ).stdout


@contextlib.contextmanager
def local_redis_cluster(masters: int = 3) -> Iterator[str]:
    """A Redis Cluster of `masters` nodes on private ports (no replicas), from the
    installed redis-server, stopped by its own ports at the end; yields a node's URL."""
    root = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    ports: list[int] = []
    while len(ports) < masters:
        port = free_port()
        if port < 55000 and port not in ports and bindable(port + 10000):  # the bus port
            ports.append(port)
    try:
        for port in ports:
            subprocess.run(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes", "--cluster-config-file", f"{root}/{port}.conf",
                 "--dir", str(root), "--save", "", "--appendonly", "no", "--daemonize", "yes",
                 "--logfile", f"{root}/{port}.log"],
                check=True,
            )  # fmt: skip
        for port in ports:
            while redis_cli(port, "ping").strip() != "PONG":
                time.sleep(0.05)
        nodes = [f"127.0.0.1:{p}" for p in ports]
        subprocess.run(["redis-cli", "--cluster", "create", *nodes, "--cluster-yes"],
                       check=True, capture_output=True)  # fmt: skip
        for port in ports:
            while "cluster_state:ok" not in redis_cli(port, "cluster", "info"):
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for port in ports:
            redis_cli(port, "shutdown", "nosave")
        shutil.rmtree(root, ignore_errors=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def run_scenario(  # noqa: C901
    scenario: Scenario, ceiling: float, redis_url: str = REDIS_URL, per_key: bool = False
) -> Result:
    """One worker through `scenario`; `per_key`: the subscriber reads one stream per XREAD
    (as it must on a cluster); a `redis_url` of a cluster node: the worker and the
    subscriber on that Redis Cluster."""
    run_id = uuid.uuid4().hex[:8]
    queue, prefix, port = f"bench-{run_id}", f"bench:{run_id}:", free_port()
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
        ids = [f"{run_id}-{n}" for n in range(scenario.streams)]
        published: dict[str, float] = {}
        first_token: dict[str, float] = {}
        open_keys: dict[str, str] = {}
        tokens_seen = 0
        timeline: list[tuple[float, int]] = []
        pending = list(reversed(ids))

        async def publish(count: int) -> None:
            batch = [pending.pop() for _ in range(min(count, len(pending)))]
            for request_id in batch:
                published[request_id] = time.monotonic()
                open_keys[prefix + request_id] = "0"
            await asyncio.gather(
                *(
                    channel.default_exchange.publish(
                        aio_pika.Message(
                            json.dumps(
                                {
                                    "request_id": r,
                                    "inputs": "bench ",
                                    "parameters": {"max_new_tokens": scenario.tokens},
                                }
                            ).encode(),
                            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                            content_type="application/json",
                        ),
                        routing_key=queue,
                    )
                    for r in batch
                )
            )

        if scenario.prefill:  # a backlog the worker drains: the publisher's cost is not in it
            await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
            await publish(scenario.concurrency)
        worker = start_worker(scenario, queue, prefix, port, redis_url)
        await wait_ready(port)
        profiler = start_profiler(scenario, worker.pid)
        cpu_start, rss_start = proc_stat(worker.pid)
        children_cpu_start = children_cpu_s(worker.pid)
        engine_cpu_start = thread_cpu_s(worker.pid, "engine-looper")
        progress = tqdm(total=scenario.streams, desc=scenario.name, unit="job", leave=False)

        started = time.monotonic()
        if not scenario.prefill:
            await publish(scenario.concurrency)
        done = 0
        warm_at = max(scenario.streams // 10, 1)  # growth is measured after a warm-up
        rss_warm = rss_start
        while done < scenario.streams:
            streams = dict(list(open_keys.items())[:2000])
            reply = await read(streams)
            now = time.monotonic()
            finished = 0
            for key, items in reply:
                request_id = key[len(prefix) :]
                for entry_id, fields in items:
                    event = fields["event"]
                    if event == "token":
                        tokens_seen += 1
                        first_token.setdefault(request_id, now)
                    elif event in ("done", "error"):
                        finished += 1
                        del open_keys[key]
                        break
                    open_keys[key] = entry_id
            if not timeline or now - started - timeline[-1][0] >= 0.02:
                timeline.append((now - started, tokens_seen))
            if finished:
                if done < warm_at <= done + finished:
                    rss_warm = proc_stat(worker.pid)[1]
                done += finished
                progress.update(finished)
                if pending:
                    await publish(finished)
        seconds = time.monotonic() - started
        progress.close()
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(60)
        cpu_end, rss_end = proc_stat(worker.pid)
        children_cpu = children_cpu_s(worker.pid) - children_cpu_start
        engine_cpu = thread_cpu_s(worker.pid, "engine-looper") - engine_cpu_start
        rss_peak = peak_rss_mib(worker.pid)
        _, metrics = await http_get(port, "/metrics")
        emit_p50, emit_p99 = histogram_quantiles(metrics, "worker_token_emit_delay_seconds")
        ttft = [(first_token[r] - published[r]) * 1000 for r in ids if r in first_token]
        rate = tokens_seen / seconds
        return Result(
            scenario=scenario.name,
            description=scenario.description,
            jobs=scenario.streams,
            tokens=tokens_seen,
            seconds=round(seconds, 3),
            tokens_per_s=round(rate, 1),
            jobs_per_s=round(scenario.streams / seconds, 1),
            ttft_ms_p50=round(percentile(ttft, 0.5), 3),
            ttft_ms_p99=round(percentile(ttft, 0.99), 3),
            emit_ms_p50=None if emit_p50 is None else round(emit_p50, 3),
            emit_ms_p99=None if emit_p99 is None else round(emit_p99, 3),
            cpu_s_per_1000_tokens=round((cpu_end - cpu_start) / max(tokens_seen, 1) * 1000, 4),
            engine_thread_cpu_s_per_1000_tokens=round(engine_cpu / max(tokens_seen, 1) * 1000, 4),
            children_cpu_s_per_1000_tokens=round(children_cpu / max(tokens_seen, 1) * 1000, 4),
            rss_peak_mib=round(rss_peak, 1),
            rss_start_mib=round(rss_start, 1),
            rss_end_mib=round(rss_end, 1),
            rss_warm_mib=round(rss_warm, 1),
            rss_growth_pct=round((rss_end - rss_warm) / rss_warm * 100, 2),
            redis_xadd_per_s=round(ceiling, 1),
            ratio=round(rate / ceiling, 4),
            ttft_ms=ttft,
            tokens_over_time=timeline,
        )
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
        if isinstance(redis, aioredis.Redis):  # a cluster goes with its keys
            keys = [k async for k in redis.scan_iter(match=prefix + "*", count=10_000)]
            for start in range(0, len(keys), 10_000):
                await redis.delete(*keys[start : start + 10_000])
        channel2 = await connection.channel()
        for name in (queue, f"{queue}.dead"):
            await channel2.queue_delete(name)
        await channel2.exchange_delete(f"{queue}.cancel")
        await connection.close()
        await per_key_reader.aclose()
        await redis.aclose()


def thread_cpu_s(pid: int, name: str) -> float:
    """CPU seconds of the process's thread called `name`."""
    ticks = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        if (task / "comm").read_text().strip() == name[:15]:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / ticks
    raise RuntimeError(f"no thread {name!r}")


async def measure_idle(seconds: float = 10.0) -> dict[str, Any]:
    """CPU of an idle worker: its engine loop thread and the whole process."""
    scenario = Scenario("idle", 0, 1, 0, 64, 0, f"no jobs for {seconds:.0f} s")
    run_id = uuid.uuid4().hex[:8]
    queue, port = f"bench-{run_id}", free_port()
    worker = start_worker(scenario, queue, f"bench:{run_id}:", port)
    try:
        await wait_ready(port)
        await asyncio.sleep(1)  # let start-up settle
        looper_before, (process_before, _) = (
            thread_cpu_s(worker.pid, "engine-looper"),
            proc_stat(worker.pid),
        )
        await asyncio.sleep(seconds)
        looper_after, (process_after, _) = (
            thread_cpu_s(worker.pid, "engine-looper"),
            proc_stat(worker.pid),
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
        connection = await aio_pika.connect(AMQP_URL)
        channel = await connection.channel()
        for name in (queue, f"{queue}.dead"):
            await channel.queue_delete(name)
        await channel.exchange_delete(f"{queue}.cancel")
        await connection.close()
    return {
        "scenario": "idle",
        "seconds": seconds,
        "looper_cpu_pct": round((looper_after - looper_before) / seconds * 100, 3),
        "process_cpu_pct": round((process_after - process_before) / seconds * 100, 3),
    }


def plot(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (cdf, rate) = plt.subplots(1, 2, figsize=(11, 4))
    ordered = sorted(result.ttft_ms)
    cdf.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))])
    cdf.set_xscale("log")
    cdf.set_xlabel("publish → first token entry (ms)")
    cdf.set_ylabel("fraction of jobs")
    cdf.set_title(f"{result.scenario}: time to first token (CDF)")
    cdf.grid(True, which="both", alpha=0.3)
    times = [t for t, _ in result.tokens_over_time]
    counts = [c for _, c in result.tokens_over_time]
    rate.plot(times, counts)
    rate.set_xlabel("seconds")
    rate.set_ylabel("token entries read")
    rate.set_title(f"{result.tokens_per_s:,.0f} tokens/s, {result.jobs_per_s:,.0f} jobs/s")
    rate.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def summary(result: Result) -> dict[str, Any]:
    return {k: v for k, v in asdict(result).items() if k not in ("ttft_ms", "tokens_over_time")}


def compare_cluster(scenario: Scenario, ceiling: float) -> None:
    """The throughput scenario on the single Redis node and on a local 3-master Redis
    Cluster whose nodes share this machine's cores, in the order single, cluster,
    cluster, single (a drift of the machine's speed over the run cancels out); the
    subscriber reads one stream per XREAD every time, as a cluster requires."""
    single, clustered = [], []
    with local_redis_cluster() as url:
        for where in ("single", "cluster", "cluster", "single"):
            if where == "single":
                named = dataclasses.replace(scenario, name="cluster-single")
                single.append(asyncio.run(run_scenario(named, ceiling, per_key=True)))
            else:
                clustered.append(asyncio.run(run_scenario(scenario, ceiling, redis_url=url)))

    def mean(results: list[Result], figure: str) -> float:
        return round(sum(float(getattr(r, figure)) for r in results) / len(results), 4)

    figures = ("tokens_per_s", "cpu_s_per_1000_tokens", "ttft_ms_p50", "ttft_ms_p99")
    data = {
        "scenario": scenario.name,
        "description": scenario.description,
        "single_node": {f: mean(single, f) for f in figures},
        "cluster": {f: mean(clustered, f) for f in figures},
        "runs": {
            "single_node": [summary(r) for r in single],
            "cluster": [summary(r) for r in clustered],
        },
        "redis_xadd_per_s": round(ceiling, 1),
    }
    ratio = data["cluster"]["tokens_per_s"] / data["single_node"]["tokens_per_s"]
    data["cluster_vs_single"] = round(ratio, 3)
    (RESULTS / "cluster.json").write_text(json.dumps(data, indent=2) + "\n")
    print(
        f"{scenario.name:>10}: {data['cluster']['tokens_per_s']:>10,.0f} tokens/s on 3 masters"
        f" vs {data['single_node']['tokens_per_s']:,.0f} on one node ({ratio:.2f} x); CPU"
        f" {data['cluster']['cpu_s_per_1000_tokens']:.4f} vs"
        f" {data['single_node']['cpu_s_per_1000_tokens']:.4f} s/1k tokens (2 runs each)"
    )


SWEEP_STREAMS = (1, 16, 64, 256, 1024)
SWEEP_LENGTHS = (16, 64, 256, 1024, 4096, 16384)
SWEEPS = {
    "streams": "concurrent streams (256 tokens each, at least 64 jobs)",
    "length": "output length (64 concurrent streams)",
}


def sweep_points(name: str) -> list[tuple[int, Scenario]]:
    """The scenarios of a sweep, each with its x value."""
    if name == "streams":
        return [
            (n, Scenario(f"streams-{n}", max(n, 64), 256, 0, n, n, f"{n} concurrent streams"))
            for n in SWEEP_STREAMS
        ]
    return [
        (
            length,
            Scenario(
                f"length-{length}",
                max(min(65536 // length, 1024), 64),
                length,
                0,
                64,
                64,
                f"64 concurrent streams x {length} tokens",
            ),
        )
        for length in SWEEP_LENGTHS
    ]


def run_sweep(name: str, ceiling: float) -> None:
    """How cost grows: one worker per point; tokens/s, CPU per token, TTFT and peak RSS
    against the swept quantity, in bench/results/sweep-<name>.json and .png."""
    points = [(x, asyncio.run(run_scenario(s, ceiling))) for x, s in sweep_points(name)]
    figures = ("tokens_per_s", "cpu_s_per_1000_tokens", "ttft_ms_p50", "ttft_ms_p99",
               "rss_peak_mib", "jobs", "tokens")  # fmt: skip
    data = {
        "sweep": name,
        "description": SWEEPS[name],
        "redis_xadd_per_s": round(ceiling, 1),
        "points": [{"x": x, **{f: getattr(r, f) for f in figures}} for x, r in points],
    }
    (RESULTS / f"sweep-{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [x for x, _ in points]
    figure, axes = plt.subplots(1, 4, figsize=(18, 4))
    panels = (
        ("tokens/s", [r.tokens_per_s for _, r in points], None),
        ("CPU ms per 1k tokens", [r.cpu_s_per_1000_tokens * 1000 for _, r in points], None),
        ("TTFT ms (p50, p99)", [r.ttft_ms_p50 for _, r in points],
         [r.ttft_ms_p99 for _, r in points]),
        ("peak RSS MiB", [r.rss_peak_mib for _, r in points], None),
    )  # fmt: skip
    for axis, (label, values, p99) in zip(axes, panels, strict=True):
        axis.plot(xs, values, marker="o", label="p50" if p99 else None)
        if p99:
            axis.plot(xs, p99, marker="o", label="p99")
            axis.set_yscale("log")
            axis.legend()
        axis.set_xscale("log", base=2 if name == "streams" else 4)
        axis.set_xlabel(SWEEPS[name].split(" (")[0])
        axis.set_title(label)
        axis.grid(True, which="both", alpha=0.3)
    figure.suptitle(f"sweep: {SWEEPS[name]}; redis-benchmark XADD {ceiling:,.0f}/s")
    figure.tight_layout()
    figure.savefig(RESULTS / f"sweep-{name}.png", dpi=90)
    plt.close(figure)
    for x, r in points:
        print(
            f"{name:>10} {x:>6}: {r.tokens_per_s:>9,.0f} tokens/s ({r.ratio:.3f} of Redis)"
            f"  CPU {r.cpu_s_per_1000_tokens * 1000:.2f} ms/1k  TTFT p50 {r.ttft_ms_p50:.1f}"
            f" p99 {r.ttft_ms_p99:.1f} ms  RSS {r.rss_peak_mib:.0f} MiB"
        )


TRACING_ROUNDS = int(os.environ.get("BENCH_TRACING_ROUNDS", "3"))


def median_of(runs: list[Result], figures: tuple[str, ...]) -> dict[str, float]:
    return {f: round(statistics.median(float(getattr(r, f)) for r in runs), 4) for f in figures}


def mean_of(runs: list[Result], figures: tuple[str, ...]) -> dict[str, float]:
    return {f: round(sum(float(getattr(r, f)) for r in runs) / len(runs), 4) for f in figures}


def compare_baseline(scenario: Scenario, ceiling: float) -> None:
    """CPU per token and short jobs/s of this code and of `BASELINE_REF`, each run twice
    in the order baseline, this, this, baseline (a drift of the machine's speed over the
    run cancels out)."""
    figures = (
        "tokens_per_s", "jobs_per_s", "cpu_s_per_1000_tokens",
        "engine_thread_cpu_s_per_1000_tokens", "ttft_ms_p50", "ttft_ms_p99",
    )  # fmt: skip
    data: dict[str, Any] = {
        "scenario": scenario.name,
        "description": scenario.description,
        "baseline_ref": BASELINE_REF,
        "redis_xadd_per_s": round(ceiling, 1),
    }
    short = SCENARIOS["short"]
    with checkout(BASELINE_REF) as source:
        for shape in (scenario, short):
            runs: dict[str, list[Result]] = {"baseline": [], "current": []}
            for which in ("baseline", "current", "current", "baseline"):
                named = dataclasses.replace(
                    shape,
                    name=f"{scenario.name}-{shape.name}-{which}",
                    source=source if which == "baseline" else None,
                )
                runs[which].append(asyncio.run(run_scenario(named, ceiling)))
            part = {which: mean_of(results, figures) for which, results in runs.items()}
            part["runs"] = {which: [summary(r) for r in results] for which, results in runs.items()}
            data[shape.name if shape is short else "tokens"] = part
    tokens, jobs = data["tokens"], data["short"]
    cpu = tokens["current"]["cpu_s_per_1000_tokens"] / tokens["baseline"]["cpu_s_per_1000_tokens"]
    data["cpu_per_token_vs_baseline"] = round(cpu, 3)

    def own(which: str) -> float:  # without the engine thread (the GPU's stand-in)
        part = tokens[which]
        return float(part["cpu_s_per_1000_tokens"] - part["engine_thread_cpu_s_per_1000_tokens"])

    own_ratio = own("current") / own("baseline")
    data["cpu_per_token_without_engine_thread_vs_baseline"] = round(own_ratio, 3)
    data["short_jobs_vs_baseline"] = round(
        jobs["current"]["jobs_per_s"] / jobs["baseline"]["jobs_per_s"], 3
    )
    (RESULTS / "baseline.json").write_text(json.dumps(data, indent=2) + "\n")
    print(
        f"{scenario.name:>10}: CPU {tokens['current']['cpu_s_per_1000_tokens'] * 1000:.2f} vs"
        f" {tokens['baseline']['cpu_s_per_1000_tokens'] * 1000:.2f} ms per 1k tokens"
        f" ({cpu:.2f} x of {BASELINE_REF[:12]}; without the engine thread"
        f" {own('current') * 1000:.2f} vs {own('baseline') * 1000:.2f}, {own_ratio:.2f} x);"
        f" {tokens['current']['tokens_per_s']:,.0f} vs"
        f" {tokens['baseline']['tokens_per_s']:,.0f} tokens/s; short"
        f" {jobs['current']['jobs_per_s']:,.0f} vs {jobs['baseline']['jobs_per_s']:,.0f} jobs/s"
    )


@contextlib.contextmanager
def otlp_sink() -> Iterator[int]:
    """bench/otlp_sink.py in a process of its own; yields its port."""
    port = free_port()
    sink = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "otlp_sink.py"), str(port)],
        stdout=subprocess.PIPE,
    )
    try:
        assert sink.stdout is not None
        sink.stdout.readline()  # "listening"
        yield port
    finally:
        sink.terminate()
        sink.wait(10)


def sink_count(port: int) -> dict[str, int]:
    """Spans the sink received since the last count."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET /spans HTTP/1.0\r\nHost: sink\r\n\r\n")
        reply = b"".join(iter(lambda: conn.recv(65536), b""))
    return dict(json.loads(reply.partition(b"\r\n\r\n")[2]))


def compare_tracing(scenario: Scenario, ceiling: float) -> None:
    """Throughput and short jobs with every job traced (OTLP/HTTP to a local sink that
    discards, the SDK's batch processor at its defaults), with one job in ten traced
    (`OTEL_TRACES_SAMPLER=traceidratio`, 0.1) and without, in the order off, on, tenth,
    tenth, on, off; the spans the sink received are counted after each run."""
    figures = (
        "tokens_per_s", "jobs_per_s", "cpu_s_per_1000_tokens",
        "children_cpu_s_per_1000_tokens", "ttft_ms_p50",
    )  # fmt: skip
    data: dict[str, Any] = {
        "scenario": scenario.name,
        "description": scenario.description,
        "redis_xadd_per_s": round(ceiling, 1),
    }
    with otlp_sink() as port:
        endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        env = {
            "off": (),
            "on": (endpoint,),
            "tenth": (
                endpoint,
                ("OTEL_TRACES_SAMPLER", "traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.1"),
            ),
        }
        longer = dataclasses.replace(SCENARIOS["throughput"], tokens=1024)  # less noise
        for shape in (longer, SCENARIOS["short"]):
            runs: dict[str, list[Result]] = {"off": [], "on": [], "tenth": []}
            spans: dict[str, list[int]] = {"on": [], "tenth": []}
            for which in ("off", "on", "tenth", "tenth", "on", "off") * TRACING_ROUNDS:
                named = dataclasses.replace(
                    shape, name=f"{scenario.name}-{shape.name}-{which}", env=env[which]
                )
                runs[which].append(asyncio.run(run_scenario(named, ceiling)))
                if which != "off":  # the worker has stopped: its last batch is exported
                    spans[which].append(sink_count(port)["spans"])
            part: dict[str, Any] = {w: median_of(results, figures) for w, results in runs.items()}
            figure = "jobs_per_s" if shape.name == "short" else "tokens_per_s"
            part["figure"] = figure
            for which in ("on", "tenth"):
                part[f"{which}_vs_off"] = round(part[which][figure] / part["off"][figure], 3)
            part["spans_received"] = spans
            part["jobs_per_run"] = shape.streams
            part["runs"] = {w: [summary(r) for r in results] for w, results in runs.items()}
            data[shape.name] = part
            print(
                f"{scenario.name:>10}: {shape.name} {figure.replace('_per_s', '/s')} traced"
                f" {part['on'][figure]:,.0f} ({part['on_vs_off']:.3f} x), one in ten"
                f" {part['tenth'][figure]:,.0f} ({part['tenth_vs_off']:.3f} x), untraced"
                f" {part['off'][figure]:,.0f}; spans received {spans} of {shape.streams} jobs"
            )
    (RESULTS / "tracing.json").write_text(json.dumps(data, indent=2) + "\n")


def compare_tokens_per_step(scenario: Scenario, ceiling: float) -> None:
    """The same number of engine steps with several tokens per step (as speculative
    decoding and MTP hand over) and with one, in the order one, several, several, one."""
    one = dataclasses.replace(
        scenario, name="multitoken-1", tokens=scenario.tokens // scenario.tokens_per_step,
        tokens_per_step=1,
    )  # fmt: skip
    results: dict[int, list[Result]] = {1: [], scenario.tokens_per_step: []}
    for each in (one, scenario, scenario, one):
        results[each.tokens_per_step].append(asyncio.run(run_scenario(each, ceiling)))
    several = scenario.tokens_per_step

    def mean(runs: list[Result], figure: str) -> float:
        return round(sum(float(getattr(r, figure)) for r in runs) / len(runs), 4)

    figures = ("tokens_per_s", "cpu_s_per_1000_tokens", "ttft_ms_p50", "ttft_ms_p99")
    data: dict[str, Any] = {
        "scenario": scenario.name,
        "description": scenario.description,
        "one_per_step": {f: mean(results[1], f) for f in figures},
        f"{several}_per_step": {f: mean(results[several], f) for f in figures},
        "runs": {str(k): [summary(r) for r in v] for k, v in results.items()},
        "redis_xadd_per_s": round(ceiling, 1),
    }
    gain = data[f"{several}_per_step"]["tokens_per_s"] / data["one_per_step"]["tokens_per_s"]
    data["gain"] = round(gain, 3)
    (RESULTS / "multitoken.json").write_text(json.dumps(data, indent=2) + "\n")
    print(
        f"{scenario.name:>10}: {data[f'{several}_per_step']['tokens_per_s']:>10,.0f} tokens/s at"
        f" {several} per step vs {data['one_per_step']['tokens_per_s']:,.0f} at 1 ({gain:.2f} x)"
    )


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _summary_rows(ceiling: float) -> Iterator[str]:  # noqa: C901 (one row per scenario)
    def of_redis(rate: float) -> str:
        return f"{rate / ceiling:.4f} x Redis"

    if r := _load("throughput"):
        yield (
            f"| throughput | {r['description']} | **{r['tokens_per_s']:,.0f} tokens/s**"
            f" ({of_redis(r['tokens_per_s'])}); {r['cpu_s_per_1000_tokens'] * 1000:.1f}"
            " CPU-ms per 1k tokens | >= 0.25 x Redis |"
        )
    if r := _load("baseline"):
        t, j = r["tokens"], r["short"]
        now, then = t["current"], t["baseline"]
        yield (
            f"| baseline | this code vs. `{r['baseline_ref'][:12]}` (before this work),"
            " 256 streams x 1,024 tokens and the short backlog, ABBA | CPU per token"
            f" **{r['cpu_per_token_vs_baseline']:.2f} x**"
            f" ({now['cpu_s_per_1000_tokens'] * 1000:.1f} vs"
            f" {then['cpu_s_per_1000_tokens'] * 1000:.1f} ms per 1k tokens); without the"
            " engine thread (the echo engine)"
            f" **{r['cpu_per_token_without_engine_thread_vs_baseline']:.2f} x**;"
            f" {now['tokens_per_s']:,.0f} vs {then['tokens_per_s']:,.0f} tokens/s"
            f" ({of_redis(now['tokens_per_s'])} vs {of_redis(then['tokens_per_s'])}); short"
            f" {j['current']['jobs_per_s']:,.0f} vs {j['baseline']['jobs_per_s']:,.0f} jobs/s"
            " | CPU <= 0.5 x |"
        )
    if r := _load("short"):
        yield (
            f"| short | {r['description']} | **{r['jobs_per_s']:,.0f} jobs/s**"
            f" ({of_redis(r['jobs_per_s'])}); {r['cpu_s_per_1000_tokens']:.2f} CPU-ms per job"
            " | >= 3,000 jobs/s |"
        )
    if r := _load("latency"):
        yield (
            f"| latency | {r['description']} | publish -> first token entry"
            f" **{r['ttft_ms_p50']:.2f} ms p50, {r['ttft_ms_p99']:.2f} ms p99** | <= 2 / <= 10 ms |"
        )
    if r := _load("realistic"):
        yield (
            f"| realistic | {r['description']} | {r['tokens_per_s']:,.0f} tokens/s (the"
            f" engine's pace); engine -> readable entry **{r['emit_ms_p50']} ms p50,"
            f" {r['emit_ms_p99']} ms p99** | <= 2 ms p99 |"
        )
    if r := _load("soak"):
        yield (
            f"| soak | {r['description']} | {r['jobs_per_s']:,.0f} jobs/s"
            f" ({of_redis(r['jobs_per_s'])}); RSS **{r['rss_growth_pct']:+.1f} %** after"
            f" warm-up (peak {r['rss_peak_mib']:.0f} MiB) | <= 5 % |"
        )
    if r := _load("multitoken"):
        four, one = r["4_per_step"], r["one_per_step"]
        yield (
            f"| multitoken | {r['description']} | **{r['gain']:.2f} x** the tokens/s of 1"
            f" per step ({four['tokens_per_s']:,.0f}, {of_redis(four['tokens_per_s'])}, vs"
            f" {one['tokens_per_s']:,.0f}) | >= 1.5 x |"
        )
    if r := _load("cluster"):
        yield (
            f"| cluster | {r['description']} | **{r['cluster_vs_single']:.2f} x** the single"
            f" node's tokens/s ({r['cluster']['tokens_per_s']:,.0f},"
            f" {of_redis(r['cluster']['tokens_per_s'])}) | >= 0.8 x |"
        )
    for name in SWEEPS:
        if r := _load(f"sweep-{name}"):
            points = ", ".join(
                f"{p['x']}: {p['tokens_per_s']:,.0f} ({of_redis(p['tokens_per_s'])})"
                for p in r["points"]
            )
            yield (
                f"| sweep {name} | {r['description']} | tokens/s at {points};"
                f" `bench/results/sweep-{name}.png` | the curves |"
            )
    if r := _load("tracing"):
        long, short = r["throughput"], r["short"]
        yield (
            f"| tracing | {r['description']}, medians | long jobs traced"
            f" **{long['on_vs_off']:.2f} x**; short jobs traced **{short['on_vs_off']:.2f} x**,"
            f" one in ten traced {short['tenth_vs_off']:.2f} x | >= 0.95 x |"
        )
    if r := _load("idle"):
        yield (
            f"| idle | no jobs for {r['seconds']:.0f} s | engine loop thread"
            f" **{r['looper_cpu_pct']:.2f} %** of a core, whole worker"
            f" {r['process_cpu_pct']:.2f} % | <= 2 % |"
        )


def write_summary(ceiling: float) -> Path:
    """The README's performance table, from this run's results (bench/results/*.json):
    every rate with its ratio to redis-benchmark's XADD rate measured at the start."""
    text = (
        f"redis-benchmark pipelined XADD in this run: **{ceiling:,.0f}/s**"
        f" ({os.cpu_count()} cores)\n\n"
        "| scenario | what | result | target |\n| --- | --- | --- | --- |\n"
        + "\n".join(_summary_rows(ceiling))
        + "\n"
    )
    path = RESULTS / "SUMMARY.md"
    path.write_text(text)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "scenarios",
        nargs="*",
        metavar="SCENARIO",
        help=f"some of {', '.join([*SCENARIOS, *SWEEPS])}, idle (default: all)",
    )
    args = parser.parse_args()
    known = [*SCENARIOS, *SWEEPS, "idle"]
    unknown = [name for name in args.scenarios if name not in known]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(known)}")
    args.scenarios = args.scenarios or known
    RESULTS.mkdir(exist_ok=True)
    ceiling = redis_xadd_ceiling()
    print(f"redis-benchmark pipelined XADD: {ceiling:,.0f}/s")
    for name in args.scenarios:
        if name == "idle":
            idle = asyncio.run(measure_idle())
            (RESULTS / "idle.json").write_text(json.dumps(idle, indent=2) + "\n")
            print(
                f"{name:>10}: engine loop thread {idle['looper_cpu_pct']:.2f}% of a core,"
                f" whole worker {idle['process_cpu_pct']:.2f}%"
            )
            continue
        if name == "cluster":
            compare_cluster(SCENARIOS[name], ceiling)
            continue
        if name == "multitoken":
            compare_tokens_per_step(SCENARIOS[name], ceiling)
            continue
        if name == "baseline":
            compare_baseline(SCENARIOS[name], ceiling)
            continue
        if name == "tracing":
            compare_tracing(SCENARIOS[name], ceiling)
            continue
        if name in SWEEPS:
            run_sweep(name, ceiling)
            continue
        result = asyncio.run(run_scenario(SCENARIOS[name], ceiling))
        (RESULTS / f"{name}.json").write_text(json.dumps(summary(result), indent=2) + "\n")
        plot(result, RESULTS / f"{name}.png")
        print(
            f"{name:>10}: {result.tokens_per_s:>10,.0f} tokens/s ({result.ratio:.2f} of Redis)"
            f"  {result.jobs_per_s:>8,.0f} jobs/s  TTFT p50 {result.ttft_ms_p50:.2f} ms"
            f" p99 {result.ttft_ms_p99:.2f} ms  emit p99 {result.emit_ms_p99} ms"
            f"  CPU {result.cpu_s_per_1000_tokens:.4f} s/1k tokens  RSS peak"
            f" {result.rss_peak_mib:.0f} MiB (+{result.rss_growth_pct:.1f}% after warm-up)"
        )
    print(f"summary: {write_summary(ceiling)}")


if __name__ == "__main__":
    main()
