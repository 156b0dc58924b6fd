"""Redis: one pipeline per batch of outputs; terminal entries with their EXPIRE; the
stream and cancel-mark reads a job starts with. Entry ids are explicit (`0-<seq>`), so a
retried pipeline can never store an index twice."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from worker.errors import StreamUnusable
from worker.output import Fields

log = logging.getLogger(__name__)

TERMINAL_EVENTS = frozenset({"done", "error"})

# Append a terminal entry after whatever the stream holds, unless it already ends with
# one; then set its expiry. Used for jobs that end without running (invalid, cancelled
# before start, deadline passed). Returns 1 if appended, 0 if a terminal was there.
_APPEND_TERMINAL = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq = 1
if #last > 0 then
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == 'event' and (f[i + 1] == 'done' or f[i + 1] == 'error') then return 0 end
  end
  seq = tonumber(string.match(last[1][1], '-(%d+)$')) + 1
end
redis.call('XADD', KEYS[1], '0-' .. seq, unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


def cancel_key(stream_key: str) -> str:
    """The cancel mark of a request: in its stream's hash slot (`{<stream key>}:...`)."""
    return "{" + stream_key + "}:cancel"


@dataclass(slots=True)
class StreamState:
    """What a job finds in its stream when it is taken."""

    terminal: bool = False
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    cancelled: bool = False


class Publisher:
    """All the worker's Redis I/O."""

    def __init__(self, client: aioredis.Redis, *, ttl_s: int) -> None:
        self._redis = client
        self._ttl_s = ttl_s
        self._append_terminal = client.register_script(_APPEND_TERMINAL)

    @classmethod
    def from_url(cls, url: str, *, ttl_s: int) -> Publisher:
        client = aioredis.Redis.from_url(
            url, decode_responses=False, health_check_interval=10, socket_connect_timeout=5
        )
        return cls(client, ttl_s=ttl_s)

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()

    async def write(
        self, entries: Sequence[tuple[str, str, Fields]], expire: Sequence[str]
    ) -> dict[str, str]:
        """Store one batch in one round trip. An entry refused as 'equal or smaller'
        was stored by an earlier try of the same batch and counts as written. Returns
        the keys Redis refused for good (e.g. not a stream), with the reason; raises on
        connection errors (the whole batch can then be retried)."""
        if not entries:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        keys = []
        for key, seq_id, fields in entries:
            pipe.xadd(key, fields, id=seq_id)  # type: ignore[arg-type]
            keys.append(key)
        for key in expire:
            pipe.expire(key, self._ttl_s)
            keys.append(key)
        results = await pipe.execute(raise_on_error=False)
        refused: dict[str, str] = {}
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, ResponseError):
                if "equal or smaller" not in str(result):
                    refused.setdefault(key, str(result))
            elif isinstance(result, Exception):
                raise result
        return refused

    async def append_terminal(self, key: str, fields: Fields) -> bool:
        """Append a terminal entry to a stream no worker is writing. False if the
        stream already ended."""
        args: list[str | int | float] = [self._ttl_s]
        for name, value in fields.items():
            args.extend((name, value))
        return bool(await self._append_terminal(keys=[key], args=args))

    async def read_start(self, key: str) -> StreamState:
        """The stream's tail and the cancel mark in one round trip; the whole stream
        only when a resume needs it."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.xrevrange(key, count=1)
        pipe.exists(cancel_key(key))
        try:
            tail, cancelled = await pipe.execute()
        except ResponseError as exc:
            raise StreamUnusable(f"stream key {key!r} cannot be read: {exc}") from None
        state = StreamState(cancelled=bool(cancelled))
        if not tail:
            return state
        last_fields = tail[0][1]
        if last_fields.get(b"event", b"").decode() in TERMINAL_EVENTS:
            state.terminal = True
            return state
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await self._redis.xrange(key)  # type: ignore[assignment]
        for _, entry in entries:
            if entry.get(b"event") == b"token":
                state.token_ids.append(int(entry[b"token_id"]))
                state.texts.append(entry[b"text"].decode())
        return state

    async def mark_cancelled(self, key: str) -> None:
        """Remember a cancel for a request that may not have been taken yet."""
        await self._redis.set(cancel_key(key), b"1", ex=self._ttl_s)
