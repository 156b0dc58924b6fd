"""CPU of a worker with no jobs; leaves idle.json."""

from __future__ import annotations

import asyncio

from bench.harness import idle_cpu
from bench.report import write_json
from bench.scenarios.base import Data, OfRedis, Scenario, Target

SECONDS = 10.0


def run(ceiling: float) -> None:
    """The engine loop thread's and the whole worker's CPU over SECONDS of no jobs (the
    Redis rate is not used)."""
    idle = {"scenario": "idle", "seconds": SECONDS, **asyncio.run(idle_cpu(SECONDS))}
    write_json("idle", idle)
    print(
        f"{'idle':>10}: engine loop thread {idle['looper_cpu_pct']:.2f}% of a core,"
        f" whole worker {idle['process_cpu_pct']:.2f}%"
    )


def row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    return f"no jobs for {r['seconds']:.0f} s", (
        f"engine loop thread **{r['looper_cpu_pct']:.2f} %** of a core, whole worker"
        f" {r['process_cpu_pct']:.2f} %"
    )


SCENARIO = Scenario("idle", run, "idle", row, Target("<= 2 %", lambda r: r["looper_cpu_pct"] <= 2))
