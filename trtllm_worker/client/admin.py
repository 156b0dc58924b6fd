"""Operator calls of the SDK: what a dead letter says, and how a requeue resets a job
so it runs again from the start."""

from __future__ import annotations

from typing import Any

import pydantic_core
from aio_pika.abc import AbstractIncomingMessage
from pydantic import BaseModel, ConfigDict

from trtllm_worker.contract.job import valid_request_id
from trtllm_worker.contract.queues import DELIVERIES_HEADER
from trtllm_worker.streams.scripts import lua

ERROR_HEADERS = frozenset({"x-error-code", "x-error-message"})
# Bookkeeping a requeued copy must not carry: a quorum queue's delivery count (and the
# failed deliveries a paused job's copy carries) would make the worker count the dead
# letter's past deliveries against the new job.
DROPPED_HEADERS = ERROR_HEADERS | {"x-delivery-count", DELIVERIES_HEADER}

RESET_FOR_REQUEUE = lua("reset_for_requeue")
"""Forgets a job's delivery count, and removes its stream when it ends with the `error`
entry of its dead-lettering, so that a requeued job runs again from the start
(`streams/lua/reset_for_requeue.lua`)."""


class DeadLetter(BaseModel):
    """A message of `<queue>.dead` and why the worker could not run it."""

    model_config = ConfigDict(frozen=True)

    request_id: str | None
    """From the body when it holds a well-formed one, else the AMQP message_id."""
    code: str
    message: str
    body: bytes
    content_type: str | None = None
    message_id: str | None = None
    headers: dict[str, Any] = {}


def _header_text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return "" if value is None else str(value)


def read_dead_letter(message: AbstractIncomingMessage) -> DeadLetter:
    headers = dict(message.headers or {})
    request_id: str | None = None
    try:
        data = pydantic_core.from_json(message.body)
    except ValueError:
        data = None
    if isinstance(data, dict) and "request_id" in data:
        request_id = valid_request_id(data["request_id"])
    else:
        request_id = valid_request_id(message.message_id)
    return DeadLetter(
        request_id=request_id,
        code=_header_text(headers.get("x-error-code")) or "unknown",
        message=_header_text(headers.get("x-error-message")),
        body=message.body,
        content_type=message.content_type,
        message_id=message.message_id,
        headers={k: v for k, v in headers.items() if k != "x-delivery-count"},
    )
