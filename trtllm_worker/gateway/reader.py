"""One stream reader for a whole gateway process: a single `XREAD BLOCK` over every
stream its answers follow, instead of one blocked Redis connection per answer.

Per answer, a blocked XREAD holds a connection of its own (redis-py's pool stops at a
hundred: the 101st answer got a 503) and costs a round trip per token per stream (a third
of the gateway's CPU in the bench's profile). Here one task reads every open stream at
once and hands each answer its entries; an answer that joins while that XREAD is blocked
wakes it by adding an entry to this process's own wake stream, which the XREAD also
reads, so a new answer never waits out the block.

What each reader gets is what `Client.entries` gives (the stream's entries after
`from_id`, ending after the terminal entry; `ServiceUnavailable` when Redis stays lost
past the client's reconnect timeout, resuming after the last entry otherwise). On a
Redis Cluster a multi-key XREAD would span hash slots: there each answer reads its own
stream through the client, as before."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import cast

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from trtllm_worker.client import Client, ServiceUnavailable
from trtllm_worker.client.async_client import ping_fresh
from trtllm_worker.client.events import Event, parse_entry
from trtllm_worker.connect.redis import AnyRedis
from trtllm_worker.contract.stream import TERMINAL_EVENTS, entry_order, wake_key

log = logging.getLogger(__name__)

Entry = tuple[str, dict[str, str]]
XreadReply = list[tuple[str, list[Entry]]]

COUNT = 512
"""Entries per stream per XREAD (a longer backlog comes over the next ones)."""
WAKE_TTL_S = 3600
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 2.0


def id_key(entry_id: str) -> tuple[int, int]:
    """An entry id Redis gave, or one the routes checked, in Redis's order."""
    order = entry_order(entry_id)
    if order is None:
        raise ValueError(f"{entry_id!r} is not a stream entry id")
    return order


@dataclass(eq=False)
class _Reader:
    """One answer's place in its stream and the entries handed to it."""

    key: str
    last: tuple[int, int]
    last_id: str
    inbox: asyncio.Queue[list[Entry] | ServiceUnavailable] = field(default_factory=asyncio.Queue)


