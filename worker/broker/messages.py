"""AMQP message helpers shared by the worker (dead letters) and the client (requeue)."""

from __future__ import annotations

from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage


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
