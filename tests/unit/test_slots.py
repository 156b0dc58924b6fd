"""Engine slots by priority (`pipeline.slots`): who starts first, who is paused, when a
waiting job is given back. No services: the slots are plain event-loop objects."""

from __future__ import annotations

import asyncio

import pytest

from trtllm_worker.pipeline.slots import GiveBack, Slots, Ticket


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def slots(size: int, paused: list[Ticket], **kwargs: object) -> Slots:
    return Slots(size, 5, paused.append, **kwargs)  # type: ignore[arg-type]


async def test_waiting_jobs_start_by_priority_then_arrival() -> None:
    paused: list[Ticket] = []
    pool = slots(1, paused, lookout_s=60)
    running = await pool.acquire("running", 9)
    assert running is not None
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        ticket = await pool.acquire(name, priority)
        assert ticket is not None
        order.append(name)
        pool.release(ticket)

    waiters = [
        asyncio.create_task(wait(name, priority))
        for name, priority in [("a0", 0), ("b4", 4), ("c4", 4), ("d1", 1)]
    ]
    await asyncio.sleep(0)  # let every waiter reach the queue
    assert pool.waiting == 4
    pool.release(running)
    await asyncio.gather(*waiters)
    assert order == ["b4", "c4", "d1", "a0"]
    assert paused == []  # nobody waiting was interactive


async def test_an_interactive_job_pauses_the_youngest_of_the_lowest_priority() -> None:
    paused: list[Ticket] = []
    pool = slots(3, paused)
    old_low = await pool.acquire("old-low", 1)
    young_low = await pool.acquire("young-low", 1)
    mid = await pool.acquire("mid", 3)
    assert old_low is not None
    assert young_low is not None
    assert mid is not None
    urgent = asyncio.create_task(pool.acquire("urgent", 7))
    await asyncio.sleep(0)
    assert [t.request_id for t in paused] == ["young-low"]
    assert not urgent.done()
    pool.release(young_low)  # the paused job's engine request ended
    ticket = await urgent
    assert ticket is not None
    assert ticket.request_id == "urgent"


async def test_no_pause_when_every_running_job_is_as_urgent() -> None:
    paused: list[Ticket] = []
    pool = slots(1, paused, lookout_s=60)
    assert await pool.acquire("running", 7)
    waiter = asyncio.create_task(pool.acquire("urgent", 7))
    await asyncio.sleep(0)
    assert paused == []
    waiter.cancel()


async def test_two_interactive_jobs_pause_two_and_a_paused_job_is_chosen_once() -> None:
    paused: list[Ticket] = []
    pool = slots(2, paused)
    assert await pool.acquire("low-a", 0)
    assert await pool.acquire("low-b", 0)
    first = asyncio.create_task(pool.acquire("urgent-1", 9))
    await asyncio.sleep(0)
    second = asyncio.create_task(pool.acquire("urgent-2", 9))
    await asyncio.sleep(0)
    assert sorted(t.request_id for t in paused) == ["low-a", "low-b"]
    for ticket in list(paused):
        pool.release(ticket)
    assert {(await first).request_id, (await second).request_id} == {  # type: ignore[union-attr]
        "urgent-1",
        "urgent-2",
    }


async def test_a_waiting_job_is_given_back_only_while_interactive_jobs_are_about() -> None:
    paused: list[Ticket] = []
    clock = Clock()
    pool = slots(1, paused, lookout_s=0.01, armed_for_s=600, clock=clock)
    running = await pool.acquire("running", 0)
    assert running is not None
    # a worker starts armed: a job waiting on a full worker is given back
    held = asyncio.create_task(pool.acquire("held", 2))
    with pytest.raises(GiveBack):
        await held
    assert pool.waiting == 0
    # ten minutes without an interactive job: closed, a waiting job keeps its place
    clock.now += 601
    quiet = asyncio.create_task(pool.acquire("quiet", 0))
    await asyncio.sleep(0.05)
    assert not quiet.done()
    quiet.cancel()
    # an interactive job came: open again for ten minutes
    pool.release(running)
    urgent = await pool.acquire("urgent", 9)
    assert urgent is not None
    again = asyncio.create_task(pool.acquire("again", 2))
    with pytest.raises(GiveBack):
        await again
    clock.now += 599
    later = asyncio.create_task(pool.acquire("later", 2))
    with pytest.raises(GiveBack):
        await later
    clock.now += 2
    last = asyncio.create_task(pool.acquire("last", 2))
    await asyncio.sleep(0.05)
    assert not last.done()
    pool.release(urgent)
    assert await last is not None


async def test_a_withdrawn_wait_returns_none_and_keeps_the_slot_free() -> None:
    paused: list[Ticket] = []
    pool = slots(1, paused, lookout_s=60)
    running = await pool.acquire("running", 0)
    assert running is not None
    waiter = asyncio.create_task(pool.acquire("cancelled", 0))
    await asyncio.sleep(0)
    assert pool.withdraw("cancelled")
    assert await waiter is None
    assert not pool.withdraw("cancelled")
    pool.release(running)
    assert pool.running == 0


async def test_a_task_cancelled_while_waiting_leaves_no_claim() -> None:
    paused: list[Ticket] = []
    pool = slots(1, paused, lookout_s=60)
    running = await pool.acquire("running", 0)
    assert running is not None
    waiter = asyncio.create_task(pool.acquire("gone", 0))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    pool.release(running)
    assert (pool.running, pool.waiting) == (0, 0)
