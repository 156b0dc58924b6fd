"""The scenarios of one worker through one workload: throughput, latency, realistic,
short and soak; each leaves <name>.json and <name>.png."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bench import settings
from bench.harness import Workload, run_workload
from bench.report import plot, summary, write_json
from bench.scenarios.base import Data, OfRedis, Scenario, Target

THROUGHPUT = Workload("throughput", 256, 256, 0, 256, 256, "256 streams x 256 tokens, 0 ms step")
LATENCY = Workload("latency", 200, 16, 0, 1, 1, "one stream at a time, 0 ms step")
REALISTIC = Workload("realistic", 64, 512, 20, 64, 64, "64 streams x 512 tokens, 20 ms step")
SHORT = Workload("short", 5000, 1, 0, 256, 5000, "a backlog of 5,000 jobs of 1 token", prefill=True)
SOAK = Workload("soak", 100_000, 1, 0, 256, 2000, "100,000 jobs of 1 token: RSS growth")


def runner(workload: Workload) -> Callable[[float], None]:
    def run(ceiling: float) -> None:
        result = asyncio.run(run_workload(workload, ceiling))
        write_json(workload.name, summary(result))
        plot(result, settings.RESULTS / f"{workload.name}.png")
        print(
            f"{workload.name:>10}: {result.tokens_per_s:>10,.0f} tokens/s"
            f" ({result.ratio:.2f} of Redis)  {result.jobs_per_s:>8,.0f} jobs/s"
            f"  TTFT p50 {result.ttft_ms_p50:.2f} ms p99 {result.ttft_ms_p99:.2f} ms"
            f"  emit p99 {result.emit_ms_p99} ms  CPU {result.cpu_s_per_1000_tokens:.4f} s/1k"
            f" tokens  RSS peak {result.rss_peak_mib:.0f} MiB"
            f" (+{result.rss_growth_pct:.1f}% after warm-up)"
        )

    return run


def throughput_row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    return r["description"], (
        f"**{r['tokens_per_s']:,.0f} tokens/s** ({of_redis(r['tokens_per_s'])});"
        f" {r['cpu_s_per_1000_tokens'] * 1000:.1f} CPU-ms per 1k tokens"
    )


def short_row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    return r["description"], (
        f"**{r['jobs_per_s']:,.0f} jobs/s** ({of_redis(r['jobs_per_s'])});"
        f" {r['cpu_s_per_1000_tokens']:.2f} CPU-ms per job"
    )


def latency_row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    return r["description"], (
        f"publish -> first token entry **{r['ttft_ms_p50']:.2f} ms p50,"
        f" {r['ttft_ms_p99']:.2f} ms p99**"
    )


def realistic_row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    return r["description"], (
        f"{r['tokens_per_s']:,.0f} tokens/s (the engine's pace); engine -> readable entry"
        f" **{r['emit_ms_p50']} ms p50, {r['emit_ms_p99']} ms p99**"
    )


def soak_row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    return r["description"], (
        f"{r['jobs_per_s']:,.0f} jobs/s ({of_redis(r['jobs_per_s'])}); RSS"
        f" **{r['rss_growth_pct']:+.1f} %** after warm-up (peak {r['rss_peak_mib']:.0f} MiB)"
    )


def _single(
    workload: Workload, row: Callable[[Data, OfRedis], tuple[str, str]], target: Target
) -> Scenario:
    return Scenario(workload.name, runner(workload), workload.name, row, target)


THROUGHPUT_SCENARIO = _single(
    THROUGHPUT,
    throughput_row,
    # the share of Redis' own XADD rate, measured in the same run
    Target(">= 0.25 x Redis", lambda r: r["tokens_per_s"] / r["redis_xadd_per_s"] >= 0.25),
)
LATENCY_SCENARIO = _single(
    LATENCY,
    latency_row,
    Target("<= 2 / <= 10 ms", lambda r: r["ttft_ms_p50"] <= 2 and r["ttft_ms_p99"] <= 10),
)
REALISTIC_SCENARIO = _single(
    REALISTIC,
    realistic_row,
    Target("<= 2 ms p99", lambda r: r["emit_ms_p99"] is not None and r["emit_ms_p99"] <= 2),
)
SHORT_SCENARIO = _single(
    SHORT, short_row, Target(">= 3,000 jobs/s", lambda r: r["jobs_per_s"] >= 3000)
)
SOAK_SCENARIO = _single(SOAK, soak_row, Target("<= 5 %", lambda r: r["rss_growth_pct"] <= 5))
