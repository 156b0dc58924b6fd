"""The job message a producer publishes: built from keyword arguments and validated
here exactly as the worker will, so that a bad job fails before it is published."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from datetime import datetime
from typing import Any, TypedDict, Unpack

import aio_pika

from trtllm_worker.client.errors import InvalidJobError
from trtllm_worker.contract.errors import InvalidJob
from trtllm_worker.contract.job import JobLimits, Parameters, parse_job
from trtllm_worker.contract.queues import PUBLISHED_MS_HEADER

# Schema-only validation when the worker's limits are not known.
_UNBOUNDED = JobLimits(max_new_tokens=2**63, default_max_new_tokens=2**63)


class JobOptions(TypedDict, total=False):
    """The job's fields besides its prompt string and parameters (all optional)."""

    input_ids: Seq[int]
    """A pre-tokenized prompt instead of `inputs`."""
    messages: Seq[Mapping[str, Any]]
    """A conversation instead of `inputs`: `{"role": ..., "content": ...}` each."""
    tools: Seq[Mapping[str, Any]]
    """With `messages`: tool definitions for the chat template."""
    chat_template_kwargs: Mapping[str, Any]
    """With `messages`: extra template variables (e.g. `enable_thinking`)."""
    request_id: str
    deadline: datetime | str
    tenant: str
    """Whom the job is for: its usage is counted under it."""
    metadata: Mapping[str, Any]


def job_body(
    inputs: str | Seq[int] | None = None,
    parameters: Mapping[str, Any] | Parameters | None = None,
    **options: Unpack[JobOptions],
) -> dict[str, Any]:
    """The job message as the contract defines it (a fresh request id if none is given).
    `inputs` may be a prompt string or a list of token ids (sent as `input_ids`)."""
    body: dict[str, Any] = {"request_id": options.get("request_id") or uuid.uuid4().hex}
    if isinstance(inputs, str):
        body["inputs"] = inputs
    elif inputs is not None:
        body["input_ids"] = list(inputs)
    if "input_ids" in options:
        body["input_ids"] = list(options["input_ids"])
    if "messages" in options:
        body["messages"] = [dict(m) for m in options["messages"]]
    if "tools" in options:
        body["tools"] = [dict(t) for t in options["tools"]]
    if "chat_template_kwargs" in options:
        body["chat_template_kwargs"] = dict(options["chat_template_kwargs"])
    if isinstance(parameters, Parameters):
        body["parameters"] = parameters.model_dump(exclude_unset=True)
    elif parameters:
        body["parameters"] = dict(parameters)
    deadline = options.get("deadline")
    if deadline is not None:
        body["deadline"] = deadline.isoformat() if isinstance(deadline, datetime) else deadline
    if "tenant" in options:
        body["tenant"] = options["tenant"]
    if "metadata" in options:
        body["metadata"] = dict(options["metadata"])
    return body


def validate_job(body: Mapping[str, Any], limits: JobLimits | None = None) -> bytes:
    """The encoded body, validated exactly as the worker will (`InvalidJobError`)."""
    try:
        encoded = json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidJobError(f"body is not JSON-serialisable: {exc}") from None
    try:
        parse_job(
            encoded,
            content_type="application/json",
            message_id=None,
            limits=limits or _UNBOUNDED,
        )
    except InvalidJob as exc:
        raise InvalidJobError(exc.message, code=exc.code) from None
    return encoded


def job_message(
    encoded: bytes,
    request_id: str,
    priority: int | None,
    now: float,
    headers: Mapping[str, Any] | None = None,
) -> aio_pika.Message:
    """The AMQP message of a validated job body: persistent, its request id as message
    id, published at `now` (the timestamp and the worker's queue-wait header), at
    `priority`, with any further `headers` (a trace context)."""
    return aio_pika.Message(
        encoded,
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=request_id,
        timestamp=now,
        headers={**(headers or {}), PUBLISHED_MS_HEADER: int(now * 1000)},
        priority=priority,
    )
