"""Priority tiers (issue 27): interactive jobs (priority 9, short) arriving at a steady
rate at a worker whose slots a backlog of batch jobs (priority 0, long) keeps full.
Three phases, a fresh worker and queue each, measured over the same fixed window:

- `idle`: the interactive jobs alone (no backlog): their time to first token unloaded;
- `batch`: the backlog alone: batch tokens/s and jobs/s;
- `mixed`: the backlog and the interactive jobs: both, and the pauses and give-backs
  per second from the worker's /metrics.

The backlog need not drain (10,000 jobs of 300 tokens at 4 slots and 20 ms a step would
take hours): only what happens within the window counts. `tiers` runs them on a classic
queue (x-max-priority 9) and adds the cost of priorities on the `throughput` and
`short` workloads, this code against `settings.PRIORITIES_BASE` (the code before
priorities), in the order before, this, this, before; `tiers-quorum` runs the three
phases on a quorum queue (RabbitMQ before 4.0 delivers a quorum queue in arrival order:
only the worker's own pausing is left). They leave tiers.json and tiers-quorum.json."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import aio_pika
import redis.asyncio as aioredis

from bench import settings
from bench.harness import (
    Result,
    Workload,
    delete_queue,
    http_get,
    percentile,
    run_workload,
    start_worker,
    stop_worker,
    wait_ready,
)
from bench.readers import Reply
from bench.report import mean_of, summary, write_json
from bench.scenarios.base import Data, OfRedis, Scenario, Target
from bench.scenarios.single import SHORT, THROUGHPUT
from bench.services import checkout, free_port
from bench.settings import AMQP_URL, PRIORITIES_BASE, REDIS_URL
from trtllm_worker.contract.queues import job_queue_arguments

INTERACTIVE, BATCH = 9, 0
"""The priorities of the two tiers."""
LOOKOUT_MS = 50
"""How long a batch job may hold a full worker's lookout (pipeline/slots.py LOOKOUT_S)."""
PUBLISH_CHUNK = 1000
"""Backlog messages published before waiting for their confirms."""
COST_FIGURES = ("tokens_per_s", "jobs_per_s", "cpu_s_per_1000_tokens", "ttft_ms_p50")


@dataclass(frozen=True)
class Tiers:
    queue_type: str = "classic"
    slots: int = 4  # WORKER_MAX_BATCH
    step_ms: float = 20  # WORKER_ECHO_STEP_MS
    backlog: int = 10_000  # batch jobs queued before the worker starts
    batch_tokens: int = 300
    interactive_tokens: int = 20
    interactive_per_s: float = 1.0
    window_s: float = settings.TIERS_WINDOW_S
    grace_s: float = 10.0  # after the window, for the last interactive jobs to end

    @property
    def interactive_jobs(self) -> int:
        return int(self.window_s * self.interactive_per_s)

    @property
    def interactive_share(self) -> float:
        """The share of the window's slot-steps the interactive jobs take: their token
        steps over every slot's steps (each token is one slot for one step)."""
        slot_steps = self.slots * self.window_s * 1000 / self.step_ms
        return self.interactive_jobs * self.interactive_tokens / slot_steps

    def describe(self) -> str:
        return (
            f"{self.queue_type} queue, {self.slots} slots, {self.step_ms:g} ms step: a backlog"
            f" of {self.backlog:,} batch jobs (priority {BATCH}, {self.batch_tokens} tokens)"
            f" and {self.interactive_per_s:g} interactive job/s (priority {INTERACTIVE},"
            f" {self.interactive_tokens} tokens) over {self.window_s:g} s"
        )


