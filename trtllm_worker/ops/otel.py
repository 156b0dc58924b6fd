"""The trace exporter process: `python -m trtllm_worker.ops.otel INSTANCE_ID`, started by the
worker when traces are asked for. It reads the worker's packed job traces from stdin,
builds each span with the OpenTelemetry SDK and exports it with the SDK's batch
processor over OTLP. Its own `OTEL_*` variables (inherited from the worker) configure
it as they would any SDK: exporter endpoint, headers, certificates, compression and
timeout, `OTEL_TRACES_SAMPLER*`, `OTEL_BSP_*`, `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_PROPAGATORS`. At end of input it exports what it has
(bounded) and exits."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgpack
from opentelemetry import propagate
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from trtllm_worker.ops.tracing import protocol_of

log = logging.getLogger("trtllm_worker.ops.otel")

SHUTDOWN_TIMEOUT_MS = 5000
READ_BYTES = 1 << 16


def _package_version() -> str:
    try:
        return version("trtllm-worker")
    except PackageNotFoundError:  # run from a source tree
        return "unknown"


def exporter_for(protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()


def resource_for(instance_id: str) -> Resource:
    """`OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` win; else the service is
    `trtllm-worker` and the instance the worker's id (host:pid:random, as in its logs)."""
    resource = Resource.create({"service.version": _package_version()})
    defaults: dict[str, str] = {}
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        defaults[SERVICE_NAME] = "trtllm-worker"
    if SERVICE_INSTANCE_ID not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        defaults[SERVICE_INSTANCE_ID] = instance_id  # the SDK's own is a random UUID
    return resource.merge(Resource(defaults)) if defaults else resource


def _attributes(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """MessagePack gives sequences back as lists; OpenTelemetry wants them immutable."""
    if value is None:
        return None
    return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}


class PresetIds(IdGenerator):
    """The ids the worker picked for the job's span (`JobTrace`), which the SDK asks its
    id generator for: an engine's spans already name this span as their parent."""

    def __init__(self) -> None:
        self._fallback = RandomIdGenerator()
        self.trace_id: int | None = None
        self.span_id: int | None = None

    def generate_trace_id(self) -> int:
        trace_id, self.trace_id = self.trace_id, None
        return trace_id or self._fallback.generate_trace_id()

    def generate_span_id(self) -> int:
        span_id, self.span_id = self.span_id, None
        return span_id or self._fallback.generate_span_id()


IDS = PresetIds()
"""The id generator of the process's tracer provider (`main`)."""


def export(tracer: Tracer, record: list[Any], ids: PresetIds = IDS) -> None:
    """One packed job trace (`JobTrace.packed`) as one span, with the ids the worker
    picked (`ids` must be the id generator of `tracer`'s provider)."""
    name, start_ns, end_ns, carrier, attributes, events, error, trace_id, span_id = record
    parent = propagate.extract(carrier) if carrier else None
    # the SDK asks for a trace id only without a valid parent, and for one span id
    ids.trace_id = int.from_bytes(trace_id, "big")
    ids.span_id = int.from_bytes(span_id, "big")
    span = tracer.start_span(
        name,
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes=_attributes(attributes),
        start_time=start_ns,
    )
    if not span.is_recording():  # not sampled
        return
    for event_name, at_ns, event_attributes in events:
        span.add_event(event_name, _attributes(event_attributes), timestamp=at_ns)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


def main(argv: list[str]) -> int:
    # the worker decides when this ends (end of input, also when it dies): a Ctrl-C or
    # SIGTERM to the whole group must not lose the spans of the jobs it still drains
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    instance_id = argv[1] if len(argv) > 1 else f"pid:{os.getppid()}"
    provider = TracerProvider(resource=resource_for(instance_id), id_generator=IDS)
    provider.add_span_processor(BatchSpanProcessor(exporter_for(protocol_of(os.environ))))
    tracer = provider.get_tracer("trtllm-worker", _package_version())
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    unpacker = msgpack.Unpacker(use_list=True, raw=False)
    try:
        while chunk := os.read(sys.stdin.fileno(), READ_BYTES):
            unpacker.feed(chunk)
            for record in unpacker:
                try:
                    export(tracer, record)
                except Exception:  # one bad record never stops the others
                    log.exception("a job trace could not be exported")
    finally:
        provider.force_flush(SHUTDOWN_TIMEOUT_MS)
        provider.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
