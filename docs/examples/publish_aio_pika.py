"""Publish a job with aio-pika alone: a JSON object to the default exchange."""

import asyncio
import json
import os

import aio_pika


async def main() -> None:
    amqp_url = os.environ.get("WORKER_AMQP_URL", "amqp://guest:guest@localhost/")
    queue = os.environ.get("WORKER_QUEUE", "generate")
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        job = {
            "request_id": "req-1",
            "inputs": "Once upon a time",
            "parameters": {"max_new_tokens": 64, "temperature": 0.7, "stop": ["\n\n"]},
        }
        await channel.default_exchange.publish(
            aio_pika.Message(
                json.dumps(job).encode(),
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=queue,
        )


asyncio.run(main())
