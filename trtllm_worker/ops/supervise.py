"""Background tasks that must live as long as the worker (the output pump, the lease
keeper, the cancel listener, the Redis watch). A task that ends while the worker runs,
by an exception or otherwise, is a dead organ: the supervisor logs it, `/healthz` turns
503, and the worker stops and exits non-zero, instead of hanging on half alive."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Supervisor:
    """Starts named tasks and notices the first one that dies."""

    def __init__(self, on_death: Callable[[str, BaseException | None], None]) -> None:
        self._on_death = on_death
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        self.dead: str | None = None
        """The name of the first task that ended while it should not have."""

    @property
    def healthy(self) -> bool:
        return self.dead is None and all(not task.done() for task in self._tasks.values())

    def start(
        self, name: str, coroutine: Coroutine[Any, Any, None], *, forever: bool = True
    ) -> None:
        """Run `coroutine` as task `name`. A `forever` task must not end while the worker
        runs; any other may end, but not by an exception."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks[name] = task
        task.add_done_callback(lambda done: self._ended(done, forever))

    def _ended(self, task: asyncio.Task[None], forever: bool) -> None:
        if self._stopping or task.cancelled():
            return
        error = task.exception()
        name = task.get_name()
        if error is None and not forever:
            del self._tasks[name]
            return
        if error is not None:
            log.error("background task %s died: %r", name, error, exc_info=error)
        else:
            log.error("background task %s ended while the worker runs", name)
        if self.dead is None:
            self.dead = name
            self._on_death(name, error)

    async def stop(self) -> None:
        """Cancel every task and wait for them."""
        self._stopping = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
