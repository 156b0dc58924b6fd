"""What the worker's and the SDK's Redis clients send when they connect, read off the
wire through a recording proxy in front of the real Redis: nothing their least-privilege
users are not granted (redis-py's CLIENT SETINFO would be refused, and logged, by every
Redis from 7.2 on)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.services import ServiceUrls
from trtllm_worker.client import Client
from trtllm_worker.connect.grants import CONNECTION_COMMANDS
from trtllm_worker.connect.redis import connect_redis


class RecordingProxy:
    """Forwards one TCP port to Redis and keeps every byte the clients sent."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.sent = bytearray()
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bool
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if record:
                    self.sent += data
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        self.writers += [writer, upstream_writer]
        await asyncio.gather(
            self._pipe(reader, upstream_writer, record=True),
            self._pipe(upstream_reader, writer, record=False),
        )


@contextlib.asynccontextmanager
async def proxied(redis_url: str) -> AsyncIterator[tuple[str, RecordingProxy]]:
    parts = urlsplit(redis_url)
    proxy = RecordingProxy(parts.hostname or "localhost", parts.port or 6379)
    server = await asyncio.start_server(proxy._serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    url = urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))
    try:
        yield url, proxy
    finally:
        server.close()
        for writer in proxy.writers:
            writer.close()
        await server.wait_closed()


def commands(sent: bytes) -> list[str]:
    """The command names (with the subcommand of CLIENT) in a stream of RESP arrays."""
    words = [line for line in sent.split(b"\r\n") if line and line[:1] not in b"*$"]
    names: list[str] = []
    arity = [int(line[1:]) for line in sent.split(b"\r\n") if line.startswith(b"*")]
    index = 0
    for count in arity:
        name = words[index].decode().lower()
        if name in {"client", "cluster", "script"} and count > 1:
            name = f"{name}|{words[index + 1].decode().lower()}"
        names.append(name)
        index += count
    return names


async def test_the_worker_client_sends_only_granted_commands(services: ServiceUrls) -> None:
    async with proxied(services.redis) as (url, proxy):
        client = await connect_redis(url, client_name="trtllm-worker:test")
        try:
            await client.ping()
        finally:
            await client.aclose()
    assert proxy.connections >= 1
    sent = commands(bytes(proxy.sent))
    assert "client|setname" in sent  # the proxy saw the handshake
    assert "client|setinfo" not in sent
    # HELLO (the protocol) is the one command Redis lets every user run
    granted = {rule.removeprefix("+") for rule in CONNECTION_COMMANDS} | {"hello"}
    assert set(sent) <= granted, sent


async def test_the_sdk_sends_no_client_setinfo(
    services: ServiceUrls, names: dict[str, str]
) -> None:
    async with (
        proxied(services.redis) as (url, proxy),
        Client(
            amqp_url=services.amqp,
            redis_url=url,
            queue=names["queue"],
            stream_prefix=names["stream_prefix"],
        ) as client,
    ):
        await client.cancel("never-submitted")  # the cancel mark goes to Redis
    sent = commands(bytes(proxy.sent))
    assert sent, "the SDK never reached Redis through the proxy"
    assert "client|setinfo" not in sent


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        (b"*1\r\n$4\r\nPING\r\n", ["ping"]),
        (
            b"*4\r\n$6\r\nCLIENT\r\n$7\r\nSETINFO\r\n$8\r\nLIB-NAME\r\n$8\r\nredis-py\r\n",
            ["client|setinfo"],
        ),
    ],
)
def test_the_recorder_reads_resp(wire: bytes, expected: list[str]) -> None:
    assert commands(wire) == expected
