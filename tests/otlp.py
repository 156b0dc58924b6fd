"""OTLP trace receivers for tests: a real OTLP/HTTP endpoint (`POST /v1/traces`,
protobuf, gzip or not) and a real OTLP/gRPC `TraceService`, each on a spare port,
decoding what a worker exports into plain `ReceivedSpan`s."""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

Value = str | int | float | bool | tuple[Any, ...] | None


def value_of(value: AnyValue) -> Value:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(value_of(each) for each in value.array_value.values)
    return None if kind is None else getattr(value, kind)


def attributes_of(pairs: Any) -> dict[str, Value]:
    return {pair.key: value_of(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


@dataclass(frozen=True)
class ReceivedEvent:
    name: str
    time_ns: int
    attributes: dict[str, Value]


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Value]
    events: list[ReceivedEvent]
    status: str
    status_message: str
    resource: dict[str, Value]

    @property
    def event_names(self) -> list[str]:
        return [event.name for event in self.events]

    def event(self, name: str) -> ReceivedEvent:
        (found,) = [event for event in self.events if event.name == name]
        return found


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = attributes_of(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=Span.SpanKind.Name(span.kind),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=attributes_of(span.attributes),
                        events=[
                            ReceivedEvent(e.name, e.time_unix_nano, attributes_of(e.attributes))
                            for e in span.events
                        ],
                        status=Status.StatusCode.Name(span.status.code),
                        status_message=span.status.message,
                        resource=resource,
                    )
                )
    return spans


@dataclass
class Collected:
    """Spans as they arrive, awaitable from the test's event loop."""

    loop: asyncio.AbstractEventLoop
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.spans.extend(spans)
            self.requests += 1
        self.loop.call_soon_threadsafe(self._changed.set)

    async def wait_for(
        self, match: Callable[[ReceivedSpan], bool], count: int = 1, within_s: float = 30
    ) -> list[ReceivedSpan]:
        """The first `count` spans that match, waiting for exports (no polling)."""
        async with asyncio.timeout(within_s):
            while True:
                self._changed.clear()
                with self._lock:
                    found = [span for span in self.spans if match(span)]
                if len(found) >= count:
                    return found[:count]
                await self._changed.wait()


class _Handler(BaseHTTPRequestHandler):
    collected: Collected
    keep: bool

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        ok = self.path == "/v1/traces" and self.headers.get("Content-Type") == (
            "application/x-protobuf"
        )
        if ok and self.keep:
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            self.collected.add(decode(request))
        self.send_response(200 if ok else 400)
        self.send_header("Content-Type", "application/x-protobuf")
        payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def http_receiver(collected: Collected, *, keep: bool = True) -> Iterator[str]:
    """An OTLP/HTTP endpoint; yields its base URL (`OTEL_EXPORTER_OTLP_ENDPOINT`)."""
    handler = type("Handler", (_Handler,), {"collected": collected, "keep": keep})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="otlp-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collected: Collected) -> None:
        self.collected = collected

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.collected.add(decode(request))
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def grpc_receiver(collected: Collected) -> Iterator[str]:
    """An OTLP/gRPC endpoint (insecure); yields its URL."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_servicer = trace_service_pb2_grpc.add_TraceServiceServicer_to_server
    add_servicer(_TraceService(collected), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait()
