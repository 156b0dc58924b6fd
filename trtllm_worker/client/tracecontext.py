"""The W3C trace context a job carries in its headers, so that the producer's trace
continues in the worker. OpenTelemetry is optional for a producer: it is imported only
when a job is submitted, and its absence means no trace headers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trtllm_worker.contract.queues import TRACEPARENT


def trace_headers(given: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The trace context for a job's headers, so that its trace continues in the worker:
    `given` W3C headers (`traceparent`, `tracestate`), else the producer's current
    OpenTelemetry context; none when the producer has no OpenTelemetry API installed or
    no span is current (it is imported only here, at submit)."""
    if given is not None:
        traceparent = given.get("traceparent", "").strip().lower()
        if not TRACEPARENT.match(traceparent) or traceparent.startswith("ff"):
            raise ValueError(f"not a W3C traceparent: {traceparent!r}")
        headers: dict[str, Any] = {"traceparent": traceparent}
        if given.get("tracestate"):
            headers["tracestate"] = given["tracestate"].strip()
        return headers
    try:
        from opentelemetry import propagate
    except ImportError:
        return {}
    carrier: dict[str, Any] = {}
    propagate.inject(carrier)
    return carrier
