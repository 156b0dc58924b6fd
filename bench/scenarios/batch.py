"""Batches (issue 29): an OpenAI Batch input file of `BENCH_BATCH_LINES` short
`/v1/completions` lines (default 50,000, OpenAI's limit) submitted with
`Client.submit_batch`, against the same jobs published directly (the harness's path:
publisher confirms, 2,000 in flight, every stream read by a subscriber), one worker of
the same settings each, in rounds of direct, batch, batch, direct (`BENCH_BATCH_ROUNDS`).

Of the batch it measures lines/s submitted (`submit_batch`'s wall time), lines/s
completed (from the start of `submit_batch` to the first status poll that sees the final
status, the poll that finalizes included), the whole output file written
(`write_batch_results`), the worker's and the bench's CPU per line, and the Redis memory
a stored result line costs: `MEMORY USAGE` of a sample of the line keys
(`{<stream>}:batch`, their records once ended), and `used_memory` freed when every line
key is deleted (noisy when anything else uses the Redis). It leaves batch.json."""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import redis.asyncio as aioredis
from tqdm import tqdm

from bench import settings
from bench.harness import (
    Result,
    Workload,
    delete_queue,
    run_workload,
    start_worker,
    stop_worker,
    wait_ready,
)
from bench.procfs import proc_stat
from bench.report import summary, write_json
from bench.scenarios.base import Data, OfRedis, Scenario, Target
from bench.services import free_port
from bench.settings import AMQP_URL, REDIS_URL
from trtllm_worker.client import Client
from trtllm_worker.client.batches import BatchObject
from trtllm_worker.contract.batches import FINAL_STATUSES, line_key, line_request_id
from trtllm_worker.contract.openai import COMPLETIONS
from trtllm_worker.contract.stream import stream_key

LINE_TOKENS = 4
"""max_tokens of every line (the echo engine gives exactly that many)."""
SLOTS = 256
"""WORKER_MAX_BATCH, as `short` and `soak`."""
IN_FLIGHT = 2000
"""Jobs the direct path keeps published ahead of those ended (as `soak`)."""
MEMORY_SAMPLE = 1000
"""Line keys (and streams) whose MEMORY USAGE is averaged."""
POLL_S = 0.1
"""Between two status polls of the batch."""
PROMPT = "bench "
"""The prompt of every line, the direct path's `inputs`."""
GOAL = 0.9
"""Lines/s completed as a batch over jobs/s published directly."""


def describe(lines: int) -> str:
    return (
        f"{lines:,} `{COMPLETIONS}` lines of {LINE_TOKENS} tokens, 0 ms step, batch"
        f" {SLOTS}, vs the same jobs published directly"
    )


def workload(name: str, lines: int) -> Workload:
    return Workload(name, lines, LINE_TOKENS, 0, SLOTS, IN_FLIGHT, describe(lines))


def write_input(path: Path, lines: int) -> int:
    """OpenAI's Batch input format, one short completion a line; returns its size."""
    with path.open("w") as file:
        for n in range(lines):
            body = {"model": "echo", "prompt": PROMPT, "max_tokens": LINE_TOKENS}
            line = {"custom_id": f"line-{n}", "method": "POST", "url": COMPLETIONS, "body": body}
            file.write(json.dumps(line) + "\n")
    return path.stat().st_size


async def _memory_usage(redis: aioredis.Redis, keys: list[str]) -> float:
    """Mean MEMORY USAGE (bytes) of those of `keys` that exist."""
    pipe = redis.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key)
    found = [int(size) for size in await pipe.execute() if size is not None]
    return statistics.fmean(found) if found else 0.0


