"""This code against the code before the performance work (`settings.BASELINE_REF`):
CPU per token and short jobs/s, same run; leaves baseline.json."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from bench.harness import Result, Workload, run_workload
from bench.report import mean_of, summary, write_json
from bench.scenarios.base import Data, OfRedis, Scenario, Target
from bench.scenarios.single import SHORT
from bench.services import checkout
from bench.settings import BASELINE_REF

TOKENS = Workload(
    "baseline",
    256,
    1024,
    0,
    256,
    256,
    f"256 streams x 1,024 tokens and 5,000 jobs of 1 token, this code vs."
    f" {BASELINE_REF[:12]}, same run",
)
FIGURES = (
    "tokens_per_s", "jobs_per_s", "cpu_s_per_1000_tokens",
    "engine_thread_cpu_s_per_1000_tokens", "ttft_ms_p50", "ttft_ms_p99",
)  # fmt: skip


def _abba(shape: Workload, source: Path, ceiling: float) -> dict[str, Any]:
    """`shape` on the baseline's code and on this one, in the order baseline, this, this,
    baseline (a drift of the machine's speed over the run cancels out)."""
    runs: dict[str, list[Result]] = {"baseline": [], "current": []}
    for which in ("baseline", "current", "current", "baseline"):
        named = dataclasses.replace(
            shape,
            name=f"{TOKENS.name}-{shape.name}-{which}",
            source=source if which == "baseline" else None,
        )
        runs[which].append(asyncio.run(run_workload(named, ceiling)))
    part: dict[str, Any] = {which: mean_of(results, FIGURES) for which, results in runs.items()}
    part["runs"] = {which: [summary(r) for r in results] for which, results in runs.items()}
    return part


def _own(part: Data) -> float:
    """CPU per 1k tokens without the engine thread (the GPU's stand-in)."""
    return float(part["cpu_s_per_1000_tokens"] - part["engine_thread_cpu_s_per_1000_tokens"])


def run(ceiling: float) -> None:
    """CPU per token and short jobs/s of this code and of `BASELINE_REF`, each run twice
    in the order baseline, this, this, baseline."""
    data: dict[str, Any] = {
        "scenario": TOKENS.name,
        "description": TOKENS.description,
        "baseline_ref": BASELINE_REF,
        "redis_xadd_per_s": round(ceiling, 1),
    }
    with checkout(BASELINE_REF) as source:
        data["tokens"] = _abba(TOKENS, source, ceiling)
        data["short"] = _abba(SHORT, source, ceiling)
    tokens, jobs = data["tokens"], data["short"]
    cpu = tokens["current"]["cpu_s_per_1000_tokens"] / tokens["baseline"]["cpu_s_per_1000_tokens"]
    data["cpu_per_token_vs_baseline"] = round(cpu, 3)
    own_ratio = _own(tokens["current"]) / _own(tokens["baseline"])
    data["cpu_per_token_without_engine_thread_vs_baseline"] = round(own_ratio, 3)
    data["short_jobs_vs_baseline"] = round(
        jobs["current"]["jobs_per_s"] / jobs["baseline"]["jobs_per_s"], 3
    )
    write_json("baseline", data)
    print(
        f"{TOKENS.name:>10}: CPU {tokens['current']['cpu_s_per_1000_tokens'] * 1000:.2f} vs"
        f" {tokens['baseline']['cpu_s_per_1000_tokens'] * 1000:.2f} ms per 1k tokens"
        f" ({cpu:.2f} x of {BASELINE_REF[:12]}; without the engine thread"
        f" {_own(tokens['current']) * 1000:.2f} vs {_own(tokens['baseline']) * 1000:.2f},"
        f" {own_ratio:.2f} x); {tokens['current']['tokens_per_s']:,.0f} vs"
        f" {tokens['baseline']['tokens_per_s']:,.0f} tokens/s; short"
        f" {jobs['current']['jobs_per_s']:,.0f} vs {jobs['baseline']['jobs_per_s']:,.0f} jobs/s"
    )


def row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    t, j = r["tokens"], r["short"]
    now, then = t["current"], t["baseline"]
    what = (
        f"this code vs. `{r['baseline_ref'][:12]}` (before this work), 256 streams x 1,024"
        " tokens and the short backlog, ABBA"
    )
    return what, (
        f"CPU per token **{r['cpu_per_token_vs_baseline']:.2f} x**"
        f" ({now['cpu_s_per_1000_tokens'] * 1000:.1f} vs"
        f" {then['cpu_s_per_1000_tokens'] * 1000:.1f} ms per 1k tokens); without the"
        " engine thread (the echo engine)"
        f" **{r['cpu_per_token_without_engine_thread_vs_baseline']:.2f} x**;"
        f" {now['tokens_per_s']:,.0f} vs {then['tokens_per_s']:,.0f} tokens/s"
        f" ({of_redis(now['tokens_per_s'])} vs {of_redis(then['tokens_per_s'])}); short"
        f" {j['current']['jobs_per_s']:,.0f} vs {j['baseline']['jobs_per_s']:,.0f} jobs/s"
    )


SCENARIO = Scenario(
    "baseline",
    run,
    "baseline",
    row,
    Target("CPU <= 0.5 x", lambda r: r["cpu_per_token_vs_baseline"] <= 0.5),
)