@dataclass
class Phase:
    """What one phase saw within its window."""

    name: str
    window_s: float
    batch_tokens: int = 0
    batch_jobs_ended: int = 0
    interactive_published: int = 0
    published: dict[int, float] = dataclasses.field(default_factory=dict)
    first_token: dict[int, float] = dataclasses.field(default_factory=dict)
    """Of each interactive job, by its number: when it was published and when its first
    token entry was read (monotonic seconds)."""
    interactive_unstarted: int = 0  # no first token by the end of the grace period
    interactive_ended: int = 0
    paused: float = 0.0
    given_back: float = 0.0
    backlog_publish_s: float = 0.0

    @property
    def ttft_ms(self) -> list[float]:
        """In publication order."""
        return [(t - self.published[n]) * 1000 for n, t in sorted(self.first_token.items())]

    @property
    def ttft_ms_armed(self) -> list[float]:
        """Of the jobs published once the worker had seen an interactive job (before,
        it gives no batch job back and an interactive job waits for a slot to free)."""
        if not self.first_token:
            return []
        seen = min(self.first_token.values())
        return [
            (t - self.published[n]) * 1000
            for n, t in sorted(self.first_token.items())
            if self.published[n] > seen
        ]

    def figures(self) -> dict[str, Any]:
        w = self.window_s
        out: dict[str, Any] = {
            "window_s": w,
            "batch_tokens": self.batch_tokens,
            "batch_tokens_per_s": round(self.batch_tokens / w, 2),
            "batch_jobs_ended": self.batch_jobs_ended,
            "batch_jobs_per_s": round(self.batch_jobs_ended / w, 3),
            "interactive_published": self.interactive_published,
            "interactive_unstarted": self.interactive_unstarted,
            "interactive_ended": self.interactive_ended,
            "paused": self.paused,
            "paused_per_s": round(self.paused / w, 3),
            "given_back": self.given_back,
            "given_back_per_s": round(self.given_back / w, 3),
            "backlog_publish_s": round(self.backlog_publish_s, 3),
            "ttft_ms": [round(t, 2) for t in self.ttft_ms],
        }
        if self.ttft_ms:
            out["ttft_ms_p50"] = round(percentile(self.ttft_ms, 0.5), 2)
            out["ttft_ms_p99"] = round(percentile(self.ttft_ms, 0.99), 2)
            out["ttft_ms_max"] = round(max(self.ttft_ms), 2)
        if armed := self.ttft_ms_armed:
            out["ttft_armed_jobs"] = len(armed)
            out["ttft_ms_p50_armed"] = round(percentile(armed, 0.5), 2)
            out["ttft_ms_p99_armed"] = round(percentile(armed, 0.99), 2)
        return out


def _message(request_id: str, tokens: int, priority: int) -> aio_pika.Message:
    body = {"request_id": request_id, "inputs": "bench ", "parameters": {"max_new_tokens": tokens}}
    return aio_pika.Message(
        json.dumps(body).encode(),
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        content_type="application/json",
        priority=priority,
    )


