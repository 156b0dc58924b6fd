"""The store on a Redis Cluster: a call may declare keys of one hash slot only, so a
batch goes as one `write_node` call per node (the node's keys as an argument), else one
call per slot.

The fast paths send packed commands on a node's own connection (redis-py's
`acquire_connection`/`pack_commands`): the cluster pipeline works out each call's slot
and node again, resolves a policy and opens a timeout per command, which costs more than
the writes. Anything unusual (MOVED, a node gone, NOSCRIPT) falls back to that pipeline,
which follows and retries; the scripts are idempotent, so a call may run twice."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from typing import Any

import msgpack
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.commands.core import AsyncScript
from redis.crc import key_slot
from redis.exceptions import NoScriptError, RedisClusterException, ResponseError

from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.streams.scripts import write_script
from trtllm_worker.streams.topology import ScriptCall, Topology
from trtllm_worker.streams.wire import WriteBatch, write_argv

log = logging.getLogger(__name__)


class ClusterNodes(Topology):
    """Calls grouped per node of the client's slot map, all nodes at once."""

    cluster = True

    def __init__(self, client: RedisCluster, *, ttl_s: int, min_replicas: int) -> None:
        if min_replicas:
            raise ConfigError(
                "WORKER_REDIS_MIN_REPLICAS is not supported on Redis Cluster (yet): leave it 0"
            )
        super().__init__(client, ttl_s=ttl_s, min_replicas=0)
        self.client: RedisCluster = client
        self._write_node = client.register_script(write_script("write_node"))
        self._node_calls = True
        """Whether a batch goes as one call per node (off after a node refused the
        script itself: a Redis before 7.0)."""
        self._node_script_loaded = False

    async def write(self, batch: WriteBatch) -> list[Any]:
        """One call per node (`_node_writes`), and the calls of a node whose call failed
        one per slot, pipelined per node (`run`), following MOVED and failovers."""
        replies = await self._node_writes(batch)
        missing = [i for i, reply in enumerate(replies) if reply is None]
        if missing:
            calls = list(batch.calls.values())
            again = await self.run(
                self.scripts.write,
                [(calls[i][0], write_argv(self.ttl_s, calls[i][1])) for i in missing],
            )
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def write_one(self, keys: list[Any], values: list[Any]) -> Any:
        return await self.scripts.write(keys=keys, args=write_argv(self.ttl_s, values))

    async def then_wait(
        self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]
    ) -> tuple[Any, int]:
        """No replica is counted: a cluster does not wait for replicas (`min_replicas`
        is 0)."""
        return await script(keys=keys, args=args), 0

    async def _node_writes(self, batch: WriteBatch) -> list[Any]:
        """A batch as one `write_node` call per node the client's slot map names, all
        nodes at once; per slot call its results, None for the calls of a node whose
        call failed (a slot moved, a failover, the script not loaded there): the caller
        writes those per slot, which follows MOVED and retries."""
        unwritten: list[Any] = [None] * len(batch.calls)
        if not self._node_calls:
            return unwritten
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
            command = ("EVALSHA", self._write_node.sha, 0, self.ttl_s, *packed)
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

    async def run(
        self, script: AsyncScript, calls: Sequence[ScriptCall], *, raise_on_error: bool = True
    ) -> list[Any]:
        """First `_per_node`; when it fails, redis-py's cluster pipeline, which sends
        each node its calls in one pipeline, all nodes at once, and follows MOVED, ASK
        and TRYAGAIN. That pipeline refuses `evalsha()` (it could not load a missing
        script on the right node), so EVALSHA is sent as a plain command and a NOSCRIPT
        (a node that never saw the script: a new master, a restarted one) loads it on
        every master and runs the calls again. The first error raises, whatever
        `raise_on_error`."""
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
        """Each call to the node the client's slot map names, one plain pipeline per
        node under one timeout, all nodes at once. None when anything failed (a MOVED
        after a resharding, a node gone, NOSCRIPT, a script error): the cluster pipeline
        then runs every call again, and follows, retries or raises."""
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
