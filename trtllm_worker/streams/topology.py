"""How the store's script calls reach Redis: the one seam between a single node
(`single.SingleNode`) and a Redis Cluster (`cluster.ClusterNodes`).

The store says what to write; a topology decides how many calls and connections that
takes. It is chosen once, when the store is built, so no store method asks which
Redis it is on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from trtllm_worker.streams.scripts import Scripts
from trtllm_worker.streams.wire import WriteBatch

ScriptCall = tuple[Sequence[Any], Sequence[Any]]
"""A script's KEYS and ARGV."""


class Topology(ABC):
    """Runs the store's scripts on one client."""

    cluster: ClassVar[bool]
    """Whether keys of different hash slots must go to different calls."""

    def __init__(
        self, client: aioredis.Redis | RedisCluster, *, ttl_s: int, min_replicas: int
    ) -> None:
        self.client = client
        self.scripts = Scripts.register(client)
        self.ttl_s = ttl_s
        """The TTL `write.lua` gives a stream it ends."""
        self.min_replicas = min_replicas
        """A write that ends streams waits until that many replicas hold it; fewer raise
        `NotReplicated`."""

    @abstractmethod
    async def write(self, batch: WriteBatch) -> list[Any]:
        """Store a non-empty batch in one round trip: per call of `batch.calls` (in
        order) `write.lua`'s results, one per part."""

    @abstractmethod
    async def write_one(self, keys: list[Any], values: list[Any]) -> Any:
        """One `write.lua` call (`keys` of one slot): its results."""

    @abstractmethod
    async def run(
        self, script: AsyncScript, calls: Sequence[ScriptCall], *, raise_on_error: bool = True
    ) -> list[Any]:
        """One call of `script` per (keys, args), in one round trip, loading the script
        where a node lacks it. `raise_on_error=False`: a call's error is its reply."""

    @abstractmethod
    async def then_wait(
        self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]
    ) -> tuple[Any, int]:
        """`script`, then the number of replicas that hold its writes."""
