"""Batched acknowledgements (trtllm_worker/broker/settle.py `AckBatcher`) on the real broker:
every settled message is acknowledged, and a job still running at the front of a
channel's deliveries does not hold the prefetch window of those behind it."""

from __future__ import annotations

import asyncio

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from tests.services import ServiceUrls
from trtllm_worker.broker.settle import AckBatcher

PREFETCH = 3


async def test_acks_free_the_window_at_once_and_leave_nothing_unacknowledged(
    amqp_channel: AbstractChannel, names: dict[str, str], services: ServiceUrls
) -> None:
    queue_name = names["queue"]
    await amqp_channel.declare_queue(queue_name, durable=True)
    for n in range(6):
        await amqp_channel.default_exchange.publish(
            aio_pika.Message(str(n).encode(), message_id=str(n)), routing_key=queue_name
        )
    connection = await aio_pika.connect(services.amqp)
    batcher = AckBatcher()
    received: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        queue = await channel.declare_queue(queue_name, durable=True)

        async def on_message(message: AbstractIncomingMessage) -> None:
            batcher.delivered(message)
            await received.put(message)

        await queue.consume(on_message)

        async def take(count: int) -> list[AbstractIncomingMessage]:
            async with asyncio.timeout(10):
                return [await received.get() for _ in range(count)]

        first = await take(PREFETCH)
        assert received.empty()
        for message in first[1:]:  # the one in front stays unsettled
            batcher.ack(message)
        later = await take(2)  # acknowledged although not at the front: the window moved
        assert [m.body for m in later] == [b"3", b"4"]
        for message in (first[0], *later):  # now one multiple ack covers the front run
            batcher.ack(message)
        [last] = await take(1)
        batcher.ack(last)
        await batcher.drain()
        await channel.close()  # anything not acknowledged would be requeued now
        check = await connection.channel()
        declared = await check.declare_queue(queue_name, durable=True, passive=True)
        assert declared.declaration_result.message_count == 0
    finally:
        await connection.close()
