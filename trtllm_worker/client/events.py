"""A request's stream entries as typed events: the contract's `token`, `done` and
`error` entries, parsed without any Redis connection (a subscriber reading the stream
its own way can use `parse_entry` alone)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from trtllm_worker.client.errors import StreamFormatError
from trtllm_worker.contract.job import describe


def _json_text(value: object) -> object:
    """A field Redis holds as JSON text, decoded before validation."""
    if isinstance(value, str | bytes):
        return json.loads(value)
    return value


class _Entry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    entry_id: str
    """The stream entry id (`0-<n>`): `stream(request_id, from_id=entry_id)` resumes after it."""


class TokenEvent(_Entry):
    """One generated token. `text` is the text this token completes (may be empty)."""

    event: Literal["token"] = "token"
    index: int
    token_id: int
    text: str
    logprob: float | None = None
    """The token's log probability (with `return_logprobs`)."""
    top_logprobs: list[tuple[int, float]] | None = None
    """With `top_logprobs`: the most likely tokens at this position as
    `(token_id, logprob)`, most likely first."""

    _top_json = field_validator("top_logprobs", mode="before")(_json_text)


class DoneEvent(_Entry):
    """The request finished; the last entry of its stream."""

    event: Literal["done"] = "done"
    finish_reason: str
    generated_tokens: int
    input_tokens: int
    generated_text: str
    metadata: dict[str, Any] | None = None

    _json = field_validator("metadata", mode="before")(_json_text)


class ErrorEvent(_Entry):
    """The request failed; the last entry of its stream."""

    event: Literal["error"] = "error"
    code: str
    message: str


Event = TokenEvent | DoneEvent | ErrorEvent
_EVENT_TYPES: dict[str, type[TokenEvent] | type[DoneEvent] | type[ErrorEvent]] = {
    "token": TokenEvent,
    "done": DoneEvent,
    "error": ErrorEvent,
}


def parse_entry(entry_id: str, fields: Mapping[str, str]) -> Event | None:
    """A stream entry as its typed event; None for an event type this client does not
    know (the contract says to ignore those). Raises `StreamFormatError`."""
    model = _EVENT_TYPES.get(fields.get("event", ""))
    if model is None:
        return None
    try:
        return model.model_validate({**fields, "entry_id": entry_id})
    except (ValidationError, ValueError) as exc:
        reason = describe(exc) if isinstance(exc, ValidationError) else str(exc)
        raise StreamFormatError(f"entry {entry_id}: {reason}") from None
