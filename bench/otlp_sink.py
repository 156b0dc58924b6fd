"""A local OTLP/HTTP receiver that discards: it answers every export at once and keeps
only the bodies, which it decodes to count spans when asked (`GET /spans`), after a run,
so that its own CPU does not compete with the worker's during one.

    python bench/otlp_sink.py PORT
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

_bodies: list[bytes] = []
_lock = threading.Lock()
_OK = ExportTraceServiceResponse().SerializeToString()


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a collector would

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with _lock:
            _bodies.append(body)
        self._reply(_OK, "application/x-protobuf")

    def do_GET(self) -> None:
        """Spans received since the last GET (and the export requests they came in)."""
        with _lock:
            bodies = list(_bodies)
            _bodies.clear()
        spans = 0
        for body in bodies:
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            spans += sum(
                len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans
            )
        self._reply(json.dumps({"spans": spans, "requests": len(bodies)}).encode(), "text/json")

    def _reply(self, payload: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink)
    print("listening", flush=True)
    server.serve_forever()
