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
  cost Redis more than the appends); token entries travel without their field names.
  On Redis Cluster a script may only touch one hash slot: one call per slot, sent as
  one pipeline per node."""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.commands.core import AsyncScript
from redis.crc import key_slot
from redis.exceptions import NoScriptError, RedisClusterException, ResponseError

from worker.contract.errors import ConfigError, StreamUnusable
from worker.contract.stream import (
    TERMINAL_EVENTS,
    TOKEN,
    Fields,
    cancel_key,
    deliveries_key,
    entry_id,
    lease_key,
)
from worker.streams.connect import NotReplicated

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

# ARGV[1]: the TTL of a finished stream. Then per stream (KEYS: stream, lease, ...):
# lease token ('': the caller holds none), the seq of its first token entry, the number
# n of token entries, 1 when logprobs follow (else 0), then n token ids, n texts, (n
# logprobs, '' for none), then 0, or 1 and the terminal entry: id ('': after the tail,
# unless the stream has ended already), the number of fields, field, value, ... Token
# entry k (from 0) gets id 0-<seq + k> and index seq + k - 1. Returns per stream the
# entries written, -1 when the fence refused (the lease is another's, or anyone's when
# the caller holds none), -2 when the stream lacks entries before the first one given
# (nothing is written), or 'WRONGTYPE ...' for a key that is not a stream; any other
# error fails the call. An entry refused as "equal or smaller" was stored by an earlier
# try and is skipped.
_WRITE = """
local ttl = tonumber(ARGV[1])

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
local a = 2
for s = 1, #KEYS, 2 do
  local stream, lease, token = KEYS[s], KEYS[s + 1], ARGV[a]
  local seq, count = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local with_logprobs = ARGV[a + 3] == '1'
  local ids, texts = a + 4, a + 4 + count
  local after = texts + (with_logprobs and 2 or 1) * count
  local has_end = ARGV[after] == '1'
  local nfields = has_end and tonumber(ARGV[after + 2]) or 0
  a = has_end and after + 3 + nfields * 2 or after + 1
  local first = nil
  if count > 0 then
    first = seq
  elseif has_end and ARGV[after + 1] ~= '' then
    first = tonumber(string.match(ARGV[after + 1], '-(%d+)$'))
  end
  local result = 0
  if not owns(lease, token) then
    result = -1
  elseif lost(stream, first) then
    result = -2
  else
    for k = 0, count - 1 do
      local ok
      local logprob = with_logprobs and ARGV[texts + count + k] or ''
      if logprob == '' then
        ok = redis.pcall('XADD', stream, '0-' .. (seq + k), 'event', 'token',
          'index', seq + k - 1, 'token_id', ARGV[ids + k], 'text', ARGV[texts + k])
      else
        ok = redis.pcall('XADD', stream, '0-' .. (seq + k), 'event', 'token',
          'index', seq + k - 1, 'token_id', ARGV[ids + k], 'text', ARGV[texts + k],
          'logprob', logprob)
      end
      ok = stored(ok)
      if type(ok) == 'string' then result = ok break end
      result = result + ok
    end
    if has_end and type(result) == 'number' then
      local fields = {}
      for k = 1, nfields * 2 do fields[k] = ARGV[after + 2 + k] end
      local ended = end_stream(stream, lease, token, ARGV[after + 1], fields)
      if type(ended) == 'string' then result = ended else result = result + ended end
    end
  end
  results[#results + 1] = result
end
return results
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


@dataclass(slots=True)
class StreamWrite:
    """One stream's part of a batch, as the engine hands it over: its token entries in
    columns (entry k has index `first_seq - 1 + k` and id `0-<first_seq + k>`), then
    maybe its terminal entry. Columns, not an entry per token: the script builds each
    entry's id and fields, so the worker sends two values per token and makes no
    object per token."""

    key: str
    first_seq: int
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[float | str] | None = None
    """Per token its logprob, '' for none; None: the request asked for none."""
    end: tuple[str, Fields] | None = None
    """(entry id or AFTER_TAIL, fields) of the terminal entry."""

    def entries(self) -> list[Entry]:
        """The entries this write stores, as subscribers will read them."""
        stored: list[Entry] = []
        for k, (token_id, text) in enumerate(zip(self.token_ids, self.texts, strict=True)):
            fields: Fields = {
                "event": TOKEN,
                "index": self.first_seq - 1 + k,
                "token_id": token_id,
                "text": text,
            }
            if self.logprobs is not None and self.logprobs[k] != "":
                fields["logprob"] = self.logprobs[k]
            stored.append((self.key, entry_id(self.first_seq + k), fields))
        if self.end is not None:
            stored.append((self.key, *self.end))
        return stored


def writes_of(entries: Sequence[Entry]) -> list[StreamWrite]:
    """Entries (in order, token entries with contiguous ids per stream) as writes: for
    callers that hold whole entries rather than an engine's columns."""
    writes: list[StreamWrite] = []
    last: dict[str, StreamWrite] = {}
    for key, seq_id, fields in entries:
        write = last.get(key)
        if fields["event"] != TOKEN:
            if write is None or write.end is not None:
                write = last[key] = StreamWrite(key, 1)
                writes.append(write)
            write.end = (seq_id, fields)
            continue
        seq = int(seq_id.rsplit("-", 1)[1])
        if write is None or write.end is not None or write.first_seq + len(write.texts) != seq:
            write = last[key] = StreamWrite(key, seq)
            writes.append(write)
        write.token_ids.append(int(fields["token_id"]))
        write.texts.append(str(fields["text"]))
        if "logprob" in fields:
            if write.logprobs is None:
                write.logprobs = [""] * (len(write.texts) - 1)
            write.logprobs.append(float(fields["logprob"]))
        elif write.logprobs is not None:
            write.logprobs.append("")
    return writes


def _write_call(
    writes: Sequence[StreamWrite], leases: Mapping[str, str], ttl_s: int
) -> tuple[list[Any], list[Any]]:
    """The `_WRITE` script's KEYS and ARGV for these writes."""
    script_keys: list[Any] = []
    args: list[Any] = [ttl_s]
    for write in writes:
        key = write.key
        script_keys += (key, lease_key(key))
        lease = leases.get(key, "")
        if write.logprobs is None:
            args += (lease, write.first_seq, len(write.token_ids), 0)
            args += write.token_ids
            args += write.texts
        else:
            args += (lease, write.first_seq, len(write.token_ids), 1)
            args += write.token_ids
            args += write.texts
            args += write.logprobs
        if write.end is None:
            args.append(0)
        else:
            seq_id, fields = write.end
            args += (1, seq_id, len(fields), *chain.from_iterable(fields.items()))
    return script_keys, args


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
        self._renew = client.register_script(_RENEW)
        self._start = client.register_script(_START)
        self._release = client.register_script(_RELEASE)
        self._compact = client.register_script(_COMPACT)

    async def ping(self) -> bool:
        """Whether Redis answers: the one health check of the worker and `check`."""
        return bool(await self.client.ping())

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

    async def write(
        self, writes: Sequence[StreamWrite], leases: Mapping[str, str]
    ) -> dict[str, str]:
        """Store one batch in one round trip: per stream its entries in order, fenced by
        its lease token in `leases` (a stream without one is written only while nobody
        holds its lease). A terminal entry ends its stream (expiry, lease released).
        Returns the keys not written, with why: the fence refused, or Redis refused the
        key for good (it is not a stream). Raises on connection errors (then the batch
        can be retried: ids make a retry idempotent). On a cluster: one call per hash
        slot, pipelined per node (`_pipelined`)."""
        if not writes:
            return {}
        groups = self._slot_groups(writes)
        calls = [_write_call(group, leases, self._ttl_s) for group in groups]
        if self.cluster:
            replies = await self._pipelined(self._write, calls)
        elif self.min_replicas and any(write.end for write in writes):
            replies = [await self._replicated(*calls[0])]
        else:
            replies = [await self._write(*calls[0])]
        refused: dict[str, str] = {}
        results = (result for reply in replies for result in reply)
        for write, result in zip((w for group in groups for w in group), results, strict=True):
            if result.__class__ is int and result >= 0:
                continue
            if isinstance(result, bytes):
                refused[write.key] = result.decode(errors="replace")
            elif result == LEASE_LOST:
                refused[write.key] = LEASE_LOST_REASON
            elif result == ENTRIES_LOST:
                refused[write.key] = ENTRIES_LOST_REASON
        if self.compact_after_s is not None:
            self._compact_later([w.key for w in writes if w.end and w.key not in refused])
        return refused

    def _slot_groups(self, writes: Sequence[StreamWrite]) -> list[Sequence[StreamWrite]]:
        if not self.cluster:
            return [writes]
        groups: dict[int, list[StreamWrite]] = {}
        for write in writes:
            groups.setdefault(key_slot(write.key.encode()), []).append(write)
        return list(groups.values())

    async def end(
        self, key: str, fields: Fields, lease: str = "", seq_id: str = AFTER_TAIL
    ) -> Ended:
        """End one stream with `fields` (a `done` or `error` entry) through the same fenced
        path as a batch: with `lease` its holder's token, or '' for a job that took none
        (it then writes only where no worker holds the lease). `seq_id` AFTER_TAIL
        appends after whatever the stream holds, unless it has ended already. Raises
        `StreamUnusable` when the key is not a stream."""
        keys, args = _write_call(
            [StreamWrite(key, 1, end=(seq_id, fields))], {key: lease}, self._ttl_s
        )
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
        if self.cluster:
            return await self._pipelined(script, [([key], args) for key, args in calls])
        assert isinstance(self.client, aioredis.Redis)
        pipe = self.client.pipeline(transaction=False)
        for key, args in calls:
            await script(keys=[key], args=args, client=pipe)
        return list(await pipe.execute())

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
            reply = await self._start(keys=keys, args=args)
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
        """How many times this request's message was taken (for classic queues, which
        do not count deliveries themselves)."""
        counter = deliveries_key(key)
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(counter)
        pipe.expire(counter, self._ttl_s)
        count, _ = await pipe.execute()
        return int(count)


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
