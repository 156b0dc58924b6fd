"""Traces: one span per job, built when its message is settled from timings the worker
takes on the way anyway (no span per token, nothing live while the job runs: a span
costs the event loop once per job). OpenTelemetry is imported only when the standard
variables ask for traces (`OTEL_EXPORTER_OTLP_ENDPOINT`); without them this module is
all there is, and a job's trace is None."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from worker.contract.errors import ConfigError

if TYPE_CHECKING:
    from worker.contract.errors import WorkerError
    from worker.contract.job import Job

AttributeValue = str | int | float | bool | tuple[str, ...]
Attributes = dict[str, AttributeValue]

# Event names, in the order a job meets them (the README's observability section).
RECEIVED = "received"
"""The worker took the message: the queue wait ends (it began at the span's start)."""
INTAKE = "intake done"
"""Validated, leased, chat template rendered, tokenized."""
RESUMED = "resumed"
"""An earlier attempt stored tokens; this one continues after them."""
SUBMITTED = "submitted to engine"
"""Handed to the engine thread; the engine schedules it when it has a free slot."""
FIRST_TOKEN = "first token"
"""The first token entry is stored: what a subscriber sees first."""
TERMINAL = "terminal entry"
"""The `done` or `error` entry is stored."""
DEAD_LETTERED = "dead-lettered"
HANDED_BACK = "handed back"

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class JobTrace:
    """What happened to one job, as the worker saw it: monotonic times and attributes,
    turned into one span by `Tracing.finish`."""

    __slots__ = ("_mono", "_wall_ns", "attributes", "carrier", "events", "name", "published_ns")

    def __init__(
        self, carrier: dict[str, str], published_ns: int | None, received_at: float
    ) -> None:
        self.carrier = carrier
        """The message's trace headers (`traceparent`, `tracestate`, …)."""
        self._wall_ns = time.time_ns()
        self._mono = received_at
        self.published_ns = None if published_ns is None else min(published_ns, self._wall_ns)
        self.name = ""
        self.attributes: Attributes = {}
        self.events: list[tuple[str, float, Attributes | None]] = [(RECEIVED, received_at, None)]

    def event(
        self, name: str, at: float | None = None, attributes: Attributes | None = None
    ) -> None:
        """Record `name` at monotonic time `at` (now when None)."""
        self.events.append((name, time.monotonic() if at is None else at, attributes))

    def wall_ns(self, at: float) -> int:
        """A monotonic time of this job as nanoseconds since the epoch."""
        return self._wall_ns + int((at - self._mono) * 1e9)

    @property
    def start_ns(self) -> int:
        """When the job's life began: its publication when the message says, else its
        receipt."""
        return self._wall_ns if self.published_ns is None else self.published_ns


def begin_trace(
    headers: Mapping[str, Any] | None,
    published_ns: int | None,
    received_at: float,
    queue: str,
    message_id: str | None,
) -> JobTrace:
    """A job's trace from its message: named after the queue until the job is read."""
    trace = JobTrace(trace_carrier(headers), published_ns, received_at)
    trace.name = f"process {queue}"
    attributes = trace.attributes
    attributes["messaging.system"] = "rabbitmq"
    attributes["messaging.operation.type"] = "process"
    attributes["messaging.destination.name"] = queue
    if message_id:
        attributes["messaging.message.id"] = message_id
    return trace


def describe_job(trace: JobTrace, job: Job, model: str) -> None:
    """Name the span as OpenTelemetry's GenAI conventions do (`{operation} {model}`)."""
    operation = "text_completion" if job.messages is None else "chat"
    trace.name = f"{operation} {model}"
    attributes = trace.attributes
    attributes["gen_ai.operation.name"] = operation
    attributes["gen_ai.request.model"] = model
    attributes["trtllm_worker.request_id"] = job.request_id
    params = job.parameters
    if params.temperature is not None:
        attributes["gen_ai.request.temperature"] = params.temperature
    if params.top_p is not None:
        attributes["gen_ai.request.top_p"] = params.top_p
    if params.top_k is not None:
        attributes["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None and params.seed < 2**63:  # OTLP integers are 64-bit signed
        attributes["gen_ai.request.seed"] = params.seed
    if params.stop:
        attributes["gen_ai.request.stop_sequences"] = tuple(params.stop)


class Tracing(Protocol):
    """Where finished job traces go (the OpenTelemetry SDK's batch processor)."""

    description: str
    """Protocol and endpoint, for the startup line."""

    def finish(self, trace: JobTrace, error: WorkerError | None = None) -> None: ...

    def close(self) -> None: ...


def trace_carrier(headers: Mapping[str, Any] | None) -> dict[str, str]:
    """The text headers of a message, as a propagator reads them (AMQP headers may
    arrive as bytes)."""
    if not headers:
        return {}
    carrier: dict[str, str] = {}
    for key, value in headers.items():
        if isinstance(value, str):
            carrier[key] = value
        elif isinstance(value, bytes):
            carrier[key] = value.decode("utf-8", "replace")
    return carrier


def tracing_enabled(environ: Mapping[str, str]) -> bool:
    """True when the standard variables ask for traces: an OTLP endpoint set, the SDK
    not disabled and the traces exporter not `none`."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if exporter == "none":
        return False
    if not any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES):
        return False
    if exporter != "otlp":
        raise ConfigError(
            f"invalid setting OTEL_TRACES_EXPORTER={exporter!r}: the worker exports "
            "traces over OTLP only (otlp, or none to turn traces off)"
        )
    return True
