"""The OpenTelemetry side of `tracing`: the SDK's tracer provider and batch processor
with the OTLP exporter the standard variables choose. Imported only when traces are
asked for (the optional extra `otel`); the exporters read their own `OTEL_EXPORTER_OTLP_*`
variables (endpoint, headers, certificates, compression, timeout), the provider reads
`OTEL_TRACES_SAMPLER*`, the processor `OTEL_BSP_*`, the resource `OTEL_SERVICE_NAME`
and `OTEL_RESOURCE_ATTRIBUTES`."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version

from opentelemetry import propagate
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from worker.config import redact_url
from worker.contract.errors import ConfigError, WorkerError
from worker.ops.tracing import ENDPOINT_VARIABLES, JobTrace

log = logging.getLogger(__name__)

PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
DEFAULT_PROTOCOL = "http/protobuf"
"""The specification's default (Python's SDK alone would pick gRPC)."""
SHUTDOWN_TIMEOUT_MS = 5000


def _package_version() -> str:
    try:
        return version("trtllm-worker")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "unknown"


def protocol_of(environ: Mapping[str, str]) -> str:
    for name in PROTOCOL_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            return value
    return DEFAULT_PROTOCOL


def exporter_for(protocol: str) -> SpanExporter:
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    raise ConfigError(
        f"invalid setting OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: "
        "the worker exports http/protobuf or grpc"
    )


def resource_for(instance_id: str) -> Resource:
    """`OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` win; else the service is
    `trtllm-worker` and the instance this worker's id (host:pid:random, as in its logs)."""
    resource = Resource.create({"service.version": _package_version()})
    defaults: dict[str, str] = {}
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        defaults[SERVICE_NAME] = "trtllm-worker"
    if SERVICE_INSTANCE_ID not in resource.attributes:
        defaults[SERVICE_INSTANCE_ID] = instance_id
    return resource.merge(Resource(defaults)) if defaults else resource


class OtelTracing:
    """Builds each job's span once it is settled and hands it to the batch processor,
    which exports from its own thread."""

    def __init__(self, provider: TracerProvider, tracer: Tracer, description: str) -> None:
        self._provider = provider
        self._tracer = tracer
        self.description = description

    def finish(self, trace: JobTrace, error: WorkerError | None = None) -> None:
        events = trace.events
        parent = propagate.extract(trace.carrier) if trace.carrier else None
        span = self._tracer.start_span(
            trace.name,
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=trace.attributes,
            start_time=trace.start_ns,
        )
        if not span.is_recording():  # not sampled
            return
        wall_ns = trace.wall_ns
        for name, at, attributes in events:
            span.add_event(name, attributes, timestamp=wall_ns(at))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error.message[:256]))
        span.end(end_time=wall_ns(time.monotonic()))

    def close(self) -> None:
        """Export what is buffered (bounded) and stop the processor's thread."""
        self._provider.force_flush(SHUTDOWN_TIMEOUT_MS)
        self._provider.shutdown()


def start(environ: Mapping[str, str], *, instance_id: str) -> OtelTracing:
    protocol = protocol_of(environ)
    exporter = exporter_for(protocol)
    provider = TracerProvider(resource=resource_for(instance_id))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = provider.get_tracer("trtllm-worker", _package_version())
    endpoint = next((environ[n] for n in ENDPOINT_VARIABLES if environ.get(n, "").strip()), "")
    return OtelTracing(provider, tracer, f"OTLP {protocol} to {redact_url(endpoint.strip())}")
