"""Publishing bytes no AMQP client library would send: a message whose short strings
(properties, header keys, the routing key) are not UTF-8.

aio-pika and pamqp encode `str` only, so the frames are marshalled by pamqp with
ASCII placeholders and the placeholders' bytes replaced (same length, so every length
field stays right) before they go out on a plain socket, after a hand-made AMQP 0-9-1
handshake. The publish is confirmed by the broker (`mandatory`: an unroutable message
is an error here, not a silent drop)."""

from __future__ import annotations

import asyncio
import contextlib

from pamqp import commands, constants, frame, header
from pamqp.body import ContentBody
from pamqp.common import FieldTable
from yarl import URL

Frame = frame.FrameTypes


class _Link:
    """One AMQP connection, read and written frame by frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def read(self) -> Frame:
        head = await self.reader.readexactly(constants.FRAME_HEADER_SIZE)
        _, _, size = frame.frame_parts(head)
        assert size is not None
        rest = await self.reader.readexactly(size + 1)
        _, _, value = frame.unmarshal(head + rest)
        return value

    async def expect(self, kind: type[Frame]) -> Frame:
        while True:
            value = await self.read()
            if isinstance(value, commands.Channel.Close | commands.Connection.Close):
                raise AssertionError(f"the broker refused: {value.reply_text}")
            if isinstance(value, kind):
                return value

    def send(self, channel: int, *values: Frame) -> None:
        self.writer.write(b"".join(frame.marshal(value, channel) for value in values))


async def _open(url: str) -> _Link:
    parts = URL(url)
    reader, writer = await asyncio.open_connection(parts.host or "localhost", parts.port or 5672)
    link = _Link(reader, writer)
    writer.write(constants.AMQP + b"\x00\x00\x09\x01")
    await link.expect(commands.Connection.Start)
    response = f"\0{parts.user or 'guest'}\0{parts.password or 'guest'}"
    properties: FieldTable = {"connection_name": "tests.raw_amqp"}
    link.send(0, commands.Connection.StartOk(properties, "PLAIN", response, "en_US"))
    tune = await link.expect(commands.Connection.Tune)
    assert isinstance(tune, commands.Connection.Tune)
    vhost = parts.path[1:] or "/"
    link.send(
        0,
        commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0),
        commands.Connection.Open(vhost),
    )
    await link.expect(commands.Connection.OpenOk)
    link.send(1, commands.Channel.Open())
    await link.expect(commands.Channel.OpenOk)
    link.send(1, commands.Confirm.Select())
    await link.expect(commands.Confirm.SelectOk)
    return link


def patched(frames: bytes, replacements: dict[bytes, bytes]) -> bytes:
    """`frames` with each placeholder (found exactly once) replaced by its bytes."""
    for placeholder, raw in replacements.items():
        assert len(placeholder) == len(raw), (placeholder, raw)
        assert frames.count(placeholder) == 1, placeholder
        frames = frames.replace(placeholder, raw)
    return frames


async def publish_raw(
    url: str,
    *,
    exchange: str,
    routing_key: str,
    body: bytes,
    properties: commands.Basic.Properties,
    replacements: dict[bytes, bytes],
) -> None:
    """Publish `body` with `properties`, the placeholders in the method and content
    header frames replaced by raw bytes; returns once the broker confirmed it."""
    link = await _open(url)
    try:
        method = frame.marshal(
            commands.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True), 1
        )
        content = frame.marshal(header.ContentHeader(0, len(body), properties), 1)
        link.writer.write(
            patched(method + content, replacements) + frame.marshal(ContentBody(body), 1)
        )
        while True:
            reply = await link.expect(commands.Basic.Ack | commands.Basic.Return)  # type: ignore[arg-type]
            if isinstance(reply, commands.Basic.Return):
                raise AssertionError(f"unroutable: {reply.reply_text}")
            break
        link.send(0, commands.Connection.Close(200, "done", 0, 0))
        with contextlib.suppress(asyncio.IncompleteReadError):
            await link.expect(commands.Connection.CloseOk)
    finally:
        link.writer.close()
        with contextlib.suppress(ConnectionError):
            await link.writer.wait_closed()
