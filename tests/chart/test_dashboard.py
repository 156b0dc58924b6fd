"""The Grafana dashboard shows the worker's and the gateway's metrics, under their real
names."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.chart.support import DASHBOARD
from trtllm_worker.engine.base import EngineStats
from trtllm_worker.engine.stats import EngineStatsCollector
from trtllm_worker.gateway.metrics import GatewayMetrics
from trtllm_worker.ops.metrics import Metrics

Panel = dict[str, Any]


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return dashboard


def panels(dashboard: dict[str, Any]) -> Iterator[Panel]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def worker_families() -> dict[str, str]:
    """Every metric family the worker exposes, with its type (engine statistics included,
    as an engine that reports all of them shows them)."""
    families: dict[str, str] = {}
    for metric in Metrics().registry.collect():
        families[metric.name] = metric.type
    stats = EngineStats(
        active_requests=1,
        queued_requests=1,
        step_time_s=0.01,
        kv_cache_used_blocks=1,
        kv_cache_max_blocks=2,
    )
    for metric in EngineStatsCollector(lambda: stats).collect():
        families[metric.name] = metric.type
    return families


def series_names(families: dict[str, str]) -> set[str]:
    """The names of the series Prometheus stores for those families."""
    names: set[str] = set()
    for name, kind in families.items():
        if kind == "counter":
            names.add(f"{name}_total")
        elif kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


def gateway_families() -> dict[str, str]:
    return {metric.name: metric.type for metric in GatewayMetrics().registry.collect()}


METRIC = re.compile(r"\b(worker_[a-z0-9_]+)\b")
GATEWAY_METRIC = re.compile(r"\b(trtllm_gateway_[a-z0-9_]+)\b")


def test_dashboard_basics() -> None:
    dashboard = load()
    assert dashboard["uid"] == "trtllm-worker"
    assert dashboard["title"] == "trtllm-worker"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job", "pod"} <= set(variables)


def test_panels_fit_the_grid_without_overlapping() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in panels(load()):
        grid = panel["gridPos"]
        assert grid["x"] >= 0
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells


def test_every_query_uses_the_datasource_and_filters() -> None:
    for panel in panels(load()):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), expr
            assert expr.count("{") == expr.count("}"), expr
            for selector in re.findall(r"\bworker_[a-z0-9_]+\{([^}]*)\}", expr):
                assert 'pod=~"$pod"' in selector, expr
            # the gateway's pods are not the workers' ($job and $pod list those)
            for selector in re.findall(r"trtllm_gateway_[a-z0-9_]+\{([^}]*)\}", expr):
                assert selector == 'namespace=~"$namespace"', expr
            for window in re.findall(r"\[([^\]]+)\]", expr):
                assert window == "$__rate_interval", expr


def test_queries_name_only_real_metrics() -> None:
    known = series_names(worker_families())
    used = {name for expr in expressions(load()) for name in METRIC.findall(expr)}
    assert used, "the dashboard queries nothing"
    unknown = sorted(used - known)
    assert not unknown, f"the worker exposes no {unknown}"


def test_every_metric_of_the_worker_has_a_panel() -> None:
    text = " ".join(expressions(load()))
    missing = [
        name
        for name, kind in sorted(worker_families().items())
        if not any(series in text for series in series_names({name: kind}))
    ]
    assert not missing, f"add panels to {DASHBOARD.name} for {missing}"


def test_queries_name_only_real_gateway_metrics() -> None:
    known = series_names(gateway_families())
    used = {name for expr in expressions(load()) for name in GATEWAY_METRIC.findall(expr)}
    assert used, "the dashboard queries nothing of the gateway"
    unknown = sorted(used - known)
    assert not unknown, f"the gateway exposes no {unknown}"


def test_every_metric_of_the_gateway_has_a_panel() -> None:
    text = " ".join(expressions(load()))
    missing = [
        name
        for name, kind in sorted(gateway_families().items())
        if not any(series in text for series in series_names({name: kind}))
    ]
    assert not missing, f"add panels to {DASHBOARD.name} for {missing}"


@pytest.mark.parametrize(
    "family", ["worker_time_to_first_token_seconds", "worker_job_duration_seconds"]
)
def test_latency_quantiles_come_from_histograms(family: str) -> None:
    exprs = [e for e in expressions(load()) if family in e and "histogram_quantile" in e]
    assert exprs, family
    for expr in exprs:
        assert f"{family}_bucket" in expr
        assert "by (le" in expr
