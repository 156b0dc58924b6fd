"""Re-declaring the job queue with the arguments this version of the worker declares
(`x-max-priority` for a classic queue, or another queue type) without losing a job.
A queue's arguments cannot change in place, so its jobs move to `<queue>.migrating`,
the queue is deleted and declared again, and the jobs move back. Every move publishes a
copy, waits for the broker's confirm, then acknowledges the original: killed at any
point, a job is in one of the two queues (at worst in both, which the stream's terminal
entry makes harmless). Run again, the command finishes an interrupted migration."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractQueue

from trtllm_worker.connect.messages import fold_delivery_count, persistent_copy
from trtllm_worker.contract.queues import job_queue_arguments

CONFIRM_TIMEOUT_S = 30.0
PROGRESS_EVERY = 1000
Report = Callable[[str], None]


class MigrationRefused(Exception):
    """The queue cannot be migrated now (workers still consume it); nothing was moved."""


@dataclass(frozen=True, slots=True)
class Migration:
    """What a migration did."""

    queue: str
    moved: int
    """Jobs that went through `<queue>.migrating` (0: the queue needed no migration)."""
    migrated: bool


def migrating_queue_name(queue: str) -> str:
    return f"{queue}.migrating"


async def migrate_queue(
    connection: AbstractConnection, queue: str, queue_type: str, report: Report
) -> Migration:
    """Make `queue` what the worker declares, keeping its jobs. Refuses while the queue
    has consumers (stop the workers first; producers should pause too: a job published
    in the moment the queue is deleted is unroutable)."""
    temp = migrating_queue_name(queue)
    arguments = job_queue_arguments(queue_type)
    if await _declares(connection, queue, arguments):
        # already right: finish an earlier run that was interrupted after the swap
        moved = 0
        if await _exists(connection, temp):
            moved = await _drain_into(connection, temp, queue, report)
            await _delete(connection, temp)
        return Migration(queue, moved, migrated=moved > 0)
    async with connection.channel() as channel:
        old = await channel.declare_queue(queue, passive=True)
        consumers = old.declaration_result.consumer_count
        if consumers:
            raise MigrationRefused(
                f"queue {queue!r} has {consumers} consumers: stop the workers first"
            )
    async with connection.channel() as channel:
        await channel.declare_queue(temp, durable=True, arguments={**arguments})
    moved = await _drain_into(connection, queue, temp, report)
    while not await _delete(connection, queue):
        # a producer published meanwhile: move that too, then try again
        more = await _drain_into(connection, queue, temp, report)
        if not more:
            raise MigrationRefused(
                f"queue {queue!r} could not be deleted (a consumer came?): its jobs are in "
                f"{temp!r}; stop the workers and run the command again"
            )
        moved += more
    async with connection.channel() as channel:
        await channel.declare_queue(queue, durable=True, arguments={**arguments})
    report(f"queue {queue!r} declared again: {_describe(arguments)}")
    back = await _drain_into(connection, temp, queue, report)
    await _delete(connection, temp)
    if back != moved:
        report(f"{moved} jobs moved out, {back} moved back (an earlier run had left some)")
    return Migration(queue, max(moved, back), migrated=True)


def _describe(arguments: dict[str, str | int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in arguments.items())


async def _declares(
    connection: AbstractConnection, queue: str, arguments: dict[str, str | int]
) -> bool:
    """Whether declaring `queue` with these arguments succeeds (it creates a missing
    queue, which then needs no migration)."""
    try:
        async with connection.channel() as channel:
            await channel.declare_queue(queue, durable=True, arguments={**arguments})
    except aiormq.exceptions.ChannelPreconditionFailed:
        return False
    return True


async def _exists(connection: AbstractConnection, queue: str) -> bool:
    try:
        async with connection.channel() as channel:
            await channel.declare_queue(queue, passive=True)
    except aio_pika.exceptions.ChannelNotFoundEntity:
        return False
    return True


async def _delete(connection: AbstractConnection, queue: str) -> bool:
    """Delete the queue if it is empty and unused; False when it is not. Checked with a
    passive declaration first: quorum queues refuse `if-empty`/`if-unused` (RabbitMQ
    answers NOT_IMPLEMENTED, closing the connection)."""
    async with connection.channel() as channel:
        declared = await channel.declare_queue(queue, passive=True)
        result = declared.declaration_result
        if result.message_count or result.consumer_count:
            return False
        await channel.queue_delete(queue)
    return True


async def _drain_into(
    connection: AbstractConnection, source: str, target: str, report: Report
) -> int:
    """Move every job of `source` to `target`, each confirmed before its original is
    acknowledged; properties (priority included) and headers are kept."""
    moved = 0
    async with connection.channel(publisher_confirms=True) as channel:
        queue = await channel.declare_queue(source, passive=True)
        total = queue.declaration_result.message_count or 0
        while await _move_one(channel, queue, target):
            moved += 1
            if moved % PROGRESS_EVERY == 0:
                report(f"moved {moved}/{max(total, moved)} jobs from {source!r} to {target!r}")
    if moved:
        report(f"moved {moved} jobs from {source!r} to {target!r}")
    return moved


async def _move_one(channel: AbstractChannel, queue: AbstractQueue, target: str) -> bool:
    message = await queue.get(no_ack=False, fail=False)
    if message is None:
        return False
    copy = persistent_copy(message, fold_delivery_count(dict(message.headers or {})))
    async with asyncio.timeout(CONFIRM_TIMEOUT_S):
        await channel.default_exchange.publish(copy, routing_key=target, mandatory=True)
    await message.ack()
    return True
