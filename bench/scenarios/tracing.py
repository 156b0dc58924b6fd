"""Every job traced over OTLP, one in ten, and none, same run; leaves tracing.json."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from bench.harness import Result, Workload, run_workload
from bench.report import median_of, summary, write_json
from bench.scenarios.base import Data, OfRedis, Scenario, Target
from bench.scenarios.single import SHORT, THROUGHPUT
from bench.services import otlp_sink, sink_count
from bench.settings import TRACING_ROUNDS

NAME = "tracing"
DESCRIPTION = (
    "256 streams x 1,024 tokens and 5,000 jobs of 1 token, traced over OTLP vs. not, same run"
)
LONGER = dataclasses.replace(THROUGHPUT, tokens=1024)  # less noise
FIGURES = (
    "tokens_per_s", "jobs_per_s", "cpu_s_per_1000_tokens",
    "children_cpu_s_per_1000_tokens", "ttft_ms_p50",
)  # fmt: skip
ORDER = ("off", "on", "tenth", "tenth", "on", "off")


def _sampling(port: int) -> dict[str, tuple[tuple[str, str], ...]]:
    """The worker's environment for each way of tracing, exporting to the sink at `port`."""
    endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    return {
        "off": (),
        "on": (endpoint,),
        "tenth": (
            endpoint,
            ("OTEL_TRACES_SAMPLER", "traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.1"),
        ),
    }


def _compare(shape: Workload, port: int, ceiling: float) -> dict[str, Any]:
    """`shape` in the order of ORDER, TRACING_ROUNDS times; medians, and the spans the
    sink received after each traced run."""
    env = _sampling(port)
    runs: dict[str, list[Result]] = {"off": [], "on": [], "tenth": []}
    spans: dict[str, list[int]] = {"on": [], "tenth": []}
    for which in ORDER * TRACING_ROUNDS:
        named = dataclasses.replace(shape, name=f"{NAME}-{shape.name}-{which}", env=env[which])
        runs[which].append(asyncio.run(run_workload(named, ceiling)))
        if which != "off":  # the worker has stopped: its last batch is exported
            spans[which].append(sink_count(port)["spans"])
    part: dict[str, Any] = {w: median_of(results, FIGURES) for w, results in runs.items()}
    figure = "jobs_per_s" if shape.name == "short" else "tokens_per_s"
    part["figure"] = figure
    for which in ("on", "tenth"):
        part[f"{which}_vs_off"] = round(part[which][figure] / part["off"][figure], 3)
    part["spans_received"] = spans
    part["jobs_per_run"] = shape.streams
    part["runs"] = {w: [summary(r) for r in results] for w, results in runs.items()}
    print(
        f"{NAME:>10}: {shape.name} {figure.replace('_per_s', '/s')} traced"
        f" {part['on'][figure]:,.0f} ({part['on_vs_off']:.3f} x), one in ten"
        f" {part['tenth'][figure]:,.0f} ({part['tenth_vs_off']:.3f} x), untraced"
        f" {part['off'][figure]:,.0f}; spans received {spans} of {shape.streams} jobs"
    )
    return part


def run(ceiling: float) -> None:
    """Throughput and short jobs with every job traced (OTLP/HTTP to a local sink that
    discards, the SDK's batch processor at its defaults), with one job in ten traced
    (`OTEL_TRACES_SAMPLER=traceidratio`, 0.1) and without, in the order off, on, tenth,
    tenth, on, off; the spans the sink received are counted after each run."""
    data: dict[str, Any] = {
        "scenario": NAME,
        "description": DESCRIPTION,
        "redis_xadd_per_s": round(ceiling, 1),
    }
    with otlp_sink() as port:
        for shape in (LONGER, SHORT):
            data[shape.name] = _compare(shape, port, ceiling)
    write_json("tracing", data)


def row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    long, short = r["throughput"], r["short"]
    return f"{r['description']}, medians", (
        f"long jobs traced **{long['on_vs_off']:.2f} x**; short jobs traced"
        f" **{short['on_vs_off']:.2f} x**, one in ten traced {short['tenth_vs_off']:.2f} x"
    )


SCENARIO = Scenario(
    NAME,
    run,
    "tracing",
    row,
    Target(
        ">= 0.95 x",
        lambda r: r["throughput"]["on_vs_off"] >= 0.95 and r["short"]["on_vs_off"] >= 0.95,
    ),
)
