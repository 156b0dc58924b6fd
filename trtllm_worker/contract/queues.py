"""The RabbitMQ side of the contract: the names derived from the job queue's
(WORKER_QUEUE), as producers, the worker and the grants all spell them, and the header
a job message may carry. Key names are in `contract.stream`."""

from __future__ import annotations

import uuid
from typing import Final

PUBLISHED_MS_HEADER: Final = "timestamp_in_ms"
"""Milliseconds since the epoch at publication, as RabbitMQ's message-timestamp plugin
names it (the SDK sets it too); the AMQP `timestamp` property holds whole seconds."""

CANCEL_QUEUE_ID_HEX: Final = 12
"""Hex digits after the cancel exchange's name in a worker's cancel queue."""


def dead_queue_name(queue: str) -> str:
    """Where jobs that can never run go, with their reasons: `<queue>.dead`."""
    return f"{queue}.dead"


def cancel_exchange_name(queue: str) -> str:
    """The fanout that carries cancels to every worker: `<queue>.cancel`."""
    return f"{queue}.cancel"


def cancel_queue_name(exchange: str) -> str:
    """A worker's exclusive queue on the cancel fanout: `<queue>.cancel.<12 hex>`, named
    after the exchange so that one permission pattern covers it."""
    return f"{exchange}.{uuid.uuid4().hex[:CANCEL_QUEUE_ID_HEX]}"
