"""What a run leaves in bench/results/: each scenario's JSON, its plots, and SUMMARY.md
(the README's performance table, a row per scenario with its target)."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import settings
from bench.harness import Result

if TYPE_CHECKING:
    from bench.scenarios.base import Scenario


def summary(result: Result) -> dict[str, Any]:
    """A result as its JSON holds it: without the per-job series the plots are made of."""
    return {k: v for k, v in asdict(result).items() if k not in ("ttft_ms", "tokens_over_time")}


def median_of(runs: list[Result], figures: tuple[str, ...]) -> dict[str, float]:
    return {f: round(statistics.median(float(getattr(r, f)) for r in runs), 4) for f in figures}


def mean_of(runs: list[Result], figures: tuple[str, ...]) -> dict[str, float]:
    return {f: round(sum(float(getattr(r, f)) for r in runs) / len(runs), 4) for f in figures}


def write_json(name: str, data: dict[str, Any]) -> None:
    (settings.RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")


def load(name: str) -> dict[str, Any] | None:
    path = settings.RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: Result, path: Path) -> None:
    """Time to first token (CDF) and token entries read over time, side by side."""
    plt = _pyplot()
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


def plot_sweep(
    name: str, what: str, points: Sequence[tuple[int, Result]], ceiling: float, path: Path
) -> None:
    """tokens/s, CPU per token, TTFT and peak RSS against the swept quantity (`what`)."""
    plt = _pyplot()
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
        axis.set_xlabel(what.split(" (")[0])
        axis.set_title(label)
        axis.grid(True, which="both", alpha=0.3)
    figure.suptitle(f"sweep: {what}; redis-benchmark XADD {ceiling:,.0f}/s")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def summary_rows(ceiling: float, scenarios: Iterable[Scenario]) -> Iterator[str]:
    """A row for each scenario whose results are in bench/results/, every rate also as a
    share of the redis-benchmark XADD rate measured in the run that produced it (a
    scenario not run this time keeps its own ratio); `ceiling` where a result lacks one."""
    for scenario in scenarios:
        if data := load(scenario.results):
            own = float(data.get("redis_xadd_per_s") or ceiling)

            def of_redis(rate: float, own: float = own) -> str:
                return f"{rate / own:.4f} x Redis"

            what, result = scenario.row(data, of_redis)
            yield f"| {scenario.label} | {what} | {result} | {scenario.target.text} |"


def write_summary(ceiling: float, scenarios: Iterable[Scenario]) -> Path:
    """The README's performance table, from this run's results (bench/results/*.json):
    every rate with its ratio to redis-benchmark's XADD rate measured at the start."""
    text = (
        f"redis-benchmark pipelined XADD in the latest run: **{ceiling:,.0f}/s**"
        f" ({os.cpu_count()} cores); each row's `x Redis` is against the rate measured in"
        " the run that produced it\n\n"
        "| scenario | what | result | target |\n| --- | --- | --- | --- |\n"
        + "\n".join(summary_rows(ceiling, scenarios))
        + "\n"
    )
    path = settings.RESULTS / "SUMMARY.md"
    path.write_text(text)
    return path


def verdicts(scenarios: Iterable[Scenario]) -> Iterator[str]:
    """Each scenario with results against its target: met, missed, or (a sweep's curves)
    nothing to judge."""
    for scenario in scenarios:
        if (data := load(scenario.results)) is not None:
            met = scenario.target.met(data) if scenario.target.met else None
            mark = {True: "met", False: "missed", None: "not judged"}[met]
            yield f"{scenario.label}: {mark} ({scenario.target.text})"
