"""A TCP proxy in front of a real service that a test can cut: its connections are
closed and new ones are accepted and closed at once (counted), as a lost network path
looks to a client. It can also close its open connections at the next bytes each one
sends, new ones passing, as a server that drops an idle connection just as the client
uses it looks. Nothing of the service is faked."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit


class CuttableProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.connections = 0
        self.refused = 0
        """Connections accepted and closed at once after the cut."""
        self.dropped = 0
        """Connections closed at their next command by `drop_at_next_command`."""
        self._cut = False
        self._writers: list[asyncio.StreamWriter] = []
        self._clients: list[asyncio.StreamWriter] = []
        """The client's side of each connection made."""
        self._doomed: set[asyncio.StreamWriter] = set()
        self._doom_new = 0

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client: asyncio.StreamWriter | None = None,
    ) -> None:
        """Copy `reader` to `writer`; `client` is the client's side when `reader` reads
        what the client sends (the only direction `drop_at_next_command` watches)."""
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if client is not None and client in self._doomed:
                    self._doomed.discard(client)
                    self.dropped += 1
                    client.close()
                    break
                writer.write(data)
                await writer.drain()
        writer.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            self.refused += 1
            writer.close()
            return
        self.connections += 1
        self._writers.append(writer)
        self._clients.append(writer)
        if self._doom_new > 0:
            self._doom_new -= 1
            self._doomed.add(writer)
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        if self._cut:  # cut while this connection was being made: it goes too
            upstream_writer.close()
            writer.close()
            return
        self._writers.append(upstream_writer)
        await asyncio.gather(
            self._pipe(reader, upstream_writer, client=writer),
            self._pipe(upstream_reader, writer),
        )

    def drop_new_connections(self, count: int) -> None:
        """Close each of the next `count` connections made at its first command, as
        `drop_at_next_command` does to those open now."""
        self._doom_new = count

    def drop_at_next_command(self) -> None:
        """Close each connection open now when its client next sends anything (what it
        sent never reaches the service); connections made from now on pass."""
        self._doomed = {writer for writer in self._clients if not writer.is_closing()}

    async def cut(self) -> None:
        """Close every connection through the proxy; refuse new ones from now on."""
        self._cut = True
        for writer in self._writers:
            writer.close()
        self._writers.clear()


@contextlib.asynccontextmanager
async def proxied(url: str, default_port: int = 6379) -> AsyncIterator[tuple[str, CuttableProxy]]:
    """`url` with its host and port replaced by a proxy's on 127.0.0.1 (credentials and
    path kept), and the proxy."""
    parts = urlsplit(url)
    proxy = CuttableProxy(parts.hostname or "localhost", parts.port or default_port)
    server = await asyncio.start_server(proxy.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    credentials, _, _ = parts.netloc.rpartition("@")
    host = f"127.0.0.1:{port}"
    netloc = f"{credentials}@{host}" if credentials else host
    try:
        yield urlunsplit(parts._replace(netloc=netloc)), proxy
    finally:
        server.close()
        await proxy.cut()
        await server.wait_closed()
