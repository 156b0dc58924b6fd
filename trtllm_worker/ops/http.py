"""`/healthz`, `/readyz` and `/metrics` on a tiny asyncio HTTP/1.1 server: probes and a
scrape need three GET routes, not a web framework."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

_READ_TIMEOUT_S = 5.0
_MAX_HEADER_BYTES = 16 * 1024


class ProbeServer:
    """Serves the probes from callables that say whether the worker is alive and ready."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        alive: Callable[[], bool],
        ready: Callable[[], bool],
        registry: CollectorRegistry,
    ) -> None:
        self._host = host
        self._port = port
        self._alive = alive
        self._ready = ready
        self._registry = registry
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port (useful when the setting is 0: any free port)."""
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self._host, self._port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            status, content_type, body = self._route(head)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            status, content_type, body = "400 Bad Request", "text/plain", b"bad request\n"
        except ConnectionError:
            writer.close()
            return
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        try:
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _route(self, head: bytes) -> tuple[str, str, bytes]:
        if len(head) > _MAX_HEADER_BYTES:
            return "431 Request Header Fields Too Large", "text/plain", b"headers too large\n"
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3:
            return "400 Bad Request", "text/plain", b"bad request\n"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method != b"GET":
            return "405 Method Not Allowed", "text/plain", b"method not allowed\n"
        if target == b"/healthz":
            return _probe(self._alive())
        if target == b"/readyz":
            return _probe(self._ready())
        if target == b"/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self._registry)
        return "404 Not Found", "text/plain", b"not found\n"


def _probe(ok: bool) -> tuple[str, str, bytes]:
    if ok:
        return "200 OK", "text/plain", b"ok\n"
    return "503 Service Unavailable", "text/plain", b"unavailable\n"
