# mirrors tensorrt_llm/llmapi/utils.py (1.2.x): AsyncQueue and _SyncQueue, the queues a
# GenerationResult binds when it is created inside a running event loop.
from __future__ import annotations

import asyncio
import collections
import time
import warnings
from typing import Any


class AsyncQueue:
    """A deque plus an asyncio.Event; producers in other threads use ``sync_q``."""

    class EventLoopShutdownError(Exception):
        pass

    class MixedSyncAsyncAPIError(Exception):
        pass

    def __init__(self) -> None:
        self._q: collections.deque[Any] = collections.deque()
        self._event = asyncio.Event()
        self._tainted = False
        self._sync_q = _SyncQueue(self)

    @property
    def sync_q(self) -> _SyncQueue:
        return self._sync_q

    def empty(self) -> bool:
        return not self._q

    def put(self, item: Any) -> None:
        self._q.append(item)
        self._event.set()

    def put_nowait(self, item: Any) -> None:
        self._q.append(item)

    def notify(self) -> None:
        if self._q:
            self._event.set()

    def unsafe_get(self) -> Any:
        self._tainted = True  # a sync get renders the queue unusable by async methods
        try:
            return self._q.popleft()
        except IndexError:
            raise asyncio.QueueEmpty() from None

    async def get(self, timeout: float | None = None) -> Any:  # noqa: ASYNC109 (real API)
        if self._tainted:
            raise AsyncQueue.MixedSyncAsyncAPIError()
        if timeout is None:
            while not self._q:
                await self._event.wait()
        elif timeout > 0:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while not self._q:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError()
                await asyncio.wait_for(self._event.wait(), timeout=remaining)
        elif not self._q:
            raise asyncio.QueueEmpty()
        res = self._q.popleft()
        if not self._q:
            self._event.clear()
        return res


class _SyncQueue:
    """Thread-side face of an AsyncQueue, tied to the loop running when it was made."""

    def __init__(self, queue: AsyncQueue, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._aq = queue
        self._loop = loop or asyncio.get_running_loop()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def put(self, item: Any) -> None:
        self._aq.put_nowait(item)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._aq.notify)
        else:
            raise AsyncQueue.EventLoopShutdownError()

    def put_nowait(self, item: Any) -> None:
        self._aq.put_nowait(item)

    def get(self, timeout: float | None = None) -> Any:
        warnings.warn(
            "LLM API is running in async mode because you have a running event loop,"
            " but you are using sync API. This may lead to potential performance loss.",
            stacklevel=2,
        )
        deadline = None if timeout is None else time.time() + timeout
        while deadline is None or time.time() < deadline:
            try:
                return self._aq.unsafe_get()
            except asyncio.QueueEmpty:
                time.sleep(0.01)
        return None
