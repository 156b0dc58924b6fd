"""The store on one Redis node (Sentinel included): every call on one connection's
pipeline, and WAIT on that same connection when writes must reach replicas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from trtllm_worker.connect.redis import NotReplicated
from trtllm_worker.streams.topology import ScriptCall, Topology
from trtllm_worker.streams.wire import WriteBatch, write_argv

REPLICA_WAIT_MS = 2000


class SingleNode(Topology):
    """A batch is one call (slot 0 holds all its parts)."""

    cluster = False

    def __init__(self, client: aioredis.Redis, *, ttl_s: int, min_replicas: int) -> None:
        super().__init__(client, ttl_s=ttl_s, min_replicas=min_replicas)
        self.client: aioredis.Redis = client

    async def write(self, batch: WriteBatch) -> list[Any]:
        keys, values = batch.calls[0]
        argv = write_argv(self.ttl_s, values)
        if self.min_replicas and batch.ended:
            return [await self._replicated(keys, argv)]
        return [await self.scripts.write(keys, argv)]

    async def write_one(self, keys: list[Any], values: list[Any]) -> Any:
        argv = write_argv(self.ttl_s, values)
        if self.min_replicas:
            return await self._replicated(keys, argv)
        return await self.scripts.write(keys=keys, args=argv)

    async def run(
        self, script: AsyncScript, calls: Sequence[ScriptCall], *, raise_on_error: bool = True
    ) -> list[Any]:
        """EVALSHA pipelined, the script loaded and the calls sent again on NOSCRIPT (a
        restarted master), rather than redis-py's script pipeline, which asks SCRIPT
        EXISTS first every time."""
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

    async def then_wait(
        self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]
    ) -> tuple[Any, int]:
        """WAIT on the same connection as the script: WAIT counts the replicas that hold
        this connection's writes."""
        pipe = self.client.pipeline(transaction=False)
        await script(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAIT", self.min_replicas, REPLICA_WAIT_MS)
        reply, replicas = await pipe.execute()
        return reply, int(replicas)

    async def _replicated(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """`write.lua`, then `NotReplicated` unless the replicas hold it."""
        reply, replicas = await self.then_wait(self.scripts.write, keys, args)
        if replicas < self.min_replicas:
            raise NotReplicated(
                f"the terminal entries reached {replicas} of the {self.min_replicas} replicas"
                f" WORKER_REDIS_MIN_REPLICAS asks for within {REPLICA_WAIT_MS} ms"
            )
        return reply
