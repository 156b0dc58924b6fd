"""A small client for producers and subscribers: publish a job (persistent, with
publisher confirms), follow its stream from any entry id, cancel it."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from typing import Any, cast

import aio_pika
import redis.asyncio as aioredis

from worker.publisher import TERMINAL_EVENTS

XREAD_BLOCK_MS = 1000


def job_body(
    *,
    inputs: str | None = None,
    input_ids: list[int] | None = None,
    parameters: Mapping[str, Any] | None = None,
    request_id: str | None = None,
    deadline: datetime | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The job message as the contract defines it (a fresh request id if none is given)."""
    body: dict[str, Any] = {"request_id": request_id or uuid.uuid4().hex}
    if inputs is not None:
        body["inputs"] = inputs
    if input_ids is not None:
        body["input_ids"] = list(input_ids)
    if parameters:
        body["parameters"] = dict(parameters)
    if deadline is not None:
        body["deadline"] = deadline.isoformat()
    if metadata is not None:
        body["metadata"] = dict(metadata)
    return body


async def submit(amqp_url: str, queue: str, body: Mapping[str, Any]) -> str:
    """Publish one job; returns once the broker confirmed it. Returns the request id."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        message = aio_pika.Message(
            json.dumps(body).encode(),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=str(body["request_id"]),
        )
        await channel.default_exchange.publish(message, routing_key=queue, mandatory=True)
    return str(body["request_id"])


async def cancel(amqp_url: str, queue: str, request_id: str) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(
            f"{queue}.cancel", aio_pika.ExchangeType.FANOUT, durable=True
        )
        body = json.dumps({"request_id": request_id}).encode()
        await exchange.publish(aio_pika.Message(body, content_type="application/json"), "")


async def follow(
    redis_url: str, key: str, from_id: str = "0"
) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """Yield `(entry_id, fields)` of a stream from `from_id` until its terminal entry.
    Resuming from the last id seen never skips or repeats an entry."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    last_id = from_id
    try:
        while True:
            reply = await client.xread({key: last_id}, block=XREAD_BLOCK_MS, count=512)
            for _, entries in cast(list[tuple[str, list[tuple[str, dict[str, str]]]]], reply):
                for entry_id, fields in entries:
                    last_id = entry_id
                    yield entry_id, fields
                    if fields.get("event") in TERMINAL_EVENTS:
                        return
    finally:
        await client.aclose()
