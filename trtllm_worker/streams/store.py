"""Every Redis write of the worker, fenced: the store the pipeline, the broker and the
SDK's cancel call.

- Token and terminal entries are written with explicit ids (`0-<seq>`): Redis refuses an
  id that is not above the last, so no index is ever stored twice, even by a retry.
- Every write is fenced by the request's lease `{<stream key>}:lease`: a Lua script
  appends only while the caller's token holds the lease, and a caller without a lease
  (an invalid job, refused before it took one) only while nobody holds it. A worker that
  lost a job can no longer write to its stream, and none overwrites a stream another
  worker owns.
- One function ends a stream, `end_stream` in `lua/write.lua`: the terminal entry, the
  TTL, the lease release and the job's usage count (`usage.py`) happen together or not
  at all.
- One script call per batch of engine outputs for all its streams (a call per stream
  cost Redis more than the appends), in the wire form of `wire.WriteBatch`. How calls
  reach Redis (one node, or a cluster's nodes and slots) is a `topology.Topology`,
  chosen once here."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from trtllm_worker.connect.redis import NotReplicated
from trtllm_worker.contract.errors import StreamUnusable
from trtllm_worker.contract.stream import (
    TERMINAL_EVENTS,
    Fields,
    cancel_key,
    deliveries_key,
    lease_key,
)
from trtllm_worker.streams.cluster import ClusterNodes
from trtllm_worker.streams.refusals import acl_refused, refused_for_good
from trtllm_worker.streams.scripts import ENTRIES_LOST, LEASE_LOST, lua
from trtllm_worker.streams.single import SingleNode
from trtllm_worker.streams.topology import Topology
from trtllm_worker.streams.usage import UsageKeys
from trtllm_worker.streams.wire import AFTER_TAIL, WriteBatch

log = logging.getLogger(__name__)

LEASE_LOST_REASON = "the lease was lost: another worker owns this request now"
ENTRIES_LOST_REASON = (
    "entries stored earlier are gone (a Redis failover lost writes its replica had not"
    " received): the job is handed back and resumes from what the stream holds"
)
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


def topology_of(
    client: aioredis.Redis | RedisCluster, *, ttl_s: int, min_replicas: int
) -> Topology:
    """The one place the client's type is looked at: a cluster client gets per-node and
    per-slot calls, any other one call per batch."""
    if isinstance(client, RedisCluster):
        return ClusterNodes(client, ttl_s=ttl_s, min_replicas=min_replicas)
    return SingleNode(client, ttl_s=ttl_s, min_replicas=min_replicas)


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
        prefix: str | None = None,
        usage_ttl_s: int = 7_776_000,
        model_name: str = "",
    ) -> None:
        self.client = client
        self.model_name = model_name
        """The model's public name, recorded with a terminal entry that ends a batch
        line."""
        self.compact_after_s = compact_after_s
        """Set: that long after a stream ends, `compact` trims it (a timer in this
        process: a worker that stops first leaves the stream whole until its TTL)."""
        self._compactions: set[asyncio.Task[int]] = set()
        self._starts: list[tuple[list[Any], list[Any], asyncio.Future[Any]]] = []
        self._start_tasks: set[asyncio.Task[None]] = set()
        self._compaction_timers: set[asyncio.TimerHandle] = set()
        self._nodes = topology_of(client, ttl_s=ttl_s, min_replicas=min_replicas)
        self._scripts = self._nodes.scripts
        self.cluster = self._nodes.cluster
        """On Redis Cluster one script may only touch keys of one hash slot: a batch is
        split per slot (a request's keys share its stream's slot)."""
        self.usage = (
            None if prefix is None else UsageKeys(prefix, usage_ttl_s, cluster=self.cluster)
        )
        """Where terminal entries count their job's usage: under the deployment's stream
        `prefix` (None, a store built without one: not counted)."""
        self.min_replicas = min_replicas
        """A batch that ends streams waits (Redis WAIT, on the connection that wrote it)
        until that many replicas hold it; fewer raise `NotReplicated`."""
        self._ttl_s = ttl_s
        self._lease_ms = max(int(lease_ttl_s * 1000), 1)

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
            sha = await self.client.script_load(lua("probe"))
        except ResponseError as exc:
            return ["SCRIPT LOAD"] if acl_refused(exc) else []
        try:
            refused = [bytes(n).decode() if isinstance(n, bytes) else str(n)
                       for n in await self.client.evalsha(sha, len(keys), *keys)]  # fmt: skip
        except ResponseError as exc:
            if not acl_refused(exc):
                raise
            return ["EVALSHA"]
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(counter)
        pipe.expire(counter, 10)
        pipe.set(cancel_key(stream), b"probe", px=10_000)
        pipe.delete(counter, cancel_key(stream))
        if self.min_replicas:  # a single node: a cluster refuses min_replicas
            pipe.execute_command("WAIT", 0, 1)
        names = ["INCRBY", "EXPIRE", "SET", "DEL", "WAIT"]  # redis-py's incr is INCRBY
        for name, reply in zip(names, await pipe.execute(raise_on_error=False), strict=False):
            if isinstance(reply, ResponseError) and acl_refused(reply) and name not in refused:
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
        return sum(await self._each(self._scripts.compact, [(key, []) for key in keys]))

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
        make a retry idempotent). How many calls that takes is the topology's."""
        if not batch:
            return {}
        replies = await self._nodes.write(batch)
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

    async def end(
        self,
        key: str,
        fields: Fields,
        lease: str = "",
        seq_id: str = AFTER_TAIL,
        *,
        tenant: str | None = None,
        adapter: str | None = None,
    ) -> Ended:
        """End one stream with `fields` (a `done` or `error` entry) through the same fenced
        path as a batch: with `lease` its holder's token, or '' for a job that took none
        (it then writes only where no worker holds the lease). `seq_id` AFTER_TAIL
        appends after whatever the stream holds, unless it has ended already. When it is
        stored, the job counts under `tenant` (None: `-`) and `adapter`, with the input
        tokens `fields` give (an error entry gives none: the job never reached the
        engine). Raises
        `StreamUnusable` when the key is not a stream."""
        batch = WriteBatch(usage=self.usage, model=self.model_name)
        args = batch.begin((key, lease_key(key)), 0, lease, 1)
        batch.end(args, seq_id, fields, tenant, int(fields.get("input_tokens", 0)), adapter)
        keys, values = batch.calls[0]
        result = (await self._nodes.write_one(keys, values))[0]
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
        results = await self._each(self._scripts.renew, calls)
        return [key for key, renewed in zip(leases, results, strict=True) if not renewed]

    async def _each(self, script: AsyncScript, calls: list[tuple[str, list[Any]]]) -> list[Any]:
        """One single-key script per call, in one round trip (per node on a cluster)."""
        return await self._nodes.run(script, [([key], args) for key, args in calls])

    async def _start_soon(self, keys: list[Any], args: list[Any]) -> Any:
        """`start.lua` for one job, sent with the other jobs' starts of this event-loop turn
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
            calls = [(keys, args) for keys, args, _ in starts]
            replies = await self._nodes.run(self._scripts.start, calls, raise_on_error=False)
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
            self._scripts.release, [(lease_key(key), [token]) for key, token in leases.items()]
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
            reply, replicas = await self._nodes.then_wait(self._scripts.start, keys, args)
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

    async def credit_delivery(self, key: str) -> None:
        """The next redelivery of this request's message is not a failed one (the worker
        requeued it to make room for a more urgent job): `count_delivery` will not count
        it."""
        counter = deliveries_key(key)
        pipe = self.client.pipeline(transaction=False)
        pipe.incrby(counter, -1)  # INCRBY, which the worker's Redis user has
        pipe.expire(counter, self._ttl_s)
        await pipe.execute()

    async def count_delivery(self, key: str) -> int:
        """Count one more redelivery of this request's message; returns the count (for
        classic queues, which do not count deliveries themselves)."""
        counter = deliveries_key(key)
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(counter)
        pipe.expire(counter, self._ttl_s)
        count, _ = await pipe.execute()
        return int(count)
