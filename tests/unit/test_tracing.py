"""Traces: which variables switch them on, and a job's packed trace as the exporter
process turns it into a span (the SDK's own in-memory exporter receives it)."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from trtllm_worker.contract.errors import ConfigError, InvalidJob
from trtllm_worker.ops import otel
from trtllm_worker.ops.tracing import (
    INTAKE,
    TERMINAL,
    begin_trace,
    protocol_of,
    tracing_enabled,
)

URL = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}


@pytest.mark.parametrize(
    ("environ", "enabled"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
        (URL, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
        ({**URL, "OTEL_SDK_DISABLED": "TRUE"}, False),
        ({**URL, "OTEL_SDK_DISABLED": "false"}, True),
        ({**URL, "OTEL_TRACES_EXPORTER": "none"}, False),
        ({**URL, "OTEL_TRACES_EXPORTER": "otlp"}, True),
    ],
)
def test_the_standard_variables_switch_traces(environ: dict[str, str], enabled: bool) -> None:
    assert tracing_enabled(environ) is enabled


def test_an_exporter_other_than_otlp_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='console'"):
        tracing_enabled({**URL, "OTEL_TRACES_EXPORTER": "console"})


def test_protocols() -> None:
    assert protocol_of({}) == "http/protobuf"  # the specification's default
    assert protocol_of({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    both = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    }
    assert protocol_of(both) == "http/protobuf"  # the traces variable wins
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"):
        protocol_of({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def exported(record: bytes) -> Any:
    """The span the exporter process builds from a packed trace (its provider, its ids)."""
    exporter = InMemorySpanExporter()
    ids = otel.PresetIds()
    provider = TracerProvider(id_generator=ids)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.export(provider.get_tracer("test"), msgpack.unpackb(record), ids)
    (span,) = exporter.get_finished_spans()
    return span


def test_a_packed_trace_becomes_one_span_with_its_times() -> None:
    received_at = time.monotonic()
    published = time.time_ns() - 250_000_000  # a quarter second in the queue
    headers = {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01", "x-delivery-count": 1}
    trace = begin_trace(headers, published, received_at, "generate", "r1")
    trace.name = "chat m"
    trace.attributes["gen_ai.response.finish_reasons"] = ("stop",)
    trace.event(INTAKE, received_at + 0.01)
    trace.event(TERMINAL, received_at + 0.5, {"n": 3})
    span = exported(trace.packed(None))
    assert span.name == "chat m"
    assert span.kind is SpanKind.CONSUMER
    assert span.parent.trace_id == int("1" * 32, 16)
    assert span.parent.span_id == int("2" * 16, 16)
    assert span.start_time == published
    assert span.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert span.attributes["messaging.destination.name"] == "generate"
    assert [e.name for e in span.events] == ["received", INTAKE, TERMINAL]
    offsets = [(e.timestamp - span.events[0].timestamp) / 1e6 for e in span.events]
    assert offsets == pytest.approx([0, 10, 500], abs=0.001)  # milliseconds
    assert span.events[2].attributes == {"n": 3}
    assert span.end_time >= span.events[-1].timestamp
    assert span.status.status_code is StatusCode.UNSET


def test_a_failed_job_is_an_error_span_and_a_message_in_the_future_starts_at_receipt() -> None:
    received_at = time.monotonic()
    trace = begin_trace(None, time.time_ns() + 60 * 10**9, received_at, "q", None)
    span = exported(trace.packed(InvalidJob("max_new_tokens: too many")))
    assert span.parent is None  # no trace headers: a trace of its own
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "max_new_tokens: too many"
    assert span.start_time <= span.events[0].timestamp  # a producer's clock ahead is clamped


def test_the_engine_gets_the_job_spans_context_so_its_spans_are_children() -> None:
    """TensorRT-LLM 1.4 starts its spans under `trace_headers`: they name the job's span
    as parent, in the producer's trace, with the message's tracestate; the exporter
    process gives the job's span exactly those ids when the job ends."""
    from trtllm_worker.ops.tracing import begin_trace, trace_context

    trace_id, producer = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{producer}-01", "tracestate": b"vendor=1"}
    trace = begin_trace({**headers, "x-other": "no"}, None, time.monotonic(), "jobs", None)
    context = trace_context(trace)
    assert context is not None
    assert set(context) == {"traceparent", "tracestate"}
    assert context["tracestate"] == "vendor=1"
    version, engine_trace, engine_parent, flags = context["traceparent"].split("-")
    assert (version, engine_trace, flags) == ("00", trace_id, "01")
    assert engine_parent != producer

    span = exported(trace.packed(None))
    assert span.context.trace_id == int(trace_id, 16)
    assert span.context.span_id == int(engine_parent, 16)  # the engine's spans' parent
    assert span.parent.span_id == int(producer, 16)  # the job's span: the producer's child
    assert trace_context(None) is None


def test_a_job_without_trace_headers_still_gives_the_engine_its_span_as_parent() -> None:
    from trtllm_worker.ops.tracing import begin_trace, trace_context

    first = begin_trace({"x-other": "no"}, None, time.monotonic(), "jobs", None)
    second = begin_trace(None, None, time.monotonic(), "jobs", None)
    context = trace_context(first)
    assert context is not None
    assert set(context) == {"traceparent"}
    _, trace_id, span_id, flags = context["traceparent"].split("-")
    span = exported(first.packed(None))
    assert span.parent is None  # a trace of its own
    assert (span.context.trace_id, span.context.span_id) == (int(trace_id, 16), int(span_id, 16))
    assert flags == "01"
    assert trace_context(second) != context  # every job its own ids


def test_the_exporter_picks_ids_again_for_a_span_it_was_not_given_any_for() -> None:
    """The preset ids serve one span: whatever else the SDK asks for gets random ones."""
    ids = otel.PresetIds()
    ids.trace_id, ids.span_id = 7, 9
    assert (ids.generate_trace_id(), ids.generate_span_id()) == (7, 9)
    assert ids.generate_span_id() not in (0, 9)
    assert ids.generate_trace_id() not in (0, 7)
