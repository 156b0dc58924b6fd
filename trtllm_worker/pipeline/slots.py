"""The engine's slots, handed out by priority. A job takes a slot before it is submitted
and gives it back when its engine request ends. Jobs waiting for one start in priority
order (ties in arrival order); an interactive job (priority at least
`WORKER_PREEMPT_PRIORITY`) that finds every slot busy has the running job of lowest
priority below its own paused to make room.

The broker delivers one job more than there are slots (the lookout): that is how an
interactive job reaches a full worker at all. A job of lower priority waiting in the
lookout would keep it shut, so while interactive jobs are about (one was seen in the
last `ARMED_FOR_S`) such a job is given back to the queue after `LOOKOUT_S`, and the
broker, which delivers higher priorities first, hands over the next job. A worker
starts armed."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Final

LOOKOUT_S: Final = 0.05
"""How long a job of lower priority may hold the lookout while every slot is busy."""
ARMED_FOR_S: Final = 600.0
"""How long after the last interactive job (or its start) the lookout is kept open: a
worker that sees no interactive work for that long stops giving jobs back (no churn on
the broker)."""


class Ticket:
    """One job's claim on a slot."""

    __slots__ = ("_future", "gone", "pausing", "priority", "request_id", "seq")

    def __init__(self, request_id: str, priority: int, seq: int) -> None:
        self.request_id = request_id
        self.priority = priority
        self.seq = seq
        self.pausing = False
        """Chosen to make room: its job is being paused (or must not start)."""
        self.gone = False
        """No longer waiting (it got a slot, was given back or withdrawn)."""
        self._future: asyncio.Future[bool] | None = None


class GiveBack(Exception):
    """The waiting job is to go back to the queue: it held the lookout too long."""


Pause = Callable[[Ticket], None]
"""Pause the running job that holds this ticket (the runner drops it from the engine)."""


class Slots:
    """The slots of one engine, by priority."""

    def __init__(
        self,
        size: int,
        preempt_priority: int,
        pause: Pause,
        *,
        lookout_s: float = LOOKOUT_S,
        armed_for_s: float = ARMED_FOR_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._size = size
        self._preempt = preempt_priority
        self._pause = pause
        self._lookout_s = lookout_s
        self._armed_for_s = armed_for_s
        self._clock = clock
        self._seqs = itertools.count()
        self._running: dict[int, Ticket] = {}
        self._waiting: list[tuple[int, int, Ticket]] = []
        self._last_interactive = clock()
        self.lookout = True
        """False where the broker does not order priorities (a quorum queue before
        RabbitMQ 4.0): giving a job back would only send it to the back of the queue."""
        """Armed from the start: a worker that comes up full (a scale-out under load)
        must not make the first interactive job wait for a slot to free."""

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, ticket in self._waiting if not ticket.gone)

    def interactive(self, priority: int) -> bool:
        return priority >= self._preempt

    async def acquire(self, request_id: str, priority: int) -> Ticket | None:
        """Wait for a slot. Returns the ticket holding it, or None when the wait was
        withdrawn (`withdraw`: the job was cancelled meanwhile). Raises `GiveBack` when
        the job is to go back to the queue unstarted."""
        ticket = Ticket(request_id, priority, next(self._seqs))
        if self.interactive(priority):
            self._last_interactive = self._clock()
        if len(self._running) < self._size and not self.waiting:
            self._running[ticket.seq] = ticket
            return ticket
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        ticket._future = future
        heapq.heappush(self._waiting, (-priority, ticket.seq, ticket))
        self._make_room()
        timer = None
        if not self.interactive(priority) and self.lookout and self._armed():
            timer = loop.call_later(self._lookout_s, self._give_back, ticket)
        try:
            granted = await future
        except asyncio.CancelledError:
            if not ticket.gone:
                ticket.gone = True
            elif ticket.seq in self._running:  # granted as the task was cancelled
                self.release(ticket)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return ticket if granted else None

    def release(self, ticket: Ticket) -> None:
        """The ticket's engine request ended (or never started): its slot is free."""
        if self._running.pop(ticket.seq, None) is not None:
            self._fill()

    def withdraw(self, request_id: str) -> bool:
        """Stop waiting for a slot for `request_id` (its `acquire` returns None). True if
        it was waiting."""
        for _, _, ticket in self._waiting:
            if ticket.request_id == request_id and not ticket.gone:
                self._resolve(ticket, False)
                return True
        return False

    def _armed(self) -> bool:
        return self._clock() - self._last_interactive < self._armed_for_s

    def _resolve(self, ticket: Ticket, granted: bool) -> None:
        ticket.gone = True
        future = ticket._future
        if future is not None and not future.done():
            future.set_result(granted)

    def _fill(self) -> None:
        """Hand free slots to the waiting jobs, highest priority first."""
        while len(self._running) < self._size and self._waiting:
            _, _, ticket = heapq.heappop(self._waiting)
            if ticket.gone:
                continue
            self._running[ticket.seq] = ticket
            self._resolve(ticket, True)

    def _give_back(self, ticket: Ticket) -> None:
        """The lookout timer: a job of lower priority still waits on a full worker."""
        if ticket.gone or len(self._running) < self._size:
            return
        ticket.gone = True
        future = ticket._future
        if future is not None and not future.done():
            future.set_exception(GiveBack())

    def _make_room(self) -> None:
        """Pause one running job of lower priority for each interactive job waiting
        beyond the slots already being freed: the lowest priority first, and of those
        the one that started last (it has the least to lose)."""
        waiting = sorted(
            (t for _, _, t in self._waiting if not t.gone and self.interactive(t.priority)),
            key=lambda t: (-t.priority, t.seq),
        )
        covered = sum(1 for t in self._running.values() if t.pausing)
        covered += self._size - len(self._running)
        for newcomer in waiting[covered:]:
            victims = [
                t
                for t in self._running.values()
                if not t.pausing and t.priority < newcomer.priority
            ]
            if not victims:
                continue
            victim = min(victims, key=lambda t: (t.priority, -t.seq))
            victim.pausing = True
            self._pause(victim)
