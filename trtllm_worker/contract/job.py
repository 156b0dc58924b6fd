"""Message bytes → `Job`. Sizes and content type are checked before parsing; the request
id is checked against its pattern before it is used anywhere; every error names the field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trtllm_worker.contract.errors import InvalidJob

MAX_BODY_BYTES = 1 << 20
MAX_METADATA_BYTES = 4096
MAX_STOP_SEQUENCES = 8
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 16
MAX_MESSAGES = 256
MAX_TOP_LOGPROBS = 20
"""The most `top_logprobs` a job may ask for (OpenAI's bound too)."""
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"
"""The characters of a request id, at most 64 of them."""
_TENANT_RE = re.compile(TENANT_PATTERN)
ADAPTER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
"""A LoRA adapter's name (its folder's): the characters of a request id but `:`, which
separates tenant and adapter in the usage counters."""
_RFC3339_RE = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})"
)
ACCEPTED_CONTENT_TYPES = frozenset({"application/json"})


@dataclass(frozen=True, slots=True)
class JobLimits:
    """The settings-dependent bounds a job is validated against."""

    max_new_tokens: int
    default_max_new_tokens: int


class JsonGrammar(BaseModel):
    """Output constrained to a JSON Schema."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["json"]
    value: dict[str, Any]


class RegexGrammar(BaseModel):
    """Output constrained to a regular expression."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["regex"]
    value: Annotated[str, Field(min_length=1)]


Grammar = Annotated[JsonGrammar | RegexGrammar, Field(discriminator="type")]


class Message(BaseModel):
    """One message of a conversation, as chat templates read it."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    role: Annotated[str, Field(min_length=1)]
    content: str
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class Parameters(BaseModel):
    """Generation parameters; every field optional."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    min_new_tokens: Annotated[int, Field(ge=0)] | None = None
    do_sample: bool | None = None
    temperature: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(gt=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOP_SEQUENCES),
        ]
        | None
    ) = None
    ignore_eos: bool = False
    truncate: Annotated[int, Field(ge=1)] | None = None
    return_logprobs: bool = False
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
    grammar: Grammar | None = None
    top_logprobs: Annotated[int, Field(ge=1, le=MAX_TOP_LOGPROBS)] | None = None
    """With `return_logprobs`: this many most likely tokens per generated token."""


