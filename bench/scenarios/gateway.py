"""The OpenAI-compatible gateway (`trtllm-worker gateway`) against the same kind of jobs
read straight from Redis, in the same run.

Each level of the sweep starts a worker (echo engine, `BENCH_GATEWAY_STEP_MS` a step: the
pace of every stream), a gateway process on a free port, both on a queue and stream
prefix of their own, and two load processes (`bench/gateway_load.py`): `N` streaming
clients POSTing `/v1/chat/completions` with `stream: true` through the gateway, back to
back (each pausing a random fraction of a step between answers, so that requests do
not lock onto the engine's steps), and min(N, `BENCH_GATEWAY_DIRECT`) SDK clients
submitting the same job (the same body through `job_fields`, the gateway's priority)
and reading its stream with `Client.stream`. Over a window of `BENCH_GATEWAY_WINDOW_S`
after every client started:

- tokens/s relayed (tokens the gateway's clients received within the window);
- TTFT through the gateway (POST written -> first token's chunk read) and direct
  (`submit` called -> first token entry read), p50 and p99 of each, and the added time
  at each (the difference of the percentiles: both sides ride the same worker, in the
  same seconds);
- the gateway's CPU seconds per 1k tokens relayed (/proc/<pid>/stat, against its own
  `trtllm_gateway_tokens_relayed_total`) and its share of a core; the worker's;
- the added latency per token, paired: for up to `SHADOWS` of the gateway's clients, a
  reader of the job's stream in Redis in the same load process (started as the first
  token arrives, so from the second token on) notes when each token entry arrives; the
  token's chunk through the gateway minus that, p50 and p99;
- the load processes' own CPU and event-loop lag (the check that they were not the
  bound), and the whole machine's CPU (it is shared).

The most concurrent streams is the largest level that held, every smaller one holding
too: added latency per token p99 under `BOUND_MS` (paired, so the machine's hiccups,
which both readers see, cancel out; the difference of two unpaired TTFT p99s swung by
tens of ms between runs), no errors, every answer whole. The sweep stops at the first
level that did not hold (`BENCH_GATEWAY_KEEP_GOING=1`: it runs every level, for the
curves of tokens/s and CPU; the most streams is counted as before). Before it, the
unloaded added TTFT: one job at a time through the gateway then direct
(`BENCH_GATEWAY_PAIRS` pairs; echo engine at 0 ms a step, so that no step boundary sits
in the TTFT), paired.

`BENCH_PROFILE=1`: a py-spy profile of the gateway over each level's window
(bench/results/gateway-<N>.profile.txt; `python bench/profile_summary.py FILE`).
Leaves gateway.json."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import redis.asyncio as aioredis

from bench import settings
from bench.gateway_stats import (
    added_latency,
    holds,
    most_streams,
    paired_added,
    percentile,
    shares,
)
from bench.harness import Workload, delete_queue, start_worker, stop_worker, wait_ready
from bench.procfs import machine_jiffies, peak_rss_mib, proc_stat
from bench.report import write_json
from bench.scenarios.base import Data, OfRedis, Scenario, Target
from bench.services import free_port
from bench.settings import AMQP_URL, REDIS_URL, REPO

MODEL = "bench-echo"
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "qwen2.5.jinja"
PRIORITY = 5
"""The open gateway's priority (WORKER_PREEMPT_PRIORITY's default), given the direct jobs
too."""
BOUND_MS = 50.0
"""Added latency per token (paired) p99 a level must stay under to count as held."""
GOAL_P50_MS = 2.0
"""Added TTFT p50 goal."""
DRAIN_S = 30.0
"""How long a level's clients may take to end the answers they began in the window."""
SHADOWS = 50
"""Gateway clients (spread over the level's) whose answers are also read straight from
Redis, token by token: the paired added latency per token."""
CLIENTS_PER_PROCESS = 250
"""Streaming clients per load process (so that no one load process's loop lags)."""


@dataclass
class Deployment:
    queue: str
    prefix: str
    worker: subprocess.Popen[bytes]
    gateway: subprocess.Popen[bytes]
    gateway_port: int