def counter(metrics: str, name: str) -> float:
    """A counter without labels from the worker's /metrics (0 if absent)."""
    found = re.search(rf"^{name} ([\d.e+]+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def _counters(port: int) -> tuple[float, float]:
    _, metrics = await http_get(port, "/metrics")
    return counter(metrics, "worker_jobs_paused_total"), counter(
        metrics, "worker_jobs_given_back_total"
    )


async def _batch_progress(redis: aioredis.Redis, keys: list[str]) -> tuple[int, int]:
    """(token entries, ended streams) of the batch jobs so far: every stream's length and,
    of those begun, whether its last entry is terminal."""
    pipe = redis.pipeline(transaction=False)
    for key in keys:
        pipe.xlen(key)
    lengths: list[int] = await pipe.execute()
    begun = [key for key, length in zip(keys, lengths, strict=True) if length]
    pipe = redis.pipeline(transaction=False)
    for key in begun:
        pipe.xrevrange(key, count=1)
    lasts: list[list[tuple[str, dict[str, str]]]] = await pipe.execute()
    ended = sum(1 for last in lasts if last and last[0][1].get("event") in ("done", "error"))
    return sum(lengths) - ended, ended


async def _watch(redis: aioredis.Redis, key: str, n: int, phase: Phase) -> None:
    """Interactive job `n`'s stream as its subscriber reads it: when its first token
    entry is read, then its end."""
    last, first = "0", False
    while True:
        reply = cast(Reply, await redis.xread({key: last}, block=1000, count=100))
        now = time.monotonic()
        for _, items in reply or []:
            for entry_id, fields in items:
                last = entry_id
                if fields["event"] == "token" and not first:
                    first = True
                    phase.first_token[n] = now
                elif fields["event"] in ("done", "error"):
                    phase.interactive_ended += 1
                    return


async def run_phase(tiers: Tiers, name: str, backlog: bool, interactive: bool) -> Phase:
    """One worker, a queue of its own, `window_s` of measurement; cleans up after it."""
    run_id = uuid.uuid4().hex[:8]
    queue, port, prefix = f"bench-{run_id}", free_port(), f"bench:{run_id}:"
    phase = Phase(name, tiers.window_s)
    workload = Workload(
        f"tiers-{tiers.queue_type}-{name}", tiers.backlog if backlog else 0,
        max(tiers.batch_tokens, tiers.interactive_tokens), tiers.step_ms, tiers.slots, 0,
        tiers.describe(), env=(("WORKER_QUEUE_TYPE", tiers.queue_type),),
    )  # fmt: skip
    redis = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    connection = await aio_pika.connect(AMQP_URL)
    worker = None
    watchers: list[asyncio.Task[None]] = []
    try:
        channel = await connection.channel(publisher_confirms=True)
        arguments: dict[str, Any] = dict(job_queue_arguments(tiers.queue_type))
        await channel.declare_queue(queue, durable=True, arguments=arguments)
        exchange = channel.default_exchange
        batch_ids = [f"{run_id}-b{n}" for n in range(tiers.backlog if backlog else 0)]
        started = time.monotonic()
        for at in range(0, len(batch_ids), PUBLISH_CHUNK):
            await asyncio.gather(*(
                exchange.publish(_message(r, tiers.batch_tokens, BATCH), routing_key=queue)
                for r in batch_ids[at : at + PUBLISH_CHUNK]
            ))  # fmt: skip
        phase.backlog_publish_s = time.monotonic() - started
        batch_keys = [prefix + r for r in batch_ids]
        worker = start_worker(workload, queue, prefix, port)
        await wait_ready(port)
        paused0, given0 = await _counters(port)
        tokens0, ended0 = await _batch_progress(redis, batch_keys)
        t0 = time.monotonic()
        for n in range(tiers.interactive_jobs if interactive else 0):
            # in the middle of each of the window's seconds
            await asyncio.sleep(
                max(0.0, t0 + (n + 0.5) / tiers.interactive_per_s - time.monotonic())
            )
            request_id = f"{run_id}-i{n}"
            phase.published[n] = time.monotonic()
            await exchange.publish(
                _message(request_id, tiers.interactive_tokens, INTERACTIVE), routing_key=queue
            )
            phase.interactive_published += 1
            watchers.append(asyncio.create_task(_watch(redis, prefix + request_id, n, phase)))
        await asyncio.sleep(max(0.0, t0 + tiers.window_s - time.monotonic()))
        tokens1, ended1 = await _batch_progress(redis, batch_keys)
        paused1, given1 = await _counters(port)
        phase.window_s = round(time.monotonic() - t0, 3)  # the snapshots' own time included
        phase.batch_tokens, phase.batch_jobs_ended = tokens1 - tokens0, ended1 - ended0
        phase.paused, phase.given_back = paused1 - paused0, given1 - given0
        if watchers:
            await asyncio.wait(watchers, timeout=tiers.grace_s)
        phase.interactive_unstarted = phase.interactive_published - len(phase.first_token)
        return phase
    finally:
        for watcher in watchers:
            watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*watchers, return_exceptions=True)
        if worker is not None:
            stop_worker(worker)
        keys = [k async for k in redis.scan_iter(match=prefix + "*", count=10_000)]
        for at in range(0, len(keys), 10_000):
            await redis.delete(*keys[at : at + 10_000])
        await delete_queue(connection, queue)
        await connection.close()
        await redis.aclose()


