"""A minimal HTTP/1.1 client for streamed OpenAI answers (server-sent events), for the
`gateway` scenario's load generator: one keep-alive connection per simulated client,
the request written by hand, the chunked body and the events parsed incrementally.

Why not httpx (which the dev extra brings through `openai`): the load generator shares
two cores with the gateway it measures, so its cost per token should be as small as can
be, and httpx adds anyio, httpcore's state machine and a decoder chain per chunk (not
measured here; this client's process used less CPU than the gateway at every level, see
docs/performance.md). No new dependency. `ChunkedDecoder` and `SseParser` are pure
(unit-tested)."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.1 as expected."""


class ChunkedDecoder:
    """`Transfer-Encoding: chunked`, fed bytes as they arrive: `feed` returns the chunk
    payloads complete so far; `done` once the last (empty) chunk and its trailer are in."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._size: int | None = None  # of the chunk being read; None: its size line next
        self.done = False

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        payloads: list[bytes] = []
        while not self.done:
            if self._size is None:
                end = self._buffer.find(b"\r\n")
                if end < 0:
                    break
                line = bytes(self._buffer[:end]).split(b";", 1)[0].strip()
                try:
                    self._size = int(line, 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size line {line!r}") from None
                del self._buffer[: end + 2]
            if self._size == 0:  # the last chunk: trailers (none expected), then a blank line
                end = self._buffer.find(b"\r\n")
                if end < 0:
                    break
                del self._buffer[: end + 2]
                if end == 0:
                    self.done = True
                continue
            if len(self._buffer) < self._size + 2:
                break
            if self._buffer[self._size : self._size + 2] != b"\r\n":
                raise ProtocolError("a chunk does not end with CRLF")
            payloads.append(bytes(self._buffer[: self._size]))
            del self._buffer[: self._size + 2]
            self._size = None
        return payloads

    @property
    def leftover(self) -> bytes:
        """What followed the body (nothing, unless the server pipelined)."""
        return bytes(self._buffer)


@dataclass
class SseEvent:
    data: str
    event: str = "message"
    id: str | None = None


class SseParser:
    """Server-sent events (the WHATWG grammar: lines end with CRLF, LF or CR; a blank
    line dispatches; `:` starts a comment; several `data:` lines join with LF), fed text
    as it arrives, a line split across two feeds included."""

    def __init__(self) -> None:
        self._pending = ""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None

    def feed(self, text: str) -> list[SseEvent]:
        text = self._pending + text
        # a CR at the very end may be the first half of a CRLF: wait for what follows
        self._pending = "\r" if text.endswith("\r") else ""
        if self._pending:
            text = text[:-1]
        events: list[SseEvent] = []
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._pending = lines.pop() + self._pending  # the unfinished last line
        for line in lines:
            if not line:
                if self._data:
                    events.append(
                        SseEvent("\n".join(self._data), self._event or "message", self._id)
                    )
                self._data, self._event = [], ""
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                self._data.append(value)
            elif name == "event":
                self._event = value
            elif name == "id":
                self._id = value
        return events


def chat_tokens(data: str) -> tuple[int, bool, str | None]:
    """(tokens of generated text in one `chat.completion.chunk`'s data, whether it is the
    end: `[DONE]`, the chunk's `id`). An error event raises."""
    if data == "[DONE]":
        return 0, True, None
    body = json.loads(data)
    if "error" in body:
        raise ProtocolError(f"error event: {body['error']}")
    choices = body.get("choices") or []
    content = choices[0].get("delta", {}).get("content") if choices else None
    return (1 if content else 0), False, body.get("id")


@dataclass
class Answer:
    """One streamed answer as the client saw it (monotonic seconds)."""

    started: float
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    answer_id: str | None = None
    token_times: list[float] | None = None
    """When a list: each token's arrival, in order."""
    on_first: Callable[[str], None] | None = None
    """Called with the answer's id as its first token arrives."""


class StreamingClient:
    """One keep-alive connection to the gateway, one streamed request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self._reader, self._writer

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
        self._reader = self._writer = None

    async def chat(
        self,
        body: dict[str, Any],
        answer: Answer,
        clock: Callable[[], float],
        on_tokens: Callable[[float, int], None] | None = None,
    ) -> None:
        """POST `body` to /v1/chat/completions and read its events to `[DONE]`, filling
        `answer` (`clock`: the time function, loop.time); `on_tokens(now, n)` as tokens
        arrive."""
        reader, writer = await self._connect()
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        answer.started = clock()
        writer.write(head + payload)
        status, headers = _parse_head(await reader.readuntil(b"\r\n\r\n"))
        if status != 200:
            length = int(headers.get("content-length", "0"))
            detail = await reader.readexactly(length) if length else b""
            raise ProtocolError(f"HTTP {status}: {detail[:200]!r}")
        if headers.get("transfer-encoding", "").lower() != "chunked":
            raise ProtocolError(f"expected a chunked body, got {headers}")
        await _read_events(reader, answer, clock, on_tokens)
        if answer.ended is None:
            raise ProtocolError("the body ended without [DONE]")
        if headers.get("connection", "").lower() == "close":
            await self.close()


async def _read_events(
    reader: asyncio.StreamReader,
    answer: Answer,
    clock: Callable[[], float],
    on_tokens: Callable[[float, int], None] | None,
) -> None:
    """The chunked body's events, to its end."""
    decoder, parser = ChunkedDecoder(), SseParser()
    text = codecs.getincrementaldecoder("utf-8")()
    while not decoder.done:
        data = await reader.read(65536)
        if not data:
            raise ProtocolError("the connection closed mid-answer")
        for payload_chunk in decoder.feed(data):
            for event in parser.feed(text.decode(payload_chunk)):
                tokens, end, answer_id = chat_tokens(event.data)
                if tokens:
                    now = clock()
                    if answer.first_token is None:
                        answer.first_token, answer.answer_id = now, answer_id
                        if answer.on_first is not None and answer_id is not None:
                            answer.on_first(answer_id)
                    if answer.token_times is not None:
                        answer.token_times.append(now)
                    answer.tokens += tokens
                    if on_tokens is not None:
                        on_tokens(now, tokens)
                if end:
                    answer.ended = clock()


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ProtocolError(f"bad status line {lines[0]!r}")
    headers = {}
    for line in _nonblank(lines[1:]):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _nonblank(lines: list[str]) -> Iterator[str]:
    return (line for line in lines if line)