def _env(queue: str, prefix: str, tokens: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        WORKER_AMQP_URL=AMQP_URL,
        WORKER_REDIS_URL=REDIS_URL,
        WORKER_QUEUE=queue,
        WORKER_STREAM_PREFIX=prefix,
        WORKER_MODEL_NAME=MODEL,
        WORKER_CHAT_TEMPLATE=str(TEMPLATE),
        WORKER_MAX_NEW_TOKENS=str(max(tokens, 16)),
        WORKER_DEFAULT_MAX_NEW_TOKENS=str(max(tokens, 16)),
        WORKER_LOG_LEVEL="WARNING",
        WORKER_STREAM_TTL_S="600",
    )
    return env


async def http_get(port: int, path: str) -> tuple[int, str]:
    """One GET that asks the server to close (uvicorn keeps a connection open)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode())
    raw = (await reader.read()).decode()
    writer.close()
    head, _, body = raw.partition("\r\n\r\n")
    return int(head.split()[1]), body


async def gateway_ready(port: int, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, IndexError, ValueError):
            if (await http_get(port, "/readyz"))[0] == 200:
                return
        await asyncio.sleep(0.1)
    raise RuntimeError("the gateway did not become ready")


async def relayed(port: int) -> float:
    """The gateway's trtllm_gateway_tokens_relayed_total."""
    _, metrics = await http_get(port, "/metrics")
    found = re.search(r"^trtllm_gateway_tokens_relayed_total (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


async def _delete_keys(prefix: str) -> int:
    redis = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        keys = [
            key
            for pattern in (prefix + "*", "{" + prefix + "*")
            async for key in redis.scan_iter(match=pattern, count=10_000)
        ]
        for start in range(0, len(keys), 10_000):
            await redis.delete(*keys[start : start + 10_000])
        return len(keys)
    finally:
        await redis.aclose()


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def start_gateway(name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    log = open(settings.RESULTS / f"{name}.gateway.log", "wb")  # noqa: SIM115 (lives with the process)
    return subprocess.Popen([sys.executable, "-m", "trtllm_worker", "gateway"], env=env, stderr=log)


@contextlib.asynccontextmanager
async def deployment(name: str, slots: int, step_ms: float) -> AsyncIterator[Deployment]:
    """A worker and a gateway on a queue and prefix of their own; afterwards both
    stopped, the queue, its dead-letter queue and cancel exchange deleted, and every key
    of the prefix."""
    run_id = uuid.uuid4().hex[:8]
    queue, prefix = f"bench-{run_id}", f"bench:{run_id}:"
    tokens = settings.GATEWAY_TOKENS
    template = (("WORKER_CHAT_TEMPLATE", str(TEMPLATE)), ("WORKER_MODEL_NAME", MODEL))
    workload = Workload(name, 0, tokens, step_ms, slots, 0, name, env=template)
    worker_port, gateway_port = free_port(), free_port()
    worker = start_worker(workload, queue, prefix, worker_port)
    gateway: subprocess.Popen[bytes] | None = None
    try:
        await wait_ready(worker_port)
        env = _env(queue, prefix, tokens)
        env.update(WORKER_GATEWAY_HOST="127.0.0.1", WORKER_GATEWAY_PORT=str(gateway_port))
        gateway = start_gateway(name, env)
        await gateway_ready(gateway_port)
        yield Deployment(queue, prefix, worker, gateway, gateway_port)
    finally:
        if gateway is not None:
            _stop(gateway)
        stop_worker(worker)
        connection = await aio_pika.connect(AMQP_URL)
        try:
            await delete_queue(connection, queue)
        finally:
            await connection.close()
        await _delete_keys(prefix)


async def spawn_load(
    where: Deployment, role: str, clients: int, **more: float
) -> asyncio.subprocess.Process:
    config = {
        "role": role,
        "clients": clients,
        "host": "127.0.0.1",
        "port": where.gateway_port,
        "amqp_url": AMQP_URL,
        "redis_url": REDIS_URL,
        "queue": where.queue,
        "prefix": where.prefix,
        "model": MODEL,
        "tokens": settings.GATEWAY_TOKENS,
        "priority": PRIORITY,
        "drain_s": DRAIN_S,
        **more,
    }
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.gateway_load", json.dumps(config),
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def _until(load: asyncio.subprocess.Process, line: str) -> None:
    assert load.stdout is not None
    while (got := await load.stdout.readline()) and got.decode().strip() != line:
        pass
    if not got:
        raise RuntimeError(f"the load process ended before {line!r}")


async def _results(load: asyncio.subprocess.Process) -> dict[str, Any]:
    out, _ = await load.communicate()
    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    if load.returncode != 0 or not lines:
        raise RuntimeError(f"the load process failed (exit {load.returncode})")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


async def _reap(loads: list[asyncio.subprocess.Process]) -> None:
    """Load processes still running (the level failed): killed, by their own pids."""
    for load in loads:
        if load.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                load.kill()
            await load.wait()


def _profiler(pid: int, level: int) -> subprocess.Popen[bytes] | None:
    if not os.environ.get("BENCH_PROFILE"):
        return None
    path = settings.RESULTS / f"gateway-{level}.profile.txt"
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--format", "raw", "-o", str(path),
         "-r", "250", "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _merged(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The gateway clients' results of several load processes as one: their answers,
    tokens and errors added up, their CPU added, the worst of their loop lags."""
    errors: Counter[str] = Counter()
    for result in results:
        errors.update(result["errors"])
    lags = [r["loop_lag_ms_p50"] for r in results if r["loop_lag_ms_p50"] is not None]
    lags99 = [r["loop_lag_ms_p99"] for r in results if r["loop_lag_ms_p99"] is not None]
    return {
        "clients": sum(r["clients"] for r in results),
        "answers": sum(r["answers"] for r in results),
        "short_answers": sum(r["short_answers"] for r in results),
        "errors": dict(errors),
        "ttft_ms": [t for r in results for t in r["ttft_ms"]],
        "relay_added_ms": [t for r in results for t in r["relay_added_ms"]],
        "window_tokens": sum(r["window_tokens"] for r in results),
        "window_s": results[0]["window_s"],
        "cpu_pct": round(sum(r["cpu_pct"] for r in results), 1),
        "loop_lag_ms_p50": max(lags, default=None),
        "loop_lag_ms_p99": max(lags99, default=None),
    }


def _load_figures(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "clients": result["clients"],
        "cpu_pct": result["cpu_pct"],
        "loop_lag_ms_p50": _round(result["loop_lag_ms_p50"]),
        "loop_lag_ms_p99": _round(result["loop_lag_ms_p99"]),
    }


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


async def run_level(streams: int) -> dict[str, Any]:
    """One level of the sweep: `streams` clients through the gateway, the direct readers
    beside them."""
    direct = min(streams, settings.GATEWAY_DIRECT)
    ramp = min(3.0, max(0.5, streams / 300))
    timing = {
        "ramp_s": ramp,
        "warmup_s": ramp + 1.5,
        "window_s": settings.GATEWAY_WINDOW_S,
        "think_s": settings.GATEWAY_STEP_MS / 1000,
    }
    async with deployment(f"gateway-{streams}", streams + direct, settings.GATEWAY_STEP_MS) as d:
        loads: list[asyncio.subprocess.Process] = []
        try:
            for share in shares(streams, CLIENTS_PER_PROCESS):
                shadows = max(round(SHADOWS * share / streams), 1)
                loads.append(await spawn_load(d, "gateway", share, shadows=shadows, **timing))
            through = list(loads)
            straight = await spawn_load(d, "direct", direct, **timing)
            loads.append(straight)
            await _until(through[0], "window-start")
            gateway_cpu, worker_cpu = proc_stat(d.gateway.pid)[0], proc_stat(d.worker.pid)[0]
            relayed_before, began = await relayed(d.gateway_port), time.monotonic()
            machine = machine_jiffies()
            profiler = _profiler(d.gateway.pid, streams)
            await _until(through[0], "window-end")
            seconds = time.monotonic() - began
            relayed_after = await relayed(d.gateway_port)
            gateway_cpu = proc_stat(d.gateway.pid)[0] - gateway_cpu
            worker_cpu = proc_stat(d.worker.pid)[0] - worker_cpu
            busy, total = (now - then for now, then in zip(machine_jiffies(), machine, strict=True))
            load_average = os.getloadavg()[0]
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)
                profiler.wait(60)
            gateway_rss = peak_rss_mib(d.gateway.pid)
            ours = _merged([await _results(each) for each in through])
            theirs = await _results(straight)
        finally:
            await _reap(loads)
    tokens = relayed_after - relayed_before
    ours_pct = (gateway_cpu + worker_cpu) / seconds * 100 + ours["cpu_pct"] + theirs["cpu_pct"]
    errors = {**ours["errors"], **{f"direct {k}": v for k, v in theirs["errors"].items()}}
    return {
        "streams": streams,
        "direct_streams": direct,
        **added_latency(ours["ttft_ms"], theirs["ttft_ms"]),
        "relay_added_ms_p50": percentile(ours["relay_added_ms"], 0.5),
        "relay_added_ms_p99": percentile(ours["relay_added_ms"], 0.99),
        "relay_pairs": len(ours["relay_added_ms"]),
        "tokens_per_s": round(ours["window_tokens"] / ours["window_s"], 1),
        "gateway_counted_tokens_per_s": round(tokens / seconds, 1),
        "direct_tokens_per_s": round(theirs["window_tokens"] / theirs["window_s"], 1),
        "gateway_cpu_s_per_1000_tokens": round(gateway_cpu / max(tokens, 1) * 1000, 4),
        "gateway_cpu_pct": round(gateway_cpu / seconds * 100, 1),
        "worker_cpu_pct": round(worker_cpu / seconds * 100, 1),
        "gateway_rss_peak_mib": round(gateway_rss, 1),
        "short_answers": ours["short_answers"] + theirs["short_answers"],
        "errors": errors,
        "load": {
            "gateway": {**_load_figures(ours), "processes": len(through)},
            "direct": _load_figures(theirs),
        },
        # in % of one core (200: both cores busy), as every other CPU figure here: the
        # whole machine's, and that of the bench's processes (gateway, worker, load);
        # the rest is Redis, RabbitMQ and whatever else ran
        "machine_cpu_pct": round(busy / max(total, 1) * (os.cpu_count() or 1) * 100, 1),
        "bench_processes_cpu_pct": round(ours_pct, 1),
        "load_average_1m": round(load_average, 2),
    }


async def run_unloaded() -> dict[str, Any]:
    """One job at a time, through the gateway then direct, paired."""
    async with deployment("gateway-unloaded", 4, 0) as d:
        load = await spawn_load(d, "alternate", 1, pairs=settings.GATEWAY_PAIRS)
        result = await _results(load)
    figures = paired_added([(g, t) for g, t in result["pairs_ms"]])
    figures["short_answers"] = result["short_answers"]
    return figures


def describe() -> str:
    step = settings.GATEWAY_STEP_MS
    return (
        f"streamed chat completions of {settings.GATEWAY_TOKENS} tokens through one gateway"
        f" process vs the same jobs read straight from Redis (SDK), same run; echo engine"
        f" {step:g} ms a step ({1000 / step:g} tokens/s a stream)"
    )


def _print_level(p: dict[str, Any]) -> None:
    print(
        f"   gateway: {p['streams']:>5} streams  {p['tokens_per_s']:>8,.0f} tokens/s relayed"
        f"  TTFT p50 {p['gateway_ms_p50']} vs {p['direct_ms_p50']} ms direct"
        f" (+{p['added_ms_p50']}), p99 {p['gateway_ms_p99']} vs {p['direct_ms_p99']}"
        f" (+{p['added_ms_p99']})  per token +{p['relay_added_ms_p50']} p50,"
        f" +{p['relay_added_ms_p99']} p99 ms  gateway {p['gateway_cpu_pct']}% of a core,"
        f" {p['gateway_cpu_s_per_1000_tokens'] * 1000:.1f} CPU-ms/1k tokens"
        f"  load {p['load']['gateway']['cpu_pct']}% lag p99"
        f" {p['load']['gateway']['loop_lag_ms_p99']} ms  machine {p['machine_cpu_pct']}%"
        f" (bench {p['bench_processes_cpu_pct']}%)"
        + (f"  errors {p['errors']}" if p["errors"] else "")
        + (f"  short {p['short_answers']}" if p["short_answers"] else "")
    )


def run(ceiling: float) -> None:
    unloaded = asyncio.run(run_unloaded())
    print(
        f"   gateway: unloaded TTFT p50 {unloaded['gateway_ms_p50']} vs"
        f" {unloaded['direct_ms_p50']} ms direct; added (paired) p50"
        f" {unloaded['paired_added_ms_p50']} ms, p99 {unloaded['paired_added_ms_p99']} ms"
    )
    points: list[dict[str, Any]] = []
    for streams in settings.GATEWAY_LEVELS:
        points.append(asyncio.run(run_level(streams)))
        _print_level(points[-1])
        if not holds(points[-1], BOUND_MS) and not settings.GATEWAY_KEEP_GOING:
            print(f"   gateway: {streams} streams did not hold; the sweep stops here")
            break
    best = most_streams(points, BOUND_MS)
    at_best = next((p for p in points if p["streams"] == best), None)
    data: dict[str, Any] = {
        "scenario": "gateway",
        "description": describe(),
        "step_ms": settings.GATEWAY_STEP_MS,
        "tokens": settings.GATEWAY_TOKENS,
        "window_s": settings.GATEWAY_WINDOW_S,
        "direct_max": settings.GATEWAY_DIRECT,
        "bound_ms": BOUND_MS,
        "goal_added_ms_p50": GOAL_P50_MS,
        "machine": f"{os.cpu_count()} cores",
        "redis_xadd_per_s": round(ceiling, 1),
        "unloaded": unloaded,
        "points": points,
        "most_streams": best,
        "at_most_streams": at_best,
    }
    write_json("gateway", data)
    print(f"   gateway: most streams with added latency per token p99 < {BOUND_MS:g} ms: {best}")


def row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    u, best = r["unloaded"], r.get("at_most_streams")
    held = (
        f"held **{r['most_streams']:,} streams** (added latency per token p99 <"
        f" {r['bound_ms']:g} ms): {best['tokens_per_s']:,.0f} tokens/s relayed, per token"
        f" +{best['relay_added_ms_p50']:.1f} / +{best['relay_added_ms_p99']:.1f} ms p50 / p99,"
        f" TTFT +{best['added_ms_p50']:.1f} ms p50,"
        f" {best['gateway_cpu_s_per_1000_tokens'] * 1000:.0f} gateway CPU-ms per 1k tokens"
        f" (machine {best['machine_cpu_pct']:.0f} % busy of"
        f" {int(r['machine'].split()[0]) * 100} %)"
        if best
        else "held no level of the sweep"
    )
    return r["description"], (
        f"unloaded added TTFT **{u['paired_added_ms_p50']:.1f} ms p50**,"
        f" {u['paired_added_ms_p99']:.1f} ms p99; {held}"
    )


def _met(r: Data) -> bool:
    """The p50 goal unloaded and at every level that held."""
    held = [p for p in r["points"] if holds(p, r["bound_ms"])]
    p50s = [r["unloaded"]["paired_added_ms_p50"]] + [p["added_ms_p50"] for p in held]
    return all(v is not None and v <= r["goal_added_ms_p50"] for v in p50s)


SCENARIO = Scenario(
    "gateway",
    run,
    "gateway",
    row,
    Target(
        f"added TTFT p50 <= {GOAL_P50_MS:g} ms; the most streams at added p99 < {BOUND_MS:g} ms",
        _met,
    ),
)
