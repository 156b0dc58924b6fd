"""Several tokens per engine step (as speculative decoding and MTP hand over) against one,
the same number of steps, same run; leaves multitoken.json."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from bench.harness import Result, Workload, run_workload
from bench.report import mean_of, summary, write_json
from bench.scenarios.base import Data, OfRedis, Scenario, Target

SEVERAL = Workload(
    "multitoken",
    256,
    1024,
    0,
    256,
    256,
    "256 streams x 256 steps of 4 tokens vs. 256 steps of 1 token, same run",
    tokens_per_step=4,
)
FIGURES = ("tokens_per_s", "cpu_s_per_1000_tokens", "ttft_ms_p50", "ttft_ms_p99")


def run(ceiling: float) -> None:
    """The same number of engine steps with several tokens per step and with one, in the
    order one, several, several, one."""
    one = dataclasses.replace(
        SEVERAL, name="multitoken-1", tokens=SEVERAL.tokens // SEVERAL.tokens_per_step,
        tokens_per_step=1,
    )  # fmt: skip
    several = SEVERAL.tokens_per_step
    results: dict[int, list[Result]] = {1: [], several: []}
    for each in (one, SEVERAL, SEVERAL, one):
        results[each.tokens_per_step].append(asyncio.run(run_workload(each, ceiling)))
    data: dict[str, Any] = {
        "scenario": SEVERAL.name,
        "description": SEVERAL.description,
        "one_per_step": mean_of(results[1], FIGURES),
        f"{several}_per_step": mean_of(results[several], FIGURES),
        "runs": {str(k): [summary(r) for r in v] for k, v in results.items()},
        "redis_xadd_per_s": round(ceiling, 1),
    }
    gain = data[f"{several}_per_step"]["tokens_per_s"] / data["one_per_step"]["tokens_per_s"]
    data["gain"] = round(gain, 3)
    write_json("multitoken", data)
    print(
        f"{SEVERAL.name:>10}: {data[f'{several}_per_step']['tokens_per_s']:>10,.0f} tokens/s at"
        f" {several} per step vs {data['one_per_step']['tokens_per_s']:,.0f} at 1 ({gain:.2f} x)"
    )


def row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    four, one = r["4_per_step"], r["one_per_step"]
    return r["description"], (
        f"**{r['gain']:.2f} x** the tokens/s of 1 per step ({four['tokens_per_s']:,.0f},"
        f" {of_redis(four['tokens_per_s'])}, vs {one['tokens_per_s']:,.0f})"
    )


SCENARIO = Scenario(
    "multitoken", run, "multitoken", row, Target(">= 1.5 x", lambda r: r["gain"] >= 1.5)
)
