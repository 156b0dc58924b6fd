"""Every scenario of the bench, in the one table `make bench` runs them from."""

from __future__ import annotations

from bench.scenarios import (
    baseline,
    batch,
    cluster,
    gateway,
    idle,
    multitoken,
    single,
    sweeps,
    tiers,
    tracing,
)
from bench.scenarios.base import Scenario, Target

__all__ = ["REGISTRY", "SUMMARY_ORDER", "Scenario", "Target"]

REGISTRY: dict[str, Scenario] = {
    s.name: s
    for s in (
        single.THROUGHPUT_SCENARIO,
        single.LATENCY_SCENARIO,
        single.REALISTIC_SCENARIO,
        single.SHORT_SCENARIO,
        single.SOAK_SCENARIO,
        multitoken.SCENARIO,
        baseline.SCENARIO,
        tracing.SCENARIO,
        cluster.SCENARIO,
        sweeps.STREAMS,
        sweeps.LENGTH,
        tiers.SCENARIO,
        tiers.QUORUM_SCENARIO,
        tiers.COST_SCENARIO,
        batch.SCENARIO,
        gateway.SCENARIO,
        idle.SCENARIO,
    )
}
"""By name, in the order `make bench` runs them (every one unless named)."""

SUMMARY_ORDER = (
    "throughput", "baseline", "short", "latency", "realistic", "soak", "multitoken",
    "cluster", "streams", "length", "tracing", "tiers", "tiers-quorum", "tiers-cost",
    "batch", "gateway", "idle",
)  # fmt: skip
"""The rows of SUMMARY.md (and of the README's table), headline figures first."""
