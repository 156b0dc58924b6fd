"""AMQP message helpers shared by the worker (dead letters) and the client (requeue)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from trtllm_worker.connect.shortstr import raw, undecodable
from trtllm_worker.contract.queues import DELIVERIES_HEADER, PUBLISHED_MS_HEADER

STRING_PROPERTIES: Final = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "message_id",
    "type",
    "app_id",
    "user_id",
)
"""The AMQP short string properties as aio-pika names them on a received message."""


def undecodable_fields(message: AbstractIncomingMessage) -> list[str]:
    """Each property and header key of the message whose bytes are not UTF-8 (see
    `trtllm_worker.connect.shortstr`), with those bytes: `message_id b'\\xff'`,
    `headers[b'\\xfe']`, `headers['x-a'][b'\\xfe']`. Empty for a sound message."""
    found = [
        f"{name} {raw(value)!r}"
        for name in STRING_PROPERTIES
        if isinstance(value := getattr(message, name, None), str) and undecodable(value)
    ]
    found.extend(_undecodable_keys(message.headers or {}, "headers"))
    return found


def _undecodable_keys(value: object, path: str) -> Iterator[str]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if undecodable(key):
                yield f"{path}[{raw(key)!r}]"
            else:
                yield from _undecodable_keys(item, f"{path}[{key!r}]")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _undecodable_keys(item, f"{path}[{index}]")


def _decodable(value: str | None) -> str | None:
    return None if value is None or undecodable(value) else value


def decodable_table(value: Any) -> Any:
    """A header value without the table keys that are not UTF-8 (at any depth): pamqp
    cannot encode them again."""
    if isinstance(value, Mapping):
        return {k: decodable_table(v) for k, v in value.items() if not undecodable(k)}
    if isinstance(value, list | tuple):
        return [decodable_table(item) for item in value]
    return value


def fold_delivery_count(headers: dict[str, Any]) -> dict[str, Any]:
    """Headers for a copy of a job published anew: the broker's `x-delivery-count` (failed
    deliveries of the original; a quorum queue starts a new message from 0, a classic
    queue would keep a stale one) is added to what `x-trtllm-deliveries` carried."""
    folded = dict(headers)
    count = folded.pop("x-delivery-count", None)
    carried = folded.get(DELIVERIES_HEADER)
    failed = (carried if isinstance(carried, int) else 0) + (count if isinstance(count, int) else 0)
    if failed:
        folded[DELIVERIES_HEADER] = failed
    return folded


def persistent_copy(message: AbstractIncomingMessage, headers: dict[str, Any]) -> aio_pika.Message:
    """The message's body and properties as a new persistent message with `headers`.
    `expiration` is not copied (the copy would expire too) and neither is `user_id` (the
    broker checks it against the publishing connection's user). A property or header key
    that is not UTF-8 is left out (pamqp would refuse to encode it; the caller says so,
    from `undecodable_fields`)."""
    return aio_pika.Message(
        message.body,
        headers=decodable_table(headers),
        content_type=_decodable(message.content_type),
        content_encoding=_decodable(message.content_encoding),
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=message.priority,
        correlation_id=_decodable(message.correlation_id),
        reply_to=_decodable(message.reply_to),
        message_id=_decodable(message.message_id),
        timestamp=message.timestamp,
        type=_decodable(message.type),
        app_id=_decodable(message.app_id),
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
