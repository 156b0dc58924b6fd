"""The throughput workload on a local 3-master Redis Cluster against the single node,
same run; leaves cluster.json."""

from __future__ import annotations

import asyncio
import dataclasses

from bench.harness import Result, Workload, run_workload
from bench.report import mean_of, summary, write_json
from bench.scenarios.base import Data, OfRedis, Scenario, Target
from bench.services import local_redis_cluster

WORKLOAD = Workload(
    "cluster",
    256,
    1024,
    0,
    256,
    256,
    "throughput on a local 3-master Redis Cluster vs. the single node, same run",
)
FIGURES = ("tokens_per_s", "cpu_s_per_1000_tokens", "ttft_ms_p50", "ttft_ms_p99")


def run(ceiling: float) -> None:
    """The workload on the single Redis node and on a local 3-master Redis Cluster whose
    nodes share this machine's cores, in the order single, cluster, cluster, single (a
    drift of the machine's speed over the run cancels out); the subscriber reads one
    stream per XREAD every time, as a cluster requires."""
    single: list[Result] = []
    clustered: list[Result] = []
    with local_redis_cluster() as url:
        for where in ("single", "cluster", "cluster", "single"):
            if where == "single":
                named = dataclasses.replace(WORKLOAD, name="cluster-single")
                single.append(asyncio.run(run_workload(named, ceiling, per_key=True)))
            else:
                clustered.append(asyncio.run(run_workload(WORKLOAD, ceiling, redis_url=url)))
    on_single, on_cluster = mean_of(single, FIGURES), mean_of(clustered, FIGURES)
    ratio = on_cluster["tokens_per_s"] / on_single["tokens_per_s"]
    data = {
        "scenario": WORKLOAD.name,
        "description": WORKLOAD.description,
        "single_node": on_single,
        "cluster": on_cluster,
        "runs": {
            "single_node": [summary(r) for r in single],
            "cluster": [summary(r) for r in clustered],
        },
        "redis_xadd_per_s": round(ceiling, 1),
        "cluster_vs_single": round(ratio, 3),
    }
    write_json("cluster", data)
    print(
        f"{WORKLOAD.name:>10}: {on_cluster['tokens_per_s']:>10,.0f} tokens/s on 3 masters"
        f" vs {on_single['tokens_per_s']:,.0f} on one node ({ratio:.2f} x); CPU"
        f" {on_cluster['cpu_s_per_1000_tokens']:.4f} vs"
        f" {on_single['cpu_s_per_1000_tokens']:.4f} s/1k tokens (2 runs each)"
    )


def row(r: Data, of_redis: OfRedis) -> tuple[str, str]:
    return r["description"], (
        f"**{r['cluster_vs_single']:.2f} x** the single node's tokens/s"
        f" ({r['cluster']['tokens_per_s']:,.0f}, {of_redis(r['cluster']['tokens_per_s'])})"
    )


SCENARIO = Scenario(
    "cluster", run, "cluster", row, Target(">= 0.8 x", lambda r: r["cluster_vs_single"] >= 0.8)
)
