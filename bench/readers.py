"""The subscriber's side: how the bench reads every open stream, as a subscriber does."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

Reply = list[tuple[str, list[tuple[str, dict[str, str]]]]]
Reader = Callable[[dict[str, str]], Awaitable[Reply]]


def multi_key_reader(redis: aioredis.Redis) -> Reader:
    """One XREAD for every open stream, as a subscriber of a single node can."""

    async def read(streams: dict[str, str]) -> Reply:
        reply = await redis.xread(streams, block=1000, count=5000)  # type: ignore[arg-type]
        return cast(Reply, reply)

    return read


class PerKeyReader:
    """One XREAD per stream, pipelined; on a cluster (where a multi-key XREAD would span
    slots) one plain pipeline per node, so that reading costs the bench's subscriber,
    which shares the worker's cores, the same per stream on both (redis-py's cluster
    pipeline costs several times more). After a round that found nothing, one blocking
    XREAD on the oldest open stream waits for the worker instead of polling."""

    def __init__(self, redis: aioredis.Redis | RedisCluster) -> None:
        self.redis = redis
        self.nodes: dict[str, aioredis.Redis] = {}

    def _client(self, key: str) -> aioredis.Redis:
        if isinstance(self.redis, aioredis.Redis):
            return self.redis
        node = self.redis.get_node_from_key(key)
        if node is None:
            raise RuntimeError(f"no cluster node serves {key!r}")
        if node.name not in self.nodes:
            self.nodes[node.name] = aioredis.Redis(
                host=node.host, port=int(node.port), decode_responses=True
            )
        return self.nodes[node.name]

    async def __call__(self, streams: dict[str, str]) -> Reply:
        pipes: dict[int, Any] = {}
        for key, last in streams.items():
            client = self._client(key)
            pipe = pipes.setdefault(id(client), client.pipeline(transaction=False))
            pipe.xread({key: last}, count=5000)
        results = await asyncio.gather(*(pipe.execute() for pipe in pipes.values()))
        reply = [item for replies in results for result in replies for item in result or []]
        if reply or not streams:
            return reply
        key, last = next(iter(streams.items()))
        return cast(Reply, await self._client(key).xread({key: last}, block=1000, count=5000))

    async def aclose(self) -> None:
        for client in self.nodes.values():
            await client.aclose()
