"""Engine statistics as Prometheus gauges, read at scrape time from the looper's latest
sample (so no task copies them around)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from trtllm_worker.engine.base import EngineStats


class EngineStatsCollector(Collector):
    """Gauges for the worker's registry; `source` returns the latest sample."""

    def __init__(self, source: Callable[[], EngineStats]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        stats = self._source()
        values = {
            "worker_engine_active_requests": (
                "Requests the engine is running",
                stats.active_requests,
            ),
            "worker_engine_queued_requests": (
                "Requests waiting inside the engine",
                stats.queued_requests,
            ),
            "worker_engine_step_seconds": (
                "Duration of the engine's latest step",
                stats.step_time_s,
            ),
            "worker_engine_kv_cache_used_blocks": (
                "KV-cache blocks in use",
                stats.kv_cache_used_blocks,
            ),
            "worker_engine_kv_cache_max_blocks": (
                "KV-cache blocks in all",
                stats.kv_cache_max_blocks,
            ),
        }
        if stats.kv_cache_used_blocks is not None and stats.kv_cache_max_blocks:
            values["worker_engine_kv_cache_usage_ratio"] = (
                "Fraction of the KV cache in use",
                stats.kv_cache_used_blocks / stats.kv_cache_max_blocks,
            )
        for name, (documentation, value) in values.items():
            if value is not None:
                yield GaugeMetricFamily(name, documentation, value=value)
