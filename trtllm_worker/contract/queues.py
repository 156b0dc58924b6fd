"""The RabbitMQ side of the contract: the names derived from the job queue's
(WORKER_QUEUE), as producers, the worker and the grants all spell them, and the header
a job message may carry. Key names are in `contract.stream`."""

from __future__ import annotations

import re
import uuid
from typing import Final

from trtllm_worker.contract.priority import MAX_PRIORITY

PUBLISHED_MS_HEADER: Final = "timestamp_in_ms"
"""Milliseconds since the epoch at publication, as RabbitMQ's message-timestamp plugin
names it (the SDK sets it too); the AMQP `timestamp` property holds whole seconds."""

TRACEPARENT: Final = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
"""W3C Trace Context's `traceparent` header (version, trace id, parent id, flags), which
a job message may carry so that the producer's trace continues in the worker."""

RETURNS_HEADER: Final = "x-trtllm-returns"
"""On a copy the worker put back in the queue to make room for a more urgent job: how
many times the job was paused or given back so far."""
DELIVERIES_HEADER: Final = "x-trtllm-deliveries"
"""On such a copy: the failed deliveries of the job before it (the original's
`x-delivery-count`, which the copy, a new message, starts again from 0)."""

CANCEL_QUEUE_ID_HEX: Final = 12
"""Hex digits after the cancel exchange's name in a worker's cancel queue."""


CONSUMER_TIMEOUT_MS: Final = 7 * 24 * 3600 * 1000
"""The job queue's `x-consumer-timeout` (RabbitMQ 3.12 and later): a week. The broker's
default (30 minutes, node-wide) would close the channel of a worker whose job runs longer
and requeue its jobs; the worker bounds its jobs itself (engine stall detection, leases,
deadlines). A `consumer-timeout` policy still lowers it: the broker takes the lower."""


def job_queue_arguments(queue_type: str) -> dict[str, str | int]:
    """The job queue's arguments as the worker declares it: a classic queue orders
    priorities 0-9 only if declared with `x-max-priority`; a quorum queue takes no such
    argument (RabbitMQ 4.0 orders two levels, 0-4 below 5-9, on its own)."""
    arguments: dict[str, str | int] = {
        "x-queue-type": queue_type,
        "x-consumer-timeout": CONSUMER_TIMEOUT_MS,
    }
    if queue_type == "classic":
        arguments["x-max-priority"] = MAX_PRIORITY
    return arguments


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
