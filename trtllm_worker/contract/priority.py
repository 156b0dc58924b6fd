"""A job's priority: the AMQP `priority` property, 0 to 9 (absent: 0). Kept apart from
the body's model because the broker, not the producer's JSON, carries it."""

from __future__ import annotations

from typing import Final, Literal

MAX_PRIORITY: Final = 9
"""The highest priority; also the classic queue's `x-max-priority`."""

PriorityClass = Literal["interactive", "normal"]
"""The bounded label metrics use: one per side of `WORKER_PREEMPT_PRIORITY`."""


def priority_of(value: int | None) -> int:
    """The job's priority from the message's property: absent is 0; above 9 is 9, as a
    classic queue with `x-max-priority` 9 treats it (the property is an unsigned octet,
    so nothing is below 0)."""
    if value is None:
        return 0
    return max(0, min(int(value), MAX_PRIORITY))


def priority_class(priority: int, preempt_priority: int) -> PriorityClass:
    """`interactive` for a job that may pause others (at least `WORKER_PREEMPT_PRIORITY`),
    else `normal`. With pausing off (10), every job is `normal`."""
    return "interactive" if priority >= preempt_priority else "normal"