class StreamHub:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.wake_key = wake_key(client.stream_prefix, uuid.uuid4().hex)
        self.xreads = 0
        """XREAD calls made (the tests and the bench read it)."""
        self._readers: dict[str, list[_Reader]] = {}
        self._wake_id = "0-0"
        self._woken = False
        self._failing_since: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._asking: asyncio.Future[None] | None = None

    @property
    def reading(self) -> bool:
        """Whether the reader's task runs (it ends soon after the last answer does)."""
        return self._task is not None and not self._task.done()

    async def stream(self, request_id: str, from_id: str = "0") -> AsyncGenerator[Event, None]:
        """As `Client.stream`: the request's events, from this process's one reader."""
        entries = self.entries(request_id, from_id)
        try:
            async for entry_id, fields in entries:
                event = parse_entry(entry_id, fields)
                if event is not None:
                    yield event
        finally:
            await entries.aclose()

    async def entries(self, request_id: str, from_id: str = "0") -> AsyncGenerator[Entry, None]:
        """As `Client.entries`: `(entry id, fields)` after `from_id` (`0`: from the start,
        else an entry id), ending after the terminal entry."""
        key = self.client.stream_key(request_id)  # InvalidJobError for a bad id
        redis = await self._redis()
        if isinstance(redis, RedisCluster):
            async for entry in self.client.entries(request_id, from_id):
                yield entry
            return
        if await self._ended_already(request_id, from_id):
            return
        reader = _Reader(key, id_key(from_id), from_id)
        self._readers.setdefault(key, []).append(reader)
        try:
            await self._start_or_wake(redis)
            while True:
                got = await reader.inbox.get()
                if isinstance(got, ServiceUnavailable):
                    raise got
                for entry_id, fields in got:
                    yield entry_id, fields
                    if fields.get("event") in TERMINAL_EVENTS:
                        return
        finally:
            readers = self._readers.get(key, [])
            if reader in readers:
                readers.remove(reader)
            if not readers:
                self._readers.pop(key, None)

    async def _ended_already(self, request_id: str, from_id: str) -> bool:
        """Whether the stream ended at or before `from_id`; `ServiceUnavailable` at once
        when Redis does not answer."""
        if self._failing_since is not None:
            raise ServiceUnavailable("Redis does not answer: the stream reader is reconnecting")
        if self._task is None or self._task.done():
            # the first reader asks whether Redis answers; later ones know it from the
            # reader's last XREAD (no round trip per answer), and those that come while
            # it asks share its question (a connection each made a burst of answers
            # take a pool's worth)
            if self._asking is None:
                self._asking = asyncio.ensure_future(self._ask())
                self._asking.add_done_callback(self._asked)
            await asyncio.shield(self._asking)
        return from_id != "0" and await self.client.ended_by(request_id, from_id)

    async def _ask(self) -> None:
        """Whether Redis answers; `ServiceUnavailable` naming no address (its text
        reaches API clients in a 503) when not."""
        try:
            await ping_fresh(await self.client._redis())
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise ServiceUnavailable(f"Redis does not answer: {exc}") from None

    def _asked(self, asking: asyncio.Future[None]) -> None:
        self._asking = None
        if not asking.cancelled():
            asking.exception()  # retrieved: every reader that asked got it already

    async def _redis(self) -> AnyRedis:
        try:
            return await self.client._redis()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise ServiceUnavailable(f"Redis does not answer: {exc}") from None

    async def _start_or_wake(self, redis: AnyRedis) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(redis), name="gateway stream reader")
            return
        if self._woken:
            return  # the XREAD in flight returns already
        self._woken = True
        # a second try goes over a fresh connection: the pooled one may have been closed
        # just as it was taken, and an unwoken reader would make this answer wait out
        # the XREAD's block
        for _ in range(2):
            try:
                async with redis.pipeline(transaction=False) as pipe:
                    pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
                    pipe.expire(self.wake_key, WAKE_TTL_S)
                    await pipe.execute()
                return
            except (RedisConnectionError, OSError):
                continue
            except RedisTimeoutError:
                break
        # Redis is lost: the reader is failing over already and reads the new stream
        # when it is back

    async def _run(self, redis: AnyRedis) -> None:
        """Read every open stream until none is left."""
        loop = asyncio.get_running_loop()
        delay = BACKOFF_INITIAL_S
        while self._readers:
            self._woken = False  # before the XREAD names the wake stream's last id
            streams = {self.wake_key: self._wake_id}
            for key, readers in self._readers.items():
                streams[key] = min(readers, key=lambda r: r.last).last_id
            try:
                self.xreads += 1
                reply = cast(
                    XreadReply,
                    await redis.xread(
                        streams,  # type: ignore[arg-type]
                        block=self.client.xread_block_ms,
                        count=COUNT,
                    ),
                )
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                now = loop.time()
                if self._failing_since is None:
                    self._failing_since = now
                if now - self._failing_since >= self.client.reconnect_timeout_s:
                    self._failing_since = None  # the next reader tries afresh
                    self._fail_all(exc)
                    return
                self.client.reconnects += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            self._failing_since, delay = None, BACKOFF_INITIAL_S
            for key, items in reply or []:
                if key == self.wake_key:
                    self._wake_id = items[-1][0]
                    continue
                for reader in self._readers.get(key, []):
                    fresh = [item for item in items if id_key(item[0]) > reader.last]
                    if fresh:
                        reader.last_id = fresh[-1][0]
                        reader.last = id_key(reader.last_id)
                        reader.inbox.put_nowait(fresh)

    def _fail_all(self, exc: BaseException) -> None:
        error = ServiceUnavailable(
            f"lost Redis for {self.client.reconnect_timeout_s:.0f}s while reading "
            f"{len(self._readers)} streams: {exc}"
        )
        for readers in self._readers.values():
            for reader in readers:
                reader.inbox.put_nowait(error)
        self._readers.clear()

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(Exception):
            redis = await self.client._redis()
            await redis.delete(self.wake_key)
