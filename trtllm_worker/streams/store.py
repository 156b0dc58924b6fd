"""Every Redis write of the worker, fenced.

- Token and terminal entries are written with explicit ids (`0-<seq>`): Redis refuses an
  id that is not above the last, so no index is ever stored twice, even by a retry.
- Every write is fenced by the request's lease `{<stream key>}:lease`: a Lua script
  appends only while the caller's token holds the lease, and a caller without a lease
  (an invalid job, refused before it took one) only while nobody holds it. A worker that
  lost a job can no longer write to its stream, and none overwrites a stream another
  worker owns.
- One function ends a stream, `end_stream` in the script: the terminal entry, the TTL
  and the lease release happen together or not at all.
- One script call per batch of engine outputs for all its streams (a call per stream
  cost Redis more than the appends); token entries travel as columns in one
  MessagePack argument, without ids or field names (the script builds them). On Redis
  Cluster a call may declare keys of one hash slot only: one call per node with the
  node's keys as an argument (`_WRITE_NODE`), else one call per slot."""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.commands.core import AsyncScript
from redis.crc import key_slot
from redis.exceptions import (
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

from trtllm_worker.contract.errors import ConfigError, StreamUnusable
from trtllm_worker.contract.stream import (
    TERMINAL_EVENTS,
    TOKEN,
    Fields,
    cancel_key,
    deliveries_key,
    entry_id,
    lease_key,
)
from trtllm_worker.streams.connect import NotReplicated

log = logging.getLogger(__name__)

LEASE_LOST = -1
ENTRIES_LOST = -2
LEASE_LOST_REASON = "the lease was lost: another worker owns this request now"
ENTRIES_LOST_REASON = (
    "entries stored earlier are gone (a Redis failover lost writes its replica had not"
    " received): the job is handed back and resumes from what the stream holds"
)
AFTER_TAIL = ""
"""The id of a terminal entry whose index is not known: after whatever the stream holds."""

# ARGV[1]: the TTL of a finished stream; ARGV[2]: one MessagePack array holding, per
# stream part (KEYS: stream, lease):
# lease token ('': the caller holds none), the seq of its first token entry, a code
# (4 n + 2 when logprobs follow + 1 when a terminal entry follows), then n token ids, n
# texts, (n logprobs, '' for none), then (the terminal entry) its id ('': after the
# tail, unless the stream has ended already), the number of fields, field, value, ...
# Token entry k (from 0) gets id 0-<seq + k> and index seq + k - 1. Returns per part the
# entries written, -1 when the fence refused (the lease is another's, or anyone's when
# the caller holds none), -2 when the stream lacks entries before the first one given
# (nothing is written), or 'WRONGTYPE ...' for a key that is not a stream; any other
# error fails the call. An entry refused as "equal or smaller" was stored by an earlier
# try and is skipped.
_WRITE_BODY = """
local ttl = tonumber(ARGV[1])
local argv = cmsgpack.unpack(ARGV[2])

local function owns(lease, token)
  if token == '' then return redis.call('EXISTS', lease) == 0 end
  return redis.call('GET', lease) == token
end

-- A key that is not a stream is refused for good (the error is returned for its request
-- alone); any other error (READONLY from a demoted master, OOM, ...) is the server's
-- state, not the request's: it fails the whole call, and the caller retries.
local function refused(err)
  if string.find(err, '^WRONGTYPE') then return err end
  error({err = err})
end

local function stored(reply)
  if type(reply) == 'table' and reply.err then
    if string.find(reply.err, 'equal or smaller', 1, true) then return 0 end
    return refused(reply.err)
  end
  return 1
end

-- Entry ids run 0-1, 0-2, ... without holes, so a stream holds exactly as many entries
-- as the sequence number before its next one. Fewer: entries stored earlier are gone (a
-- failover promoted a replica that had not received them); writing on would leave a
-- hole in the indices.
local function lost(stream, seq)
  if seq == nil then return false end
  local len = redis.pcall('XLEN', stream)
  if type(len) ~= 'number' then return false end
  return len < seq - 1
end

-- The one place a stream ends: its terminal entry, its expiry, its lease released.
local function end_stream(stream, lease, token, id, fields)
  if id == '' then
    local tail = redis.pcall('XREVRANGE', stream, '+', '-', 'COUNT', 1)
    if tail.err then return refused(tail.err) end
    local seq = 1
    if #tail > 0 then
      local f = tail[1][2]
      for i = 1, #f, 2 do
        if f[i] == 'event' and (f[i + 1] == 'done' or f[i + 1] == 'error') then return 0 end
      end
      seq = tonumber(string.match(tail[1][1], '-(%d+)$')) + 1
    end
    id = '0-' .. seq
  end
  local result = stored(redis.pcall('XADD', stream, id, unpack(fields)))
  if type(result) == 'string' then return result end
  redis.call('EXPIRE', stream, ttl)
  if token ~= '' then redis.call('DEL', lease) end
  return result
end

local results = {}
local a = 1
for s = 1, #K, 2 do
  local stream, lease, token = K[s], K[s + 1], argv[a]
  local seq, code = tonumber(argv[a + 1]), tonumber(argv[a + 2])
  local count = math.floor(code / 4)
  local with_logprobs = code % 4 >= 2
  local has_end = code % 2 == 1
  local ids, texts = a + 3, a + 3 + count
  local after = texts + (with_logprobs and 2 or 1) * count
  local nfields = has_end and tonumber(argv[after + 1]) or 0
  a = has_end and after + 2 + nfields * 2 or after
  local first = nil
  if count > 0 then
    first = seq
  elseif has_end and argv[after] ~= '' then
    first = tonumber(string.match(argv[after], '-(%d+)$'))
  end
  local result = 0
  if not owns(lease, token) then
    result = -1
  elseif lost(stream, first) then
    result = -2
  else
    for k = 0, count - 1 do
      local ok
      local logprob = with_logprobs and argv[texts + count + k] or ''
      if logprob == '' then
        ok = redis.pcall('XADD', stream, '0-' .. (seq + k), 'event', 'token',
          'index', seq + k - 1, 'token_id', argv[ids + k], 'text', argv[texts + k])
      else
        ok = redis.pcall('XADD', stream, '0-' .. (seq + k), 'event', 'token',
          'index', seq + k - 1, 'token_id', argv[ids + k], 'text', argv[texts + k],
          'logprob', logprob)
      end
      ok = stored(ok)
      if type(ok) == 'string' then result = ok break end
      result = result + ok
    end
    if has_end and type(result) == 'number' then
      local fields = {}
      for k = 1, nfields * 2 do fields[k] = argv[after + 1 + k] end
      local ended = end_stream(stream, lease, token, argv[after], fields)
      if type(ended) == 'string' then result = ended else result = result + ended end
    end
  end
  results[#results + 1] = result
end
return results
"""
_WRITE = _WRITE_BODY.replace("\nlocal ttl", "\nlocal K = KEYS\nlocal ttl", 1)
_WRITE_NODE = "#!lua flags=allow-cross-slot-keys" + _WRITE_BODY.replace(
    "\nlocal ttl", "\nlocal K = cmsgpack.unpack(ARGV[3])\nlocal ttl", 1
)
"""`_WRITE` for a whole Redis Cluster node in one call: the keys of many slots (all the
node's own) come in ARGV[3], a MessagePack array, since a call may declare keys of one
slot only. Redis 7 refuses a key that is not the node's ("non local key"): then the
batch goes the per-slot way. The script's writes are idempotent, so a call that stopped
part way is simply written again."""

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

_COMPACT = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
if not last then return 0 end
local fields = last[2]
for i = 1, #fields, 2 do
  if fields[i] == 'event' then
    if fields[i + 1] == 'done' or fields[i + 1] == 'error' then
      return redis.call('XTRIM', KEYS[1], 'MAXLEN', 1)
    end
    return 0
  end
end
return 0
"""
"""Trim a finished stream to its terminal entry (which holds `generated_text`); a stream
whose last entry is not terminal (expired and begun again) is left alone."""

ScriptCall = tuple[Sequence[Any], Sequence[Any]]
"""A script's KEYS and ARGV."""

Entry = tuple[str, str, Fields]
"""(stream key, entry id, fields): one entry to append."""


REPLICA_WAIT_MS = 2000

# KEYS: a probe stream under the prefix, a side key of it. Every command the worker's
# scripts call, each as `pcall` (ACL refuses a script's calls one by one, without naming
# the command): the names of those refused. The probe keys are removed at the end.
_PROBE = """
local refused = {}
local function try(name, ...)
  local reply = redis.pcall(name, ...)
  if type(reply) == 'table' and reply.err then refused[#refused + 1] = name end
end
try('XADD', KEYS[1], '*', 'probe', '1')
try('XLEN', KEYS[1])
try('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
try('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
try('XTRIM', KEYS[1], 'MAXLEN', 0)
try('EXISTS', KEYS[1])
try('EXPIRE', KEYS[1], 10)
try('PEXPIRE', KEYS[1], 10000)
try('SET', KEYS[2], 'probe', 'PX', 10000)
try('GET', KEYS[2])
try('DEL', KEYS[1], KEYS[2])
return refused
"""
PROBE_ID = "trtllm-worker-acl-probe"


class Ended(enum.Enum):
    """What `StreamStore.end` did."""

    STORED = "stored"
    ALREADY_ENDED = "already ended"
    """The stream ends with a terminal entry already (an earlier attempt stored it)."""
    NOT_OURS = "not ours"
    """The fence refused: another worker holds the request's lease."""
    ENTRIES_LOST = "entries lost"
    """Not written: the stream lacks entries before this one (see `ENTRIES_LOST_REASON`)."""


@dataclass(slots=True)
class StreamState:
    """What a job finds in its stream when it is taken."""

    terminal: bool = False
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    cancelled: bool = False


async def mark_cancelled(client: aioredis.Redis | RedisCluster, key: str, ttl_s: int) -> None:
    """Remember a cancel for a request that may not have been taken yet (the worker's
    cancel listener and the SDK's `cancel` both store it)."""
    await client.set(cancel_key(key), b"1", ex=ttl_s)


class WriteBatch:
    """The `_WRITE` calls of one batch, built as the engine's outputs are read: per
    stream a part (its tokens in columns, then maybe its terminal entry) appended
    straight to the script's KEYS and ARGV, so the worker makes no object per token and
    sends two values per token (the script builds each entry's id, index and field
    names). Grouped per hash slot (one group on a single node): a call may declare keys
    of one slot only, and the store sends a cluster's groups one call per node."""

    __slots__ = ("_cluster", "_code_at", "_key", "calls", "ended")

    def __init__(self, *, cluster: bool = False) -> None:
        self._cluster = cluster
        self.calls: dict[int, tuple[list[Any], list[Any]]] = {}
        """Per hash slot (0 on a single node): the call's KEYS and its parts' values
        (`StreamStore.write` sends them as one MessagePack array after the TTL)."""
        self.ended: list[str] = []
        """The streams that get their terminal entry."""
        self._code_at = 0
        self._key = ""

    def __bool__(self) -> bool:
        return bool(self.calls)

    def begin(self, keys: tuple[str, str], slot: int, lease: str, seq: int) -> list[Any]:
        """Open a part for the stream `keys` (stream and lease key) whose next entry is
        `seq`, fenced by `lease`; returns the ARGV to append its columns to."""
        call = self.calls.get(slot if self._cluster else 0)
        if call is None:
            call = self.calls[slot if self._cluster else 0] = ([], [])
        call[0].extend(keys)
        self._key = keys[0]
        args = call[1]
        self._code_at = len(args) + 2
        args += (lease, seq, 0)
        return args

    def plain(
        self, keys: tuple[str, str], slot: int, lease: str, seq: int,
        token_ids: Sequence[int], texts: Sequence[str],
    ) -> None:  # fmt: skip
        """A whole part of token entries without logprobs or end: `begin` and `tokens`
        in one call (the hot path: a step of a running request)."""
        call = self.calls.get(slot if self._cluster else 0)
        if call is None:
            call = self.calls[slot if self._cluster else 0] = ([], [])
        call[0].extend(keys)
        args = call[1]
        args += (lease, seq, len(token_ids) * 4)
        args += token_ids
        args += texts

    def tokens(
        self, args: list[Any], token_ids: Sequence[int], texts: Sequence[str],
        logprobs: Sequence[float | str] | None = None,
    ) -> None:  # fmt: skip
        """The open part's token entries (logprobs: '' for none)."""
        args += token_ids
        args += texts
        if logprobs is None:
            args[self._code_at] = len(token_ids) * 4
        else:
            args += logprobs
            args[self._code_at] = len(token_ids) * 4 + 2

    def end(self, args: list[Any], seq_id: str, fields: Fields) -> None:
        """The open part's terminal entry (`seq_id` AFTER_TAIL: after the stream's tail)."""
        args[self._code_at] += 1
        self.ended.append(self._key)
        args += (seq_id, len(fields), *chain.from_iterable(fields.items()))

    def per_stream(self) -> list[tuple[str, WriteBatch]]:
        """The batch as one batch per stream (its parts in order), to write the streams
        one by one when Redis refused the batch (`StreamStore.write_each`)."""
        streams: dict[str, WriteBatch] = {}
        for slot, (keys, args) in self.calls.items():
            a = 0
            for k in range(0, len(keys), 2):
                code = int(args[a + 2])
                count = code // 4
                end = a + 3 + (3 if code & 2 else 2) * count
                if code & 1:
                    end += 2 + 2 * int(args[end + 1])
                one = streams.get(keys[k])
                if one is None:
                    one = streams[keys[k]] = WriteBatch(cluster=self._cluster)
                call = one.calls.setdefault(slot, ([], []))
                call[0].extend(keys[k : k + 2])
                call[1].extend(args[a:end])
                if code & 1:
                    one.ended.append(keys[k])
                a = end
        return list(streams.items())

    def entries(self) -> list[Entry]:
        """The entries the batch stores, in order per stream, as subscribers will read
        them (a terminal entry after the tail shows its id as AFTER_TAIL)."""
        stored: list[Entry] = []
        for keys, args in self.calls.values():
            a = 0
            for key in keys[::2]:
                seq, code = int(args[a + 1]), int(args[a + 2])
                count, a = code // 4, a + 3
                ids, texts = args[a : a + count], args[a + count : a + 2 * count]
                a += 2 * count
                logprobs = [""] * count
                if code & 2:
                    logprobs, a = args[a : a + count], a + count
                for k in range(count):
                    fields: Fields = {
                        "event": TOKEN, "index": seq - 1 + k, "token_id": ids[k], "text": texts[k]
                    }  # fmt: skip
                    if logprobs[k] != "":
                        fields["logprob"] = float(logprobs[k])
                    stored.append((key, entry_id(seq + k), fields))
                if code & 1:
                    seq_id, nfields = args[a], int(args[a + 1])
                    flat = args[a + 2 : a + 2 + 2 * nfields]
                    stored.append((key, seq_id, dict(zip(flat[::2], flat[1::2], strict=True))))
                    a += 2 + 2 * nfields
        return stored

    @classmethod
    def of_entries(
        cls, entries: Sequence[Entry], leases: Mapping[str, str], *, cluster: bool = False
    ) -> WriteBatch:
        """A batch of whole entries (in order; token entries of a stream with contiguous
        ids), for callers that hold entries rather than an engine's columns."""
        batch = cls(cluster=cluster)
        open_part: tuple[str, list[Any], int] | None = None  # key, args, next seq
        pending: list[tuple[int, str, float | str]] = []

        def flush() -> None:
            if open_part is not None and pending:
                ids, texts, logprobs = (list(column) for column in zip(*pending, strict=True))
                with_logprobs = any(logprob != "" for logprob in logprobs)
                batch.tokens(open_part[1], ids, texts, logprobs if with_logprobs else None)
            pending.clear()

        for key, seq_id, fields in entries:
            seq = int(seq_id.rsplit("-", 1)[1]) if seq_id else 0
            if (
                open_part is None
                or open_part[0] != key
                or (fields["event"] == TOKEN and open_part[2] != seq)
            ):
                flush()
                slot = key_slot(key.encode()) if cluster else 0
                args = batch.begin((key, lease_key(key)), slot, leases.get(key, ""), seq or 1)
                open_part = (key, args, seq)
            if fields["event"] == TOKEN:
                pending.append(
                    (int(fields["token_id"]), str(fields["text"]), fields.get("logprob", ""))
                )
                open_part = (key, open_part[1], seq + 1)
            else:
                flush()
                batch.end(open_part[1], seq_id, fields)
                open_part = None
        flush()
        return batch


class StreamStore:
    """All the worker's Redis I/O, on one client."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        ttl_s: int,
        lease_ttl_s: float = 10.0,
        min_replicas: int = 0,
        compact_after_s: float | None = None,
    ) -> None:
        self.client = client
        self.compact_after_s = compact_after_s
        """Set: that long after a stream ends, `compact` trims it (a timer in this
        process: a worker that stops first leaves the stream whole until its TTL)."""
        self._compactions: set[asyncio.Task[int]] = set()
        self._starts: list[tuple[list[Any], list[Any], asyncio.Future[Any]]] = []
        self._start_tasks: set[asyncio.Task[None]] = set()
        self._compaction_timers: set[asyncio.TimerHandle] = set()
        self.cluster = isinstance(client, RedisCluster)
        if self.cluster and min_replicas:
            raise ConfigError(
                "WORKER_REDIS_MIN_REPLICAS is not supported on Redis Cluster (yet): leave it 0"
            )
        self.min_replicas = min_replicas
        """A batch that ends streams waits (Redis WAIT, on the connection that wrote it)
        until that many replicas hold it; fewer raise `NotReplicated`."""
        """On Redis Cluster one script may only touch keys of one hash slot: a batch is
        split per slot (a request's keys share its stream's slot)."""
        self._ttl_s = ttl_s
        self._lease_ms = max(int(lease_ttl_s * 1000), 1)
        self._write = client.register_script(_WRITE)
        self._write_node = client.register_script(_WRITE_NODE)
        self._node_calls = self.cluster
        """On a cluster, whether a batch goes as one call per node (off after a node
        refused the script itself: a Redis before 7.0)."""
        self._node_script_loaded = False
        self._renew = client.register_script(_RENEW)
        self._start = client.register_script(_START)
        self._release = client.register_script(_RELEASE)
        self._compact = client.register_script(_COMPACT)

    async def ping(self) -> bool:
        """Whether Redis answers: the one health check of the worker and `check`."""
        return bool(await self.client.ping())

    async def refused_commands(self, prefix: str) -> list[str]:
        """The commands the worker needs that this Redis user may not run on keys under
        `prefix` (ACL), found by running each once on a probe key: at start, so a missing
        grant stops the worker with one line instead of failing every job."""
        stream = prefix + PROBE_ID
        keys = [stream, lease_key(stream)]
        counter = deliveries_key(stream)
        try:
            sha = await self.client.script_load(_PROBE)
        except ResponseError as exc:
            return ["SCRIPT LOAD"] if _refused(exc) else []
        try:
            refused = [bytes(n).decode() if isinstance(n, bytes) else str(n)
                       for n in await self.client.evalsha(sha, len(keys), *keys)]  # fmt: skip
        except ResponseError as exc:
            if not _refused(exc):
                raise
            return ["EVALSHA"]
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(counter)
        pipe.expire(counter, 10)
        pipe.set(cancel_key(stream), b"probe", px=10_000)
        pipe.delete(counter, cancel_key(stream))
        if self.min_replicas and isinstance(self.client, aioredis.Redis):
            pipe.execute_command("WAIT", 0, 1)
        names = ["INCRBY", "EXPIRE", "SET", "DEL", "WAIT"]  # redis-py's incr is INCRBY
        for name, reply in zip(names, await pipe.execute(raise_on_error=False), strict=False):
            if isinstance(reply, ResponseError) and _refused(reply) and name not in refused:
                refused.append(name)
        return refused

    async def close(self) -> None:
        for timer in self._compaction_timers:
            timer.cancel()
        for task in self._compactions:
            task.cancel()
        await self.client.aclose()

    async def compact(self, keys: Sequence[str]) -> int:
        """Trim finished streams to their terminal entry now; returns the entries
        removed."""
        if not keys:
            return 0
        return sum(await self._each(self._compact, [(key, []) for key in keys]))

    def _compact_later(self, keys: Sequence[str]) -> None:
        if self.compact_after_s is None or not keys:
            return
        timer: asyncio.TimerHandle | None = None

        def due() -> None:
            assert timer is not None
            self._compaction_timers.discard(timer)
            self._start_compaction(list(keys))

        timer = asyncio.get_running_loop().call_later(self.compact_after_s, due)
        self._compaction_timers.add(timer)

    def _start_compaction(self, keys: list[str]) -> None:
        task = asyncio.get_running_loop().create_task(self.compact(keys))
        self._compactions.add(task)
        task.add_done_callback(self._compaction_done)

    def _compaction_done(self, task: asyncio.Task[int]) -> None:
        self._compactions.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # a lost compaction costs memory until the TTL, nothing else
            log.warning("compacting finished streams failed: %s", task.exception())

    # -- writing --------------------------------------------------------------------

    async def write(self, batch: WriteBatch) -> dict[str, str]:
        """Store one batch in one round trip: per stream its entries in order, fenced by
        the lease token its part names ('': written only while nobody holds the lease).
        A terminal entry ends its stream (expiry, lease released). Returns the keys not
        written, with why: the fence refused, or Redis refused the key for good (it is
        not a stream). Raises on connection errors (then the batch can be retried: ids
        make a retry idempotent). On a cluster: one call per node (`_cluster_write`)."""
        if not batch:
            return {}
        if self.cluster:
            replies = await self._cluster_write(batch)
        else:
            keys, values = batch.calls[0]
            argv = self._argv(values)
            if self.min_replicas and batch.ended:
                replies = [await self._replicated(keys, argv)]
            else:
                replies = [await self._write(keys, argv)]
        refused: dict[str, str] = {}
        for (keys, _), reply in zip(batch.calls.values(), replies, strict=True):
            for key, result in zip(keys[::2], reply, strict=True):
                if result.__class__ is int and result >= 0:
                    continue
                if isinstance(result, bytes):
                    refused[key] = result.decode(errors="replace")
                elif result == LEASE_LOST:
                    refused[key] = LEASE_LOST_REASON
                elif result == ENTRIES_LOST:
                    refused[key] = ENTRIES_LOST_REASON
        if self.compact_after_s is not None:
            self._compact_later([key for key in batch.ended if key not in refused])
        return refused

    async def write_each(self, batch: WriteBatch) -> dict[str, str]:
        """`write`, one stream at a time: after Redis refused the whole batch with a
        script error (`refused_for_good`), so that only the streams at fault fail. Returns
        the keys not written with why, those Redis refused included; raises as `write`
        does on connection errors and on errors that are the server's state."""
        refused: dict[str, str] = {}
        for key, one in batch.per_stream():
            try:
                refused.update(await self.write(one))
            except ResponseError as exc:
                if not refused_for_good(exc):
                    raise
                refused[key] = f"Redis refused its write: {exc}"
        return refused

    async def _cluster_write(self, batch: WriteBatch) -> list[Any]:
        """Per slot call its results: one call per node (`_node_writes`), and the calls
        of a node whose call failed one per slot, pipelined per node (`_pipelined`)."""
        replies = await self._node_writes(batch)
        missing = [i for i, reply in enumerate(replies) if reply is None]
        if missing:  # per slot, following MOVED and failovers
            calls = list(batch.calls.values())
            again = await self._pipelined(
                self._write, [(calls[i][0], self._argv(calls[i][1])) for i in missing]
            )
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    def _argv(self, values: list[Any]) -> list[Any]:
        """`_WRITE`'s ARGV: the TTL, then the parts' values as one MessagePack array (one
        argument to pack and parse instead of several per token)."""
        return [self._ttl_s, msgpack.packb(values)]

    async def end(
        self, key: str, fields: Fields, lease: str = "", seq_id: str = AFTER_TAIL
    ) -> Ended:
        """End one stream with `fields` (a `done` or `error` entry) through the same fenced
        path as a batch: with `lease` its holder's token, or '' for a job that took none
        (it then writes only where no worker holds the lease). `seq_id` AFTER_TAIL
        appends after whatever the stream holds, unless it has ended already. Raises
        `StreamUnusable` when the key is not a stream."""
        batch = WriteBatch()
        batch.end(batch.begin((key, lease_key(key)), 0, lease, 1), seq_id, fields)
        keys, values = batch.calls[0]
        args = self._argv(values)
        if self.min_replicas:
            reply = await self._replicated(keys, args)
        else:
            reply = await self._write(keys=keys, args=args)
        result = reply[0]
        if isinstance(result, bytes):
            raise StreamUnusable(f"stream key {key!r} cannot be written: {result.decode()}")
        if result == LEASE_LOST:
            return Ended.NOT_OURS
        if result == ENTRIES_LOST:
            return Ended.ENTRIES_LOST
        if result:
            self._compact_later([key])
            return Ended.STORED
        return Ended.ALREADY_ENDED

    # -- leases ---------------------------------------------------------------------

    async def renew_leases(self, leases: Mapping[str, str]) -> list[str]:
        """Renew every (stream key → token) lease in one round trip; returns the keys
        whose lease is no longer theirs."""
        if not leases:
            return []
        calls = [(lease_key(key), [token, self._lease_ms]) for key, token in leases.items()]
        results = await self._each(self._renew, calls)
        return [key for key, renewed in zip(leases, results, strict=True) if not renewed]

    async def _replicated(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """`_WRITE`, then `NotReplicated` unless the replicas hold it."""
        reply, replicas = await self._then_wait(self._write, keys, args)
        if replicas < self.min_replicas:
            raise NotReplicated(
                f"the terminal entries reached {replicas} of the {self.min_replicas} replicas"
                f" WORKER_REDIS_MIN_REPLICAS asks for within {REPLICA_WAIT_MS} ms"
            )
        return reply

    async def _then_wait(
        self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]
    ) -> tuple[Any, int]:
        """`script`, then WAIT on the same connection (WAIT counts the replicas that hold
        this connection's writes): its reply and how many replicas hold it."""
        assert isinstance(self.client, aioredis.Redis)
        pipe = self.client.pipeline(transaction=False)
        await script(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAIT", self.min_replicas, REPLICA_WAIT_MS)
        reply, replicas = await pipe.execute()
        return reply, int(replicas)

    async def _node_writes(self, batch: WriteBatch) -> list[Any]:
        """A cluster batch as one `_WRITE_NODE` call per node the client's slot map
        names, all nodes at once; per slot call its results, None for the calls of a
        node whose call failed (a slot moved, a failover, the script not loaded there):
        the caller writes those per slot, which follows MOVED and retries."""
        unwritten: list[Any] = [None] * len(batch.calls)
        if not self._node_calls:
            return unwritten
        assert isinstance(self.client, RedisCluster)
        if not self._node_script_loaded:
            try:
                await self.client.script_load(self._write_node.script)
            except ResponseError as exc:  # a Redis without script flags
                log.info("one write call per slot (the nodes refuse per-node scripts: %s)", exc)
                self._node_calls = False
                return unwritten
            self._node_script_loaded = True
        nodes = self.client.nodes_manager
        slots = list(batch.calls)
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        try:
            for position, slot in enumerate(slots):
                node = nodes.get_node_from_slot(slot)
                by_node.setdefault(node.name, (node, []))[1].append(position)
        except RedisClusterException:  # the slot is not covered: a failover under way
            return unwritten
        calls = list(batch.calls.values())
        commands: list[tuple[ClusterNode, list[int], tuple[Any, ...]]] = []
        for node, positions in by_node.values():
            keys = [key for p in positions for key in calls[p][0]]
            values = [value for p in positions for value in calls[p][1]]
            packed = (msgpack.packb(values), msgpack.packb(keys))
            command = ("EVALSHA", self._write_node.sha, 0, self._ttl_s, *packed)
            commands.append((node, positions, command))
        done = await asyncio.gather(
            *(_node_call(node, command) for node, _, command in commands),
            return_exceptions=True,
        )
        replies = unwritten
        for (_, positions, _), reply in zip(commands, done, strict=True):
            if isinstance(reply, BaseException):
                if isinstance(reply, NoScriptError):
                    self._node_script_loaded = False
                log.debug("a node's write call failed (%s); its slots go one by one", reply)
                continue
            results = iter(reply)
            for p in positions:
                replies[p] = [next(results) for _ in range(len(calls[p][0]) // 2)]
        return replies

    async def _pipelined(self, script: AsyncScript, calls: Sequence[ScriptCall]) -> list[Any]:
        """One call of `script` per (keys, args) on a cluster. First `_per_node`; when it
        fails, redis-py's cluster pipeline, which sends each node its calls in one
        pipeline, all nodes at once, and follows MOVED, ASK and TRYAGAIN. That pipeline
        refuses `evalsha()` (it could not load a missing script on the right node), so
        EVALSHA is sent as a plain command and a NOSCRIPT (a node that never saw the
        script: a new master, a restarted one) loads it on every master and runs the
        calls again. Every call may run twice: the scripts are idempotent."""
        replies = await self._per_node(script, calls)
        if replies is not None:
            return replies
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            try:
                return list(await pipe.execute())
            except NoScriptError:
                if attempt == 2:
                    raise
                await self.client.script_load(script.script)
        raise AssertionError("unreachable")

    async def _per_node(self, script: AsyncScript, calls: Sequence[ScriptCall]) -> list[Any] | None:
        """The common case at a fraction of the cluster pipeline's cost, which works out
        each call's slot and node again, resolves a policy and opens a timeout per
        command: each call to the node the client's slot map names, one plain pipeline
        per node under one timeout, all nodes at once. None when anything failed (a
        MOVED after a resharding, a node gone, NOSCRIPT, a script error): the cluster
        pipeline then runs every call again, and follows, retries or raises."""
        assert isinstance(self.client, RedisCluster)
        nodes = self.client.nodes_manager
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        try:
            for position, (keys, _) in enumerate(calls):
                node = nodes.get_node_from_slot(key_slot(keys[0].encode()))
                by_node.setdefault(node.name, (node, []))[1].append(position)
        except RedisClusterException:  # the slot is not covered: a failover under way
            return None
        replies: list[Any] = [None] * len(calls)
        commands = [("EVALSHA", script.sha, len(keys), *keys, *args) for keys, args in calls]
        done = await asyncio.gather(
            *(_node_pipeline(node, commands, positions, replies)
              for node, positions in by_node.values()),
            return_exceptions=True,
        )  # fmt: skip
        return replies if all(ok is True for ok in done) else None

    async def _each(self, script: AsyncScript, calls: list[tuple[str, list[Any]]]) -> list[Any]:
        """One single-key script per call, pipelined (per node on a cluster)."""
        return await self._many(script, [([key], args) for key, args in calls])

    async def _many(
        self, script: AsyncScript, calls: Sequence[ScriptCall], *, raise_on_error: bool = True
    ) -> list[Any]:
        """One call of `script` per (keys, args), in one round trip: EVALSHA pipelined,
        the script loaded and the calls sent again on NOSCRIPT (a restarted or new
        master), rather than redis-py's script pipeline, which asks SCRIPT EXISTS first
        every time. `raise_on_error=False`: a call's error is its reply (cluster: the
        first error raises)."""
        if self.cluster:
            return await self._pipelined(script, calls)
        assert isinstance(self.client, aioredis.Redis)
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            replies = list(await pipe.execute(raise_on_error=False))
            if attempt == 1 and any(isinstance(reply, NoScriptError) for reply in replies):
                await self.client.script_load(script.script)
                continue
            if raise_on_error:
                for reply in replies:
                    if isinstance(reply, Exception):
                        raise reply
            return replies
        raise AssertionError("unreachable")

    async def _start_soon(self, keys: list[Any], args: list[Any]) -> Any:
        """`_START` for one job, sent with the other jobs' starts of this event-loop turn
        in one round trip (a burst of short jobs otherwise costs a connection, a write
        and a read each)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._starts.append((keys, args, future))
        if len(self._starts) == 1:
            loop.call_soon(self._send_starts)
        return await future

    def _send_starts(self) -> None:
        starts, self._starts = self._starts, []
        task = asyncio.get_running_loop().create_task(self._run_starts(starts))
        self._start_tasks.add(task)
        task.add_done_callback(self._start_tasks.discard)

    async def _run_starts(
        self, starts: list[tuple[list[Any], list[Any], asyncio.Future[Any]]]
    ) -> None:
        try:
            replies = await self._many(
                self._start, [(keys, args) for keys, args, _ in starts], raise_on_error=False
            )
        except Exception as exc:  # the connection failed: every job retries (theirs to decide)
            replies = [exc] * len(starts)
        for (_, _, future), reply in zip(starts, replies, strict=True):
            if future.done():  # its job was cancelled meanwhile; the lease expires
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def release_leases(self, leases: Mapping[str, str]) -> None:
        if not leases:
            return
        await self._each(
            self._release, [(lease_key(key), [token]) for key, token in leases.items()]
        )

    # -- reading --------------------------------------------------------------------

    async def start(self, key: str, token: str) -> StreamState | None:
        """Take the request's lease and read what its stream holds, in one round trip
        (the whole stream only when a resume needs it). None: another worker holds the
        lease. Raises `StreamUnusable` when the key is not a stream."""
        keys = [key, lease_key(key), cancel_key(key)]
        args: list[Any] = [token, self._lease_ms]
        replicas = 0
        if self.min_replicas:
            # WAIT after the lease write: what the stream holds (a terminal entry above
            # all, which acknowledges the job) is on the replicas too, not only on a
            # master that a failover is about to demote
            reply, replicas = await self._then_wait(self._start, keys, args)
        else:
            reply = await self._start_soon(keys, args)
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
            if replicas < self.min_replicas:
                raise NotReplicated(
                    f"the stream's terminal entry is on {replicas} of the {self.min_replicas}"
                    " replicas WORKER_REDIS_MIN_REPLICAS asks for"
                )
            state.terminal = True
            return state
        await self._read_tokens(key, state)
        return state

    async def _read_tokens(self, key: str, state: StreamState) -> None:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await self.client.xrange(key)  # type: ignore[assignment]
        for _, entry in entries:
            if entry.get(b"event") == b"token":
                state.token_ids.append(int(entry[b"token_id"]))
                state.texts.append(entry[b"text"].decode())

    async def mark_cancelled(self, key: str) -> None:
        await mark_cancelled(self.client, key, self._ttl_s)

    async def count_delivery(self, key: str) -> int:
        """Count one more redelivery of this request's message; returns the count (for
        classic queues, which do not count deliveries themselves)."""
        counter = deliveries_key(key)
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(counter)
        pipe.expire(counter, self._ttl_s)
        count, _ = await pipe.execute()
        return int(count)


_SERVER_STATE = ("BUSY", "LOADING", "MASTERDOWN", "MISCONF", "NOREPLICAS", "NOSCRIPT")
"""Error codes that say what state the server is in (a script running long, a dataset
loading, a failing disk, too few replicas), whatever the request."""


def refused_for_good(exc: BaseException) -> bool:
    """A Redis error that the same call would meet again, whatever the server's state: a
    script error on one request's keys (a key of the wrong type, an expiry Redis cannot
    set). Not: connection errors, a read-only replica, out of memory, cluster states, an
    ACL refusal (the configuration: every stream meets it) or the codes of
    `_SERVER_STATE`."""
    if not isinstance(exc, ResponseError) or isinstance(
        exc,
        NoScriptError
        | ReadOnlyError
        | OutOfMemoryError
        | NoPermissionError
        | ClusterDownError
        | TryAgainError,
    ):
        return False
    return not str(exc).startswith(_SERVER_STATE) and not _refused(exc)


def _refused(exc: ResponseError) -> bool:
    """An ACL refusal: NOPERM (redis-py strips the code into the type), or a script's
    call refused ("can't run this command")."""
    return isinstance(exc, NoPermissionError) or "can't run this command" in str(exc)


async def _node_call(node: ClusterNode, command: tuple[Any, ...]) -> Any:
    """One command to one node on a connection of its own pool; its reply, or the error
    it replied (raised). A connection that fails is dropped by redis-py."""
    connection = node.acquire_connection()
    try:
        async with asyncio.timeout(connection.socket_timeout):
            await connection.send_packed_command(connection.pack_command(*command))
            return await connection.read_response(timeout=math.inf)
    except TimeoutError:
        await connection.disconnect(nowait=True)
        raise
    finally:
        node.release(connection)


async def _node_pipeline(
    node: ClusterNode, commands: list[tuple[Any, ...]], positions: list[int], replies: list[Any]
) -> bool:
    """`commands[positions]` to one node in one write, their replies into `replies`
    (False: one was an error). Every reply is read, so the connection stays in step; a
    connection that fails is dropped by redis-py and not reused."""
    connection = node.acquire_connection()
    ok = True
    try:
        async with asyncio.timeout(connection.socket_timeout):
            await connection.send_packed_command(
                connection.pack_commands(commands[p] for p in positions)
            )
            for position in positions:
                try:
                    replies[position] = await connection.read_response(timeout=math.inf)
                except ResponseError:
                    ok = False
    except TimeoutError:
        await connection.disconnect(nowait=True)
        raise
    finally:
        node.release(connection)
    return ok