class Job(BaseModel):
    """One generation job as the contract defines it (after `request_id` resolution)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    request_id: Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]
    inputs: Annotated[str, Field(min_length=1)] | None = None
    input_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parameters: Parameters = Parameters()
    deadline: datetime | None = None
    tenant: Annotated[str, Field(pattern=TENANT_PATTERN)] | None = None
    """Whom the job is for: its usage is counted under it (absent: `-`)."""
    adapter: Annotated[str, Field(pattern=ADAPTER_PATTERN)] | None = None
    """The LoRA adapter to apply: a subfolder name of `WORKER_LORA_DIR` (intake checks
    that the worker has it)."""
    metadata: dict[str, Any] | None = None

    @field_validator("deadline", mode="before")
    @classmethod
    def _rfc3339(cls, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, str):
            raise ValueError("must be an RFC 3339 time string")
        if not _RFC3339_RE.fullmatch(value):
            raise ValueError("must be an RFC 3339 time with offset, e.g. 2030-01-02T03:04:05Z")
        try:
            parsed = datetime.fromisoformat(value.upper())
        except ValueError:
            raise ValueError("must be an RFC 3339 time with offset") from None
        if parsed.tzinfo is None:
            raise ValueError("must carry a UTC offset (e.g. Z or +02:00)")
        return parsed

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(metadata_json(value).encode()) > MAX_METADATA_BYTES:
            raise ValueError(f"must be at most {MAX_METADATA_BYTES} bytes as JSON")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> Job:
        given = [self.inputs, self.input_ids, self.messages]
        if sum(value is not None for value in given) != 1:
            raise ValueError("inputs, input_ids, messages: exactly one of them must be given")
        if self.messages is None:
            for name in ("tools", "chat_template_kwargs"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only with messages")
        return self

    def max_new_tokens(self, limits: JobLimits) -> int:
        return self.parameters.max_new_tokens or limits.default_max_new_tokens


def metadata_json(metadata: dict[str, Any]) -> str:
    return json.dumps(metadata, separators=(",", ":"), ensure_ascii=False)


def valid_request_id(value: object) -> str | None:
    """The value if it is a well-formed request id, else None (never raises)."""
    if isinstance(value, str) and _REQUEST_ID_RE.fullmatch(value):
        return value
    return None


def valid_tenant(value: object) -> str | None:
    """The value if it is a well-formed tenant, else None (never raises)."""
    if isinstance(value, str) and _TENANT_RE.fullmatch(value):
        return value
    return None


def parse_job(
    body: bytes,
    *,
    content_type: str | None,
    message_id: str | None,
    limits: JobLimits,
) -> Job:
    """Validate one message. Raises `InvalidJob` (with the request id when readable)."""
    fallback_id = valid_request_id(message_id)
    if content_type and content_type.split(";")[0].strip().lower() not in ACCEPTED_CONTENT_TYPES:
        raise InvalidJob(
            f"content_type {content_type!r} is not application/json", request_id=fallback_id
        )
    if len(body) > MAX_BODY_BYTES:
        raise InvalidJob(
            f"body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}", request_id=fallback_id
        )
    try:
        data = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise InvalidJob(f"body is not valid JSON: {exc}", request_id=fallback_id) from None
    if not isinstance(data, dict):
        raise InvalidJob("body must be a JSON object", request_id=fallback_id)
    if "request_id" in data:
        request_id: object = data["request_id"]
        readable = valid_request_id(request_id)
    else:
        request_id = message_id
        readable = fallback_id
    if request_id is None:
        raise InvalidJob("request_id: required (in the body or as the AMQP message_id)")
    try:
        job = Job.model_validate({**data, "request_id": request_id})
    except ValidationError as exc:
        # an invalid job's error entry still counts, under its tenant when readable
        tenant = valid_tenant(data.get("tenant"))
        raise InvalidJob(describe(exc), request_id=readable, tenant=tenant) from None
    try:
        _check_limits(job, limits)
    except InvalidJob as exc:
        exc.tenant = job.tenant
        raise
    return job


def _check_limits(job: Job, limits: JobLimits) -> None:
    params = job.parameters
    max_new = job.max_new_tokens(limits)
    if max_new > limits.max_new_tokens:
        raise InvalidJob(
            f"parameters.max_new_tokens: must be at most {limits.max_new_tokens}",
            request_id=job.request_id,
        )
    if params.min_new_tokens is not None and params.min_new_tokens > max_new:
        raise InvalidJob(
            f"parameters.min_new_tokens: must be at most max_new_tokens ({max_new})",
            request_id=job.request_id,
        )
    if params.top_logprobs is not None and not params.return_logprobs:
        # refused rather than implied, as OpenAI's API does: the entries would carry a
        # field (`logprob`) the job did not ask for
        raise InvalidJob(
            "parameters.top_logprobs: needs parameters.return_logprobs true",
            request_id=job.request_id,
        )


def describe(exc: ValidationError) -> str:
    """One line naming each failing field: `parameters.top_p: Input should be ...`."""
    parts = []
    for error in exc.errors(include_url=False, include_input=False)[:5]:
        loc = ".".join(str(p) for p in error["loc"] if not str(p).startswith("function-"))
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field"
        parts.append(f"{loc}: {message}" if loc else message)
    return "; ".join(parts)


def parse_cancel(body: bytes) -> str | None:
    """The request id of a cancel message, or None when it is unreadable."""
    return request_id_of(body)


def request_id_of(body: bytes) -> str | None:
    """The well-formed `request_id` of a JSON object body, else None (never raises)."""
    if len(body) > MAX_BODY_BYTES:
        return None
    try:
        data = pydantic_core.from_json(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    return valid_request_id(data.get("request_id"))
