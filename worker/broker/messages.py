"""AMQP message helpers shared by the worker (dead letters) and the client (requeue)."""

from __future__ import annotations

from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

PUBLISHED_MS_HEADER = "timestamp_in_ms"
"""Milliseconds since the epoch at publication, as RabbitMQ's message-timestamp plugin
names it (the SDK sets it too); the AMQP `timestamp` property holds whole seconds."""


def persistent_copy(message: AbstractIncomingMessage, headers: dict[str, Any]) -> aio_pika.Message:
    """The message's body and properties as a new persistent message with `headers`.
    `expiration` is not copied (the copy would expire too) and neither is `user_id` (the
    broker checks it against the publishing connection's user)."""
    return aio_pika.Message(
        message.body,
        headers=headers,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=message.priority,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
    )


def published_ns(message: AbstractIncomingMessage) -> int | None:
    """When the message was published (nanoseconds since the epoch), if it says: the
    `timestamp_in_ms` header, else the `timestamp` property."""
    headers = message.headers
    if headers:
        value = headers.get(PUBLISHED_MS_HEADER)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value * 1_000_000
    stamp = message.timestamp
    return None if stamp is None else int(stamp.timestamp() * 1e9)
