"""How cost grows: one worker per point of a swept quantity (concurrent streams, output
length); each sweep leaves sweep-<name>.json and .png."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bench import settings
from bench.harness import Workload, run_workload
from bench.report import plot_sweep, write_json
from bench.scenarios.base import Data, OfRedis, Scenario, Target

SWEEP_STREAMS = (1, 16, 64, 256, 1024)
SWEEP_LENGTHS = (16, 64, 256, 1024, 4096, 16384)
FIGURES = ("tokens_per_s", "cpu_s_per_1000_tokens", "ttft_ms_p50", "ttft_ms_p99",
           "rss_peak_mib", "jobs", "tokens")  # fmt: skip


def streams_points() -> list[tuple[int, Workload]]:
    return [
        (n, Workload(f"streams-{n}", max(n, 64), 256, 0, n, n, f"{n} concurrent streams"))
        for n in SWEEP_STREAMS
    ]


def length_points() -> list[tuple[int, Workload]]:
    return [
        (
            length,
            Workload(
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


def sweeper(
    name: str, what: str, points: Callable[[], list[tuple[int, Workload]]]
) -> Callable[[float], None]:
    def run(ceiling: float) -> None:
        """tokens/s, CPU per token, TTFT and peak RSS against the swept quantity, in
        bench/results/sweep-<name>.json and .png."""
        results = [(x, asyncio.run(run_workload(w, ceiling))) for x, w in points()]
        data = {
            "sweep": name,
            "description": what,
            "redis_xadd_per_s": round(ceiling, 1),
            "points": [{"x": x, **{f: getattr(r, f) for f in FIGURES}} for x, r in results],
        }
        write_json(f"sweep-{name}", data)
        plot_sweep(name, what, results, ceiling, settings.RESULTS / f"sweep-{name}.png")
        for x, r in results:
            print(
                f"{name:>10} {x:>6}: {r.tokens_per_s:>9,.0f} tokens/s ({r.ratio:.3f} of Redis)"
                f"  CPU {r.cpu_s_per_1000_tokens * 1000:.2f} ms/1k  TTFT p50 {r.ttft_ms_p50:.1f}"
                f" p99 {r.ttft_ms_p99:.1f} ms  RSS {r.rss_peak_mib:.0f} MiB"
            )

    return run


def row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    points = ", ".join(
        f"{p['x']}: {p['tokens_per_s']:,.0f} ({of_redis(p['tokens_per_s'])})" for p in r["points"]
    )
    return r["description"], f"tokens/s at {points}; `bench/results/sweep-{r['sweep']}.png`"


def _sweep(name: str, what: str, points: Callable[[], list[tuple[int, Workload]]]) -> Scenario:
    return Scenario(
        name,
        sweeper(name, what, points),
        f"sweep-{name}",
        row,
        Target("the curves"),  # read, not judged
        label=f"sweep {name}",
    )


STREAMS = _sweep(
    "streams", "concurrent streams (256 tokens each, at least 64 jobs)", streams_points
)
LENGTH = _sweep("length", "output length (64 concurrent streams)", length_points)
