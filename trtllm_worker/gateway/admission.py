"""Back-pressure: a new request is refused (429, `Retry-After`) while the queue holds
more ready jobs than `WORKER_GATEWAY_MAX_QUEUED`. The depth comes from RabbitMQ (a passive
declare), asked at most every `DEPTH_TTL_S` by one request while the others use it."""

from __future__ import annotations

import asyncio
import time

from trtllm_worker.client import Client, ServiceUnavailable
from trtllm_worker.gateway.errors import too_many, unavailable

DEPTH_TTL_S = 0.5


class Admission:
    def __init__(self, client: Client, max_queued: int) -> None:
        self._client = client
        self.max_queued = max_queued
        self._depth = 0
        self._asked = -DEPTH_TTL_S
        self._lock = asyncio.Lock()

    async def depth(self) -> int:
        async with self._lock:
            if time.monotonic() - self._asked >= DEPTH_TTL_S:
                try:
                    self._depth = await self._client.queue_depth()
                except ServiceUnavailable as exc:
                    raise unavailable(str(exc)) from None
                self._asked = time.monotonic()
            return self._depth

    async def admit(self) -> None:
        """Raise the 429 when the queue is over its depth; no-op without a limit."""
        if self.max_queued == 0:
            return
        depth = await self.depth()
        if depth > self.max_queued:
            raise too_many(
                f"the queue holds {depth} jobs, over this gateway's limit of "
                f"{self.max_queued}: try again shortly"
            )
