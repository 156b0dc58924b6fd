"""Redis: all the worker's Redis I/O.

- Token and terminal entries are written with explicit ids (`0-<seq>`): Redis refuses an
  id that is not above the last, so no index is ever stored twice, even by a retry.
- A request's writes are fenced by its lease `{<stream key>}:lease`: a Lua script appends
  only while the caller's token holds the lease, so a worker that lost a job (its broker
  connection died and another worker took over) can no longer write to its stream.
- One pipeline per batch of engine outputs: one script call per request in the batch.
Keys that belong to a request sit in its stream's hash slot (`{<stream key>}:…`), so the
scripts work on Redis Cluster too."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import hiredis
import redis.asyncio as aioredis

from worker.errors import StreamUnusable
from worker.output import Fields

log = logging.getLogger(__name__)

TERMINAL_EVENTS = frozenset({"done", "error"})
_TOKEN_FIELDS = 5  # event, index, token_id, text, logprob
LEASE_LOST = -1

# KEYS: stream 1, lease 1, stream 2, lease 2, ... ARGV, per stream: token ('' for none),
# ttl (0: not its last batch), the number of arguments of its entries, then the entries,
# each either
#   't', id, index, token_id, text, logprob ('' for none)   -- a token entry, or
#   'f', id, field count, field, value, ...                 -- any other entry.
# A stream is appended to while its token holds its lease; an entry refused as "equal or
# smaller" was stored by an earlier try and is skipped. With ttl > 0 the stream gets its
# expiry and the lease is released. Returns per stream the entries written, -1 when the
# lease is another's, or the error Redis gave ('ERR ...'). One call for the whole batch
# (a call per stream cost Redis more than the appends), and token entries travel without
# their field names.
_FENCED_APPEND = """
local results = {}
local a = 1
for s = 1, #KEYS, 2 do
  local token, ttl, count = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local i, last = a + 3, a + 2 + count
  a = last + 1
  local result = 0
  if token ~= '' and redis.call('GET', KEYS[s + 1]) ~= token then
    result = -1
  else
    local ok
    while i <= last do
      if ARGV[i] == 't' then
        if ARGV[i + 5] == '' then
          ok = redis.pcall('XADD', KEYS[s], ARGV[i + 1], 'event', 'token', 'index',
            ARGV[i + 2], 'token_id', ARGV[i + 3], 'text', ARGV[i + 4])
        else
          ok = redis.pcall('XADD', KEYS[s], ARGV[i + 1], 'event', 'token', 'index',
            ARGV[i + 2], 'token_id', ARGV[i + 3], 'text', ARGV[i + 4], 'logprob', ARGV[i + 5])
        end
        i = i + 6
      else
        local n = tonumber(ARGV[i + 2]) * 2
        local fields = {}
        for k = 1, n do fields[k] = ARGV[i + 2 + k] end
        ok = redis.pcall('XADD', KEYS[s], ARGV[i + 1], unpack(fields))
        i = i + 3 + n
      end
      if type(ok) == 'table' and ok.err then
        if not string.find(ok.err, 'equal or smaller', 1, true) then
          result = ok.err
          break
        end
      else
        result = result + 1
      end
    end
    if type(result) == 'number' and ttl > 0 then
      redis.call('EXPIRE', KEYS[s], ttl)
      if token ~= '' then redis.call('DEL', KEYS[s + 1]) end
    end
  end
  results[#results + 1] = result
end
return results
"""

# KEYS: stream, lease. ARGV: ttl, token ('' for none), fields... Appends a terminal entry
# after whatever the stream holds unless it already ends with one (0) or the lease is
# another's (-1); sets the expiry and releases the lease. For jobs that end without
# running (invalid, cancelled before start, deadline passed, resumed at their end).
_APPEND_TERMINAL = """
if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq = 1
if #last > 0 then
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == 'event' and (f[i + 1] == 'done' or f[i + 1] == 'error') then return 0 end
  end
  seq = tonumber(string.match(last[1][1], '-(%d+)$')) + 1
end
redis.call('XADD', KEYS[1], '0-' .. seq, unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then redis.call('DEL', KEYS[2]) end
return 1
"""

# KEYS: stream, lease, cancel mark. ARGV: token, lease ms. A job's first call: take the
# lease (or find it ours already) and read the stream's tail and the cancel mark, in one
# round trip. nil: another holds the lease. {-1, error}: the key is not a stream.
_START = """
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if redis.call('GET', KEYS[2]) ~= ARGV[1] then return false end
end
local tail = redis.pcall('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if type(tail) == 'table' and tail.err then
  redis.call('DEL', KEYS[2])
  return {-1, tail.err}
end
return {1, redis.call('EXISTS', KEYS[3]), tail}
"""

# KEYS: lease. ARGV: token, ttl ms. Renew the lease if the token still holds it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS: lease. ARGV: token. Release the lease if the token holds it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def cancel_key(stream_key: str) -> str:
    """The cancel mark of a request: in its stream's hash slot (`{<stream key>}:...`)."""
    return "{" + stream_key + "}:cancel"


def lease_key(stream_key: str) -> str:
    return "{" + stream_key + "}:lease"


def deliveries_key(stream_key: str) -> str:
    return "{" + stream_key + "}:deliveries"


class _HiredisPacking:
    """redis-py's asyncio connections pack commands in Python, one argument at a time:
    on the hot path (ten arguments per token) that was the worker's largest cost. hiredis
    packs a whole command in C."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str) and " " in args[0]:  # e.g. "SCRIPT LOAD"
            args = (*args[0].split(), *args[1:])
        return [hiredis.pack_command(args)]


def _hiredis_packing(connection_class: type[Any]) -> type[Any]:
    """The pool's connection class (plain, TLS or unix socket) packing with hiredis."""
    return type(f"Hiredis{connection_class.__name__}", (_HiredisPacking, connection_class), {})


@dataclass(slots=True)
class StreamState:
    """What a job finds in its stream when it is taken."""

    terminal: bool = False
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    cancelled: bool = False


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """CA and client certificate for `rediss://` (None: the system's defaults)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


class Publisher:
    """All the worker's Redis I/O."""

    def __init__(self, client: aioredis.Redis, *, ttl_s: int, lease_ttl_s: float = 10.0) -> None:
        self._redis = client
        self._ttl_s = ttl_s
        self._lease_ms = max(int(lease_ttl_s * 1000), 1)
        self._fenced_append = client.register_script(_FENCED_APPEND)
        self._append_terminal = client.register_script(_APPEND_TERMINAL)
        self._renew = client.register_script(_RENEW)
        self._start = client.register_script(_START)
        self._release = client.register_script(_RELEASE)

    @classmethod
    def from_url(
        cls, url: str, *, ttl_s: int, lease_ttl_s: float = 10.0, tls: TlsFiles | None = None
    ) -> Publisher:
        options: dict[str, Any] = {
            "decode_responses": False,
            "health_check_interval": 10,
            "socket_connect_timeout": 5,
            "socket_timeout": 30,
            "retry_on_timeout": False,
        }
        if tls is not None and url.startswith("rediss://"):
            options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
            if tls.ca_file:
                options["ssl_ca_certs"] = tls.ca_file
            if tls.cert_file:
                options["ssl_certfile"] = tls.cert_file
            if tls.key_file:
                options["ssl_keyfile"] = tls.key_file
        pool = aioredis.ConnectionPool.from_url(url, **options)
        pool.connection_class = _hiredis_packing(pool.connection_class)
        client = aioredis.Redis.from_pool(pool)  # the client owns (and closes) the pool
        return cls(client, ttl_s=ttl_s, lease_ttl_s=lease_ttl_s)

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()

    # -- writing --------------------------------------------------------------------

    async def write(
        self,
        entries: Sequence[tuple[str, str, Fields]],
        final_keys: Sequence[str],
        tokens: dict[str, str],
    ) -> dict[str, str]:
        """Store one batch in one round trip: per stream, its entries in order, fenced by
        the lease token in `tokens` (a key without one is written unfenced). Streams in
        `final_keys` get their expiry and their lease released. Returns the keys not
        written, with why: the lease was lost, or Redis refused the key for good (e.g. it
        is not a stream). Raises on connection errors (then the batch can be retried)."""
        if not entries:
            return {}
        per_key: dict[str, list[str | int | float]] = {}
        for key, seq_id, fields in entries:
            args = per_key.get(key)
            if args is None:
                args = per_key[key] = []
            if fields["event"] == "token" and len(fields) <= _TOKEN_FIELDS:
                args += (
                    "t",
                    seq_id,
                    fields["index"],
                    fields["token_id"],
                    fields["text"],
                    fields.get("logprob", ""),
                )
            else:
                args += ("f", seq_id, len(fields), *chain.from_iterable(fields.items()))
        final = set(final_keys)
        keys: list[str] = []
        flat: list[str | int | float] = []
        for key, args in per_key.items():
            keys += (key, lease_key(key))
            flat += (tokens.get(key, ""), self._ttl_s if key in final else 0, len(args), *args)
        results = await self._fenced_append(keys=keys, args=flat)
        refused: dict[str, str] = {}
        for key, result in zip(per_key, results, strict=True):
            if isinstance(result, bytes):
                refused[key] = result.decode(errors="replace")
            elif result == LEASE_LOST:
                refused[key] = "the lease was lost: another worker owns this request now"
        return refused

    async def append_terminal(self, key: str, fields: Fields, token: str = "") -> int:
        """Append a terminal entry to a stream no worker is writing (or that `token`
        leases). 1 appended, 0 the stream had ended already, -1 another owns the lease."""
        args: list[str | int | float] = [self._ttl_s, token]
        for name, value in fields.items():
            args.extend((name, value))
        return int(await self._append_terminal(keys=[key, lease_key(key)], args=args))

    # -- leases ---------------------------------------------------------------------

    async def renew_leases(self, leases: dict[str, str]) -> list[str]:
        """Renew every (stream key → token) lease in one round trip; returns the keys
        whose lease is no longer theirs."""
        if not leases:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for key, token in leases.items():
            await self._renew(keys=[lease_key(key)], args=[token, self._lease_ms], client=pipe)
        results = await pipe.execute()
        return [key for key, renewed in zip(leases, results, strict=True) if not renewed]

    async def release_leases(self, leases: dict[str, str]) -> None:
        if not leases:
            return
        pipe = self._redis.pipeline(transaction=False)
        for key, token in leases.items():
            await self._release(keys=[lease_key(key)], args=[token], client=pipe)
        await pipe.execute()

    # -- reading --------------------------------------------------------------------

    async def start(self, key: str, token: str) -> StreamState | None:
        """Take the request's lease and read what its stream holds, in one round trip
        (the whole stream only when a resume needs it). None: another worker holds the
        lease. Raises `StreamUnusable` when the key is not a stream."""
        reply = await self._start(
            keys=[key, lease_key(key), cancel_key(key)], args=[token, self._lease_ms]
        )
        if reply is None:
            return None
        if reply[0] == -1:
            reason = reply[1].decode(errors="replace")
            raise StreamUnusable(f"stream key {key!r} cannot be read: {reason}")
        state = StreamState(cancelled=bool(reply[1]))
        if not reply[2]:
            return state
        flat = reply[2][0][1]
        event = next((flat[i + 1] for i in range(0, len(flat), 2) if flat[i] == b"event"), b"")
        if event.decode() in TERMINAL_EVENTS:
            state.terminal = True
            return state
        await self._read_tokens(key, state)
        return state

    async def _read_tokens(self, key: str, state: StreamState) -> None:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await self._redis.xrange(key)  # type: ignore[assignment]
        for _, entry in entries:
            if entry.get(b"event") == b"token":
                state.token_ids.append(int(entry[b"token_id"]))
                state.texts.append(entry[b"text"].decode())

    async def mark_cancelled(self, key: str) -> None:
        """Remember a cancel for a request that may not have been taken yet."""
        await self._redis.set(cancel_key(key), b"1", ex=self._ttl_s)

    async def count_delivery(self, key: str) -> int:
        """How many times this request's message was taken (for classic queues, which
        do not count deliveries themselves)."""
        counter = deliveries_key(key)
        pipe = self._redis.pipeline(transaction=False)
        pipe.incr(counter)
        pipe.expire(counter, self._ttl_s)
        count, _ = await pipe.execute()
        return int(count)
