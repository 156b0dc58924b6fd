"""The cancel broadcast on the workers' fanout exchange, `<queue>.cancel`. It is one
half of a cancel (the other is the mark in Redis, `streams.store.mark_cancelled`), and
must tolerate a deployment where no worker has yet declared the exchange."""

from __future__ import annotations

import contextlib
import json

import aio_pika
import aiormq


def cancel_body(request_id: str) -> bytes:
    """The message the workers' cancel listeners read."""
    return json.dumps({"request_id": request_id}).encode()


async def broadcast_cancel(exchange: aio_pika.abc.AbstractExchange, body: bytes) -> None:
    """Publish a cancel on the fanout. No worker running: nobody is bound and the mark
    in Redis remains; no worker ever started: the exchange is missing, the broker closes
    the channel (opened anew on the next publish) and the mark alone is the cancel."""
    with contextlib.suppress(aiormq.exceptions.ChannelNotFoundEntity):
        await exchange.publish(
            aio_pika.Message(body, content_type="application/json"),
            routing_key="",
            mandatory=False,
        )
