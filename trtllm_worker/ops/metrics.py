"""Every Prometheus metric of the worker, on a registry of its own (so several workers
can live in one process, as they do in tests). Updated per batch, never per token."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_FINE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    1,
)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """The worker's metric families."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._by_class: dict[tuple[str, str], Histogram] = {}
        r = self.registry
        self.jobs = Counter(
            "worker_jobs_total",
            "Jobs by outcome: done:<finish_reason>, error:<code>, dead_lettered, skipped",
            ["outcome"],
            registry=r,
        )
        self.paused = Counter(
            "worker_jobs_paused_total",
            "Running jobs paused (back to the queue, uncounted) for a job of higher priority",
            registry=r,
        )
        self.given_back = Counter(
            "worker_jobs_given_back_total",
            "Jobs given back to the queue unstarted, so that a full worker sees interactive jobs",
            registry=r,
        )
        self.resumed = Counter(
            "worker_jobs_resumed_total",
            "Jobs that continued a stream an earlier attempt began",
            registry=r,
        )
        self.generated_tokens = Counter(
            "worker_generated_tokens_total", "Token entries published", registry=r
        )
        self.input_tokens = Counter(
            "worker_input_tokens_total", "Prompt tokens of the jobs that ran", registry=r
        )
        self.in_flight = Gauge("worker_in_flight_requests", "Requests in the engine", registry=r)
        self.capacity = Gauge(
            "worker_capacity_requests", "Requests the engine runs at once", registry=r
        )
        self.ttft = Histogram(
            "worker_time_to_first_token_seconds",
            "From taking a job to storing its first token entry, by priority class",
            ["priority_class"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.job_duration = Histogram(
            "worker_job_duration_seconds",
            "From taking a job to storing its terminal entry",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.publish_latency = Histogram(
            "worker_redis_publish_seconds",
            "Time of one Redis pipeline of a batch",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.emit_delay = Histogram(
            "worker_token_emit_delay_seconds",
            "From the engine thread having a batch of tokens to their entries being stored "
            "(readable); the batch's oldest token",
            buckets=_FINE_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "worker_queue_wait_seconds",
            "From publication (the SDK's timestamp_in_ms header, else the AMQP timestamp in "
            "whole seconds) to the worker taking the job, by priority class",
            ["priority_class"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
            registry=r,
        )
        self.inter_token = Histogram(
            "worker_inter_token_latency_seconds",
            "Time between successive batches of token entries while requests run",
            buckets=_FINE_BUCKETS,
            registry=r,
        )
        self.broker_connected = Gauge(
            "worker_broker_connected", "1 while the RabbitMQ connection is open", registry=r
        )
        self.redis_connected = Gauge("worker_redis_connected", "1 while Redis answers", registry=r)
        self.ready = Gauge("worker_ready", "1 while /readyz answers 200", registry=r)

    def by_class(self, family: Histogram, priority_class: str) -> Histogram:
        """`family`'s child for a priority class, looked up once (`labels()` validates
        and locks on every call; this runs for every job)."""
        key = (family._name, priority_class)
        child = self._by_class.get(key)
        if child is None:
            child = self._by_class[key] = family.labels(priority_class=priority_class)
        return child