def judge(tiers: Tiers, idle: Data, batch: Data, mixed: Data) -> dict[str, Any]:
    """The goals against the phases' figures."""
    allowed = idle["ttft_ms_p99"] + tiers.step_ms + LOOKOUT_MS
    expected = batch["batch_tokens_per_s"] * (1 - tiers.interactive_share)
    ratio = mixed["batch_tokens_per_s"] / batch["batch_tokens_per_s"]
    complete = mixed["interactive_unstarted"] == 0
    return {
        "interactive_share": round(tiers.interactive_share, 4),
        "ttft_p99_allowed_ms": round(allowed, 2),
        "ttft_goal_met": complete and mixed.get("ttft_ms_p99", float("inf")) <= allowed,
        "ttft_goal_met_armed": complete and mixed.get("ttft_ms_p99_armed", float("inf")) <= allowed,
        "batch_tokens_vs_without": round(ratio, 3),
        "batch_tokens_vs_expected": round(mixed["batch_tokens_per_s"] / expected, 3),
        "batch_goal_met": mixed["batch_tokens_per_s"] >= 0.9 * expected,
    }


async def _phases(tiers: Tiers) -> dict[str, Data]:
    return {
        name: (await run_phase(tiers, name, backlog, interactive)).figures()
        for name, backlog, interactive in (
            ("idle", False, True), ("batch", True, False), ("mixed", True, True),
        )
    }  # fmt: skip


def _cost() -> dict[str, Any]:
    """`throughput` and `short` on the code before priorities and on this one, in rounds of
    before, this, this, before (a drift of the machine's speed cancels out), each with
    `TIERS_COST_SCALE` times the jobs (the ratio is of the means; each run is kept)."""
    scale, rounds = settings.TIERS_COST_SCALE, settings.TIERS_COST_ROUNDS
    data: dict[str, Any] = {"before_ref": PRIORITIES_BASE, "scale": scale, "rounds": rounds}
    with checkout(PRIORITIES_BASE) as source:
        for shape in (THROUGHPUT, SHORT):
            runs: dict[str, list[Result]] = {"before": [], "current": []}
            for which in ("before", "current", "current", "before") * rounds:
                named = dataclasses.replace(
                    shape,
                    name=f"tiers-cost-{shape.name}-{which}",
                    streams=shape.streams * scale,
                    description=f"{shape.description}, x{scale} jobs",
                    source=source if which == "before" else None,
                )
                runs[which].append(asyncio.run(run_workload(named, 1.0)))
            part: dict[str, Any] = {w: mean_of(rs, COST_FIGURES) for w, rs in runs.items()}
            figure = "tokens_per_s" if shape is THROUGHPUT else "jobs_per_s"
            part["ratio"] = round(part["current"][figure] / part["before"][figure], 3)
            part["runs"] = {w: [summary(r) for r in rs] for w, rs in runs.items()}
            data[shape.name] = part
    return data


def run_cost(ceiling: float) -> None:
    """The `tiers-cost` scenario: only the cost of priorities, on a quiet machine."""
    data = {"scenario": "tiers-cost", "redis_xadd_per_s": round(ceiling, 1), **_cost()}
    write_json("tiers-cost", data)
    for shape in ("throughput", "short"):
        part, figure = data[shape], "tokens_per_s" if shape == "throughput" else "jobs_per_s"
        spread = [round(r[figure]) for w in ("before", "current") for r in part["runs"][w]]
        print(
            f"tiers-cost: {shape} {part['current'][figure]:,.0f} vs {part['before'][figure]:,.0f}"
            f" before priorities ({part['ratio']:.3f} x; runs before then this: {spread})"
        )


def cost_row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    what = (
        f"`throughput` and `short` with {r['scale']} x their jobs, this code vs"
        f" `{r['before_ref'][:7]}` (before priorities), {r['rounds']} ABBA rounds"
    )
    return what, (
        f"throughput **{r['throughput']['ratio']:.3f} x**, short **{r['short']['ratio']:.3f} x**"
    )