async def _used_memory(redis: aioredis.Redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


async def _delete(redis: aioredis.Redis, keys: list[str]) -> None:
    for start in range(0, len(keys), 10_000):
        await redis.delete(*keys[start : start + 10_000])


async def _wait_final(client: Client, batch_id: str, lines: int) -> tuple[BatchObject, float]:
    """Polls the batch's status until it is final; returns it and how long the last
    poll took (the one that finalized the batch, expiries of every key included)."""
    bar = tqdm(total=lines, desc="batch: ended", unit="line", leave=False)
    try:
        while True:
            asked = time.monotonic()
            batch = await client.batch(batch_id)
            took = time.monotonic() - asked
            counts = batch["request_counts"]
            bar.update(counts["completed"] + counts["failed"] - bar.n)
            if batch["status"] in FINAL_STATUSES:
                return batch, took
            await asyncio.sleep(POLL_S)
    finally:
        bar.close()


async def run_batch(path: Path, lines: int, folder: Path) -> dict[str, Any]:
    """One worker, a queue of its own, the file submitted, waited for and its results
    written; the Redis memory its lines take; cleans up after it."""
    run_id = uuid.uuid4().hex[:8]
    queue, port, prefix = f"bench-{run_id}", free_port(), f"bench:{run_id}:"
    batch_id = f"bench-{run_id}"
    redis = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    worker = start_worker(workload("batch", lines), queue, prefix, port)
    client = Client(amqp_url=AMQP_URL, redis_url=REDIS_URL, queue=queue, stream_prefix=prefix)
    try:
        await wait_ready(port)
        memory_before = await _used_memory(redis)
        cpu_before, bench_before = proc_stat(worker.pid)[0], time.process_time()
        bar = tqdm(total=lines, desc="batch: submitted", unit="line", leave=False)
        started = time.monotonic()
        await client.submit_batch(path, batch_id=batch_id, progress=bar.update)
        submitted = time.monotonic()
        bar.close()
        final, finalize_s = await _wait_final(client, batch_id, lines)
        ended = time.monotonic()
        cpu_after, bench_after = proc_stat(worker.pid)[0], time.process_time()
        memory_after = await _used_memory(redis)
        output, errors = folder / f"{batch_id}.out.jsonl", folder / f"{batch_id}.err.jsonl"
        asked = time.monotonic()
        written = await client.write_batch_results(batch_id, output, errors)
        results_s = time.monotonic() - asked
        streams = [stream_key(prefix, line_request_id(batch_id, n)) for n in range(lines)]
        sample = streams[:: max(lines // MEMORY_SAMPLE, 1)]
        line_bytes = await _memory_usage(redis, [line_key(s) for s in sample])
        stream_bytes = await _memory_usage(redis, sample)
        before_delete = await _used_memory(redis)
        await _delete(redis, [line_key(s) for s in streams])
        freed = before_delete - await _used_memory(redis)
        counts = final["request_counts"]
        return {
            "lines": lines,
            "status": final["status"],
            "completed": counts["completed"],
            "failed": counts["failed"],
            "submit_s": round(submitted - started, 3),
            "submit_lines_per_s": round(lines / (submitted - started), 1),
            "completed_s": round(ended - started, 3),
            "completed_lines_per_s": round(lines / (ended - started), 1),
            "finalize_poll_s": round(finalize_s, 3),
            "results_s": round(results_s, 3),
            "results_lines_per_s": round(lines / results_s, 1),
            "output_lines": written[0],
            "error_lines": written[1],
            "output_bytes": output.stat().st_size,
            "worker_cpu_ms_per_line": round((cpu_after - cpu_before) / lines * 1000, 4),
            "bench_cpu_ms_per_line": round((bench_after - bench_before) / lines * 1000, 4),
            "line_key_bytes": round(line_bytes, 1),
            "stream_bytes": round(stream_bytes, 1),
            "line_keys_freed_bytes_per_line": round(freed / lines, 1),
            "used_memory_grown_bytes_per_line": round((memory_after - memory_before) / lines, 1),
        }
    finally:
        await client.aclose()
        stop_worker(worker)
        keys = [
            key
            for pattern in (prefix + "*", "{" + prefix + "*")
            async for key in redis.scan_iter(match=pattern, count=10_000)
        ]
        await _delete(redis, keys)
        await redis.aclose()
        connection = await aio_pika.connect(AMQP_URL)
        await delete_queue(connection, queue)
        await connection.close()


def run_direct(lines: int, ceiling: float) -> tuple[Result, float]:
    """The same jobs through the harness; returns its result and the bench's CPU (ms) per
    job (publishing and reading every stream)."""
    bench_before = time.process_time()
    result = asyncio.run(run_workload(workload("batch-direct", lines), ceiling))
    return result, (time.process_time() - bench_before) / lines * 1000


DIRECT_FIGURES = ("jobs_per_s", "seconds", "worker_cpu_ms_per_line", "bench_cpu_ms_per_line")
BATCH_FIGURES = (
    "submit_lines_per_s", "completed_lines_per_s", "completed_s", "finalize_poll_s",
    "results_s", "results_lines_per_s", "worker_cpu_ms_per_line", "bench_cpu_ms_per_line",
    "line_key_bytes", "stream_bytes", "line_keys_freed_bytes_per_line",
    "used_memory_grown_bytes_per_line",
)  # fmt: skip


def _mean(runs: list[dict[str, Any]], figures: tuple[str, ...]) -> dict[str, float]:
    return {f: round(statistics.fmean(float(r[f]) for r in runs), 4) for f in figures}


def run(ceiling: float) -> None:
    lines, rounds = settings.BATCH_LINES, settings.BATCH_ROUNDS
    direct: list[dict[str, Any]] = []
    batches: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as folder:
        path = Path(folder) / "input.jsonl"
        size = write_input(path, lines)
        for which in ("direct", "batch", "batch", "direct") * rounds:
            if which == "batch":
                batches.append(asyncio.run(run_batch(path, lines, Path(folder))))
                one = batches[-1]
                print(
                    f"     batch: submitted {one['submit_lines_per_s']:,.0f} lines/s, completed"
                    f" {one['completed_lines_per_s']:,.0f} lines/s ({one['status']},"
                    f" {one['completed']:,} ok, {one['failed']:,} failed), results"
                    f" {one['results_s']:.2f} s"
                )
                continue
            result, bench_cpu = run_direct(lines, ceiling)
            figures = summary(result)
            worker_cpu_s = result.cpu_s_per_1000_tokens * result.tokens / 1000
            figures["worker_cpu_ms_per_line"] = round(worker_cpu_s / lines * 1000, 4)
            figures["bench_cpu_ms_per_line"] = round(bench_cpu, 4)
            direct.append(figures)
            print(f"    direct: {result.jobs_per_s:,.0f} jobs/s")
    data: dict[str, Any] = {
        "scenario": "batch",
        "description": describe(lines),
        "lines": lines,
        "line_tokens": LINE_TOKENS,
        "input_bytes": size,
        "rounds": rounds,
        "redis_xadd_per_s": round(ceiling, 1),
        "direct": {**_mean(direct, DIRECT_FIGURES), "runs": direct},
        "batch": {**_mean(batches, BATCH_FIGURES), "runs": batches},
    }
    data["ratio"] = round(data["batch"]["completed_lines_per_s"] / data["direct"]["jobs_per_s"], 3)
    data["all_completed"] = all(
        b["status"] == "completed" and b["completed"] == lines and b["output_lines"] == lines
        for b in batches
    )
    write_json("batch", data)
    b, d = data["batch"], data["direct"]
    print(
        f"     batch: {lines:,} lines submitted at {b['submit_lines_per_s']:,.0f} lines/s,"
        f" completed at {b['completed_lines_per_s']:,.0f} lines/s vs {d['jobs_per_s']:,.0f}"
        f" jobs/s direct ({data['ratio']:.3f} x, goal >= {GOAL}); results file"
        f" {b['results_s']:.2f} s; {b['line_key_bytes']:,.0f} B per stored result line"
        f" (MEMORY USAGE), {b['line_keys_freed_bytes_per_line']:,.0f} B (used_memory freed)"
    )


def row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    b, d = r["batch"], r["direct"]
    return r["description"], (
        f"completed **{b['completed_lines_per_s']:,.0f} lines/s**, **{r['ratio']:.2f} x**"
        f" direct ({d['jobs_per_s']:,.0f} jobs/s); submitted {b['submit_lines_per_s']:,.0f}"
        f" lines/s; results file {b['results_s']:.2f} s; {b['line_key_bytes']:,.0f} B of"
        f" Redis per stored result line"
    )


TARGET = Target(f">= {GOAL} x direct", lambda r: bool(r["all_completed"] and r["ratio"] >= GOAL))
SCENARIO = Scenario("batch", run, "batch", row, TARGET)
