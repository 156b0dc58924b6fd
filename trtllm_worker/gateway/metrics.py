"""The gateway's Prometheus metrics, on a registry of its own (`/metrics`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FIRST_BYTE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "trtllm_gateway_requests",
            "HTTP requests answered, by route and status code",
            ["route", "status"],
            registry=self.registry,
        )
        self.streams_open = Gauge(
            "trtllm_gateway_streams_open",
            "server-sent event responses open now (streamed answers and /v1/streams)",
            registry=self.registry,
        )
        self.first_byte = Histogram(
            "trtllm_gateway_time_to_first_token_seconds",
            "from a completion request's arrival to its first generated text sent",
            ["route"],
            buckets=FIRST_BYTE_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "trtllm_gateway_tokens_relayed",
            "generated tokens relayed to clients (streamed or whole)",
            registry=self.registry,
        )
        self.cancelled = Counter(
            "trtllm_gateway_jobs_cancelled",
            "jobs cancelled because nobody could read their answer: the client went away "
            "before it ended, or Redis was lost before a whole answer was in",
            registry=self.registry,
        )
        self.refused = Counter(
            "trtllm_gateway_refused",
            "requests refused for back-pressure (429) or unreachable services (503)",
            ["reason"],
            registry=self.registry,
        )