def _print(name: str, tiers: Tiers, data: Data) -> None:
    idle, batch, mixed, goals = data["idle"], data["batch"], data["mixed"], data["goals"]
    mark = {True: "met", False: "MISSED"}
    print(
        f"{name:>10}: interactive TTFT p50/p99 {mixed.get('ttft_ms_p50')}/"
        f"{mixed.get('ttft_ms_p99')} ms under the backlog (once the worker had seen one:"
        f" {mixed.get('ttft_ms_p50_armed')}/{mixed.get('ttft_ms_p99_armed')} ms;"
        f" {mixed['interactive_unstarted']} of {mixed['interactive_published']} unstarted)"
        f" vs {idle.get('ttft_ms_p50')}/{idle.get('ttft_ms_p99')} ms idle; goal p99 <="
        f" {goals['ttft_p99_allowed_ms']} ms: {mark[goals['ttft_goal_met']]}"
        f" (armed: {mark[goals['ttft_goal_met_armed']]})"
    )
    print(
        f"{'':>10}  batch {mixed['batch_tokens_per_s']:.1f} tokens/s"
        f" {mixed['batch_jobs_per_s']:.3f} jobs/s with interactive vs"
        f" {batch['batch_tokens_per_s']:.1f} / {batch['batch_jobs_per_s']:.3f} without"
        f" ({goals['batch_tokens_vs_without']:.3f} x; interactive share"
        f" {goals['interactive_share']:.3f}, {goals['batch_tokens_vs_expected']:.3f} x of the"
        f" expected, goal >= 0.9: {mark[goals['batch_goal_met']]}); paused"
        f" {mixed['paused_per_s']:.2f}/s, given back {mixed['given_back_per_s']:.2f}/s;"
        f" backlog of {tiers.backlog:,} published in {batch['backlog_publish_s']:.2f} s"
    )
    for shape in ("throughput", "short"):
        if part := data.get("cost", {}).get(shape):
            figure = "tokens_per_s" if shape == "throughput" else "jobs_per_s"
            print(
                f"{'':>10}  {shape}: {part['current'][figure]:,.0f} vs"
                f" {part['before'][figure]:,.0f} {figure.replace('_per_s', '/s')} before"
                f" priorities ({part['ratio']:.3f} x)"
            )


def runner(name: str, tiers: Tiers, cost: bool) -> Callable[[float], None]:
    def run(ceiling: float) -> None:
        data: dict[str, Any] = {
            "scenario": name,
            "description": tiers.describe(),
            "parameters": dataclasses.asdict(tiers),
            **asyncio.run(_phases(tiers)),
            "redis_xadd_per_s": round(ceiling, 1),
        }
        data["goals"] = judge(tiers, data["idle"], data["batch"], data["mixed"])
        if cost:
            data["cost"] = _cost()
        write_json(name, data)
        _print(name, tiers, data)

    return run


def row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    idle, batch, mixed, goals = r["idle"], r["batch"], r["mixed"], r["goals"]
    text = (
        f"interactive TTFT p99 **{mixed.get('ttft_ms_p99')} ms** under the backlog"
        f" ({mixed.get('ttft_ms_p99_armed')} ms once the worker had seen one) vs"
        f" {idle.get('ttft_ms_p99')} ms idle; batch **{goals['batch_tokens_vs_without']:.2f} x**"
        f" the tokens/s without ({mixed['batch_tokens_per_s']:.0f} vs"
        f" {batch['batch_tokens_per_s']:.0f}, interactive share"
        f" {goals['interactive_share']:.2f}); {mixed['paused_per_s']:.2f} pauses/s,"
        f" {mixed['given_back_per_s']:.2f} given back/s"
    )
    if cost := r.get("cost"):
        text += (
            f"; vs `{cost['before_ref'][:7]}`: throughput {cost['throughput']['ratio']:.2f} x,"
            f" short {cost['short']['ratio']:.2f} x"
        )
    return r["description"], text


def _met(r: Data) -> bool:
    return bool(r["goals"]["ttft_goal_met"] and r["goals"]["batch_goal_met"])


TARGET = Target("TTFT p99 <= idle + 1 step + 50 ms; batch >= 0.9 x expected", _met)
CLASSIC = Tiers()
QUORUM = dataclasses.replace(CLASSIC, queue_type="quorum")
SCENARIO = Scenario("tiers", runner("tiers", CLASSIC, cost=False), "tiers", row, TARGET)
COST_TARGET = Target(
    ">= 0.95 x on both",
    lambda r: bool(r["throughput"]["ratio"] >= 0.95 and r["short"]["ratio"] >= 0.95),
)
COST_SCENARIO = Scenario("tiers-cost", run_cost, "tiers-cost", cost_row, COST_TARGET)
QUORUM_SCENARIO = Scenario(
    "tiers-quorum", runner("tiers-quorum", QUORUM, cost=False), "tiers-quorum", row, TARGET
)
