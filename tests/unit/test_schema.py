"""The job message of the contract: every rule, every boundary, and what the error says."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from trtllm_worker.contract.errors import InvalidJob
from trtllm_worker.contract.job import (
    MAX_BODY_BYTES,
    MAX_METADATA_BYTES,
    REQUEST_ID_PATTERN,
    Job,
    JobLimits,
    parse_cancel,
    parse_job,
)

LIMITS = JobLimits(max_new_tokens=2048, default_max_new_tokens=256)
REQUEST_ID = "req-1"
DROP = object()
"""A field value meaning "leave this field out of the body"."""


def make_body(**fields: object) -> bytes:
    """A valid job body (`request_id` and `inputs`), changed by `fields`."""
    data: dict[str, object] = {"request_id": REQUEST_ID, "inputs": "hello"}
    data.update(fields)
    return json.dumps({k: v for k, v in data.items() if v is not DROP}).encode()


def with_parameters(**parameters: object) -> bytes:
    return make_body(parameters=parameters)


def parse(
    body: bytes,
    *,
    content_type: str | None = "application/json",
    message_id: str | None = None,
    limits: JobLimits = LIMITS,
) -> Job:
    return parse_job(body, content_type=content_type, message_id=message_id, limits=limits)


def rejected(
    body: bytes,
    *,
    content_type: str | None = "application/json",
    message_id: str | None = None,
    limits: JobLimits = LIMITS,
) -> InvalidJob:
    """The `InvalidJob` parsing raises; also checks what every rejection must satisfy."""
    with pytest.raises(InvalidJob) as info:
        parse(body, content_type=content_type, message_id=message_id, limits=limits)
    error = info.value
    assert error.code == "invalid_request"
    assert error.message == str(error)
    assert error.message.strip(), "the message is empty"
    assert "\n" not in error.message, "the message must be one line"
    return error


def padded_metadata(size: int) -> dict[str, str]:
    """A metadata object whose compact UTF-8 JSON is exactly `size` bytes."""
    overhead = len(json.dumps({"k": ""}, separators=(",", ":")).encode())
    metadata = {"k": "x" * (size - overhead)}
    assert len(json.dumps(metadata, separators=(",", ":")).encode()) == size
    return metadata


# --- request_id ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_id",
    [
        pytest.param("a", id="one-letter"),
        pytest.param("Z", id="one-upper"),
        pytest.param("7", id="one-digit"),
        pytest.param("req-1.2_3:4", id="all-punctuation"),
        pytest.param("0" + "._:-" * 31 + "abc", id="128-mixed"),
        pytest.param("a" * 128, id="length-128"),
        pytest.param("550e8400-e29b-41d4-a716-446655440000", id="uuid"),
    ],
)
def test_request_id_valid(request_id: str) -> None:
    assert parse(make_body(request_id=request_id)).request_id == request_id


@pytest.mark.parametrize(
    "request_id",
    [
        pytest.param("", id="empty"),
        pytest.param("a" * 129, id="length-129"),
        pytest.param("-abc", id="leading-dash"),
        pytest.param(".abc", id="leading-dot"),
        pytest.param("_abc", id="leading-underscore"),
        pytest.param(":abc", id="leading-colon"),
        pytest.param("a b", id="space"),
        pytest.param("a/b", id="slash"),
        pytest.param("a*b", id="star"),
        pytest.param("abc\n", id="trailing-newline"),
        pytest.param("\nabc", id="leading-newline"),
        pytest.param("abc\x00", id="nul"),
        pytest.param("café", id="non-ascii"),
        pytest.param("１２３", id="fullwidth-digits"),
        pytest.param(123, id="int"),
        pytest.param(["abc"], id="list"),
        pytest.param({"id": "abc"}, id="object"),
        pytest.param(True, id="bool"),
    ],
)
def test_request_id_invalid(request_id: object) -> None:
    error = rejected(make_body(request_id=request_id))
    assert "request_id" in error.message
    assert error.request_id is None


def test_request_id_pattern_is_the_contracts() -> None:
    assert REQUEST_ID_PATTERN == r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


def test_request_id_required_without_message_id() -> None:
    error = rejected(make_body(request_id=DROP))
    assert "request_id" in error.message
    assert error.request_id is None


def test_request_id_null_is_missing() -> None:
    error = rejected(make_body(request_id=None))
    assert "request_id" in error.message
    assert error.request_id is None


def test_request_id_from_message_id() -> None:
    assert parse(make_body(request_id=DROP), message_id="amqp-42").request_id == "amqp-42"


def test_request_id_body_wins_over_message_id() -> None:
    assert parse(make_body(request_id="from-body"), message_id="amqp-42").request_id == (
        "from-body"
    )


def test_invalid_message_id_without_body_id() -> None:
    error = rejected(make_body(request_id=DROP), message_id="not valid")
    assert "request_id" in error.message
    assert error.request_id is None


def test_invalid_body_id_is_not_replaced_by_message_id() -> None:
    """The body wins even when its id is malformed: the job has no readable id."""
    error = rejected(make_body(request_id="not valid"), message_id="amqp-42")
    assert "request_id" in error.message
    assert error.request_id is None


def test_readable_message_id_is_reported_for_body_errors() -> None:
    error = rejected(make_body(request_id=DROP, inputs=""), message_id="amqp-42")
    assert "inputs" in error.message
    assert error.request_id == "amqp-42"


# --- inputs / input_ids ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "inputs",
    [
        pytest.param("x", id="one-char"),
        pytest.param(" ", id="space"),
        pytest.param("日本語 😀 e\u0301", id="unicode"),
        pytest.param("line\nbreak\ttab", id="control"),
    ],
)
def test_inputs_valid(inputs: str) -> None:
    job = parse(make_body(inputs=inputs))
    assert job.inputs == inputs
    assert job.input_ids is None


@pytest.mark.parametrize(
    "input_ids",
    [
        pytest.param([0], id="zero"),
        pytest.param([97, 98, 99], id="several"),
        pytest.param([2**31], id="large"),
    ],
)
def test_input_ids_valid(input_ids: list[int]) -> None:
    job = parse(make_body(inputs=DROP, input_ids=input_ids))
    assert job.input_ids == input_ids
    assert job.inputs is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        pytest.param({"inputs": ""}, "inputs", id="inputs-empty"),
        pytest.param({"inputs": 5}, "inputs", id="inputs-int"),
        pytest.param({"inputs": ["a"]}, "inputs", id="inputs-list"),
        pytest.param({"inputs": {"text": "a"}}, "inputs", id="inputs-object"),
        pytest.param({"inputs": DROP, "input_ids": []}, "input_ids", id="ids-empty"),
        pytest.param({"inputs": DROP, "input_ids": [-1]}, "input_ids", id="ids-negative"),
        pytest.param({"inputs": DROP, "input_ids": [1, -5]}, "input_ids", id="ids-one-negative"),
        pytest.param({"inputs": DROP, "input_ids": [1.0]}, "input_ids", id="ids-float"),
        pytest.param({"inputs": DROP, "input_ids": ["1"]}, "input_ids", id="ids-string"),
        pytest.param({"inputs": DROP, "input_ids": [True]}, "input_ids", id="ids-bool"),
        pytest.param({"inputs": DROP, "input_ids": [None]}, "input_ids", id="ids-null"),
        pytest.param({"inputs": DROP, "input_ids": "1,2"}, "input_ids", id="ids-string-list"),
        pytest.param({"inputs": DROP, "input_ids": 1}, "input_ids", id="ids-scalar"),
    ],
)
def test_prompt_invalid(fields: dict[str, object], named: str) -> None:
    error = rejected(make_body(**fields))
    assert named in error.message
    assert error.request_id == REQUEST_ID


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"input_ids": [1, 2]}, id="both"),
        pytest.param({"inputs": DROP}, id="neither"),
    ],
)
def test_exactly_one_prompt(fields: dict[str, object]) -> None:
    error = rejected(make_body(**fields))
    assert "inputs" in error.message
    assert "input_ids" in error.message
    assert error.request_id == REQUEST_ID


# --- chat ----------------------------------------------------------------------------------

USER = {"role": "user", "content": "Hi"}


def chat_body(**fields: object) -> bytes:
    return make_body(inputs=DROP, **fields)


def test_messages_valid() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "f"},
    ]
    tools = [{"type": "function", "function": {"name": "f"}}]
    job = parse(chat_body(messages=messages, tools=tools, chat_template_kwargs={"x": True}))
    assert job.messages is not None
    assert [m.role for m in job.messages] == ["system", "user", "assistant", "tool"]
    assert job.tools == tools
    assert job.chat_template_kwargs == {"x": True}


def test_256_messages_are_accepted() -> None:
    assert len(parse(chat_body(messages=[USER] * 256)).messages or []) == 256


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        pytest.param({"messages": []}, "messages", id="empty-list"),
        pytest.param({"messages": [USER] * 257}, "messages", id="257-messages"),
        pytest.param({"messages": "Hi"}, "messages", id="not-a-list"),
        pytest.param({"messages": ["Hi"]}, "messages.0", id="message-not-object"),
        pytest.param({"messages": [{"role": "user"}]}, "messages.0.content", id="no-content"),
        pytest.param({"messages": [{"content": "x"}]}, "messages.0.role", id="no-role"),
        pytest.param(
            {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", id="content-int"
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content",
            id="content-list",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "x", "mood": "happy"}]},
            "messages.0.mood",
            id="unknown-key",
        ),
        pytest.param(
            {"messages": [{"role": "", "content": "x"}]}, "messages.0.role", id="role-empty"
        ),
        pytest.param({"messages": [USER], "tools": {"name": "f"}}, "tools", id="tools-object"),
        pytest.param({"messages": [USER], "tools": ["f"]}, "tools.0", id="tools-of-strings"),
        pytest.param(
            {"messages": [USER], "chat_template_kwargs": [1]},
            "chat_template_kwargs",
            id="kwargs-list",
        ),
    ],
)
def test_messages_invalid(fields: dict[str, object], named: str) -> None:
    error = rejected(chat_body(**fields))
    assert named in error.message
    assert error.request_id == REQUEST_ID


@pytest.mark.parametrize("name", ["tools", "chat_template_kwargs"])
def test_chat_fields_only_with_messages(name: str) -> None:
    value: object = [{"type": "function"}] if name == "tools" else {"x": 1}
    error = rejected(make_body(**{name: value}))
    assert f"{name}: only with messages" in error.message


def test_messages_are_one_of_the_prompts() -> None:
    error = rejected(make_body(messages=[USER]))
    assert "exactly one of them" in error.message


# --- parameters -----------------------------------------------------------------------------


def test_parameters_defaults() -> None:
    job = parse(make_body())
    params = job.parameters
    assert params.ignore_eos is False
    assert params.return_logprobs is False
    assert params.add_special_tokens is True
    for name in (
        "max_new_tokens",
        "min_new_tokens",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "seed",
        "stop",
        "truncate",
        "top_logprobs",
    ):
        assert getattr(params, name) is None, name
    assert job.max_new_tokens(LIMITS) == LIMITS.default_max_new_tokens
    assert job.deadline is None
    assert job.metadata is None


def test_empty_parameters_object() -> None:
    assert parse(with_parameters()).parameters == parse(make_body()).parameters


VALID_PARAMETERS: list[Any] = [
    pytest.param("max_new_tokens", 1, id="max_new_tokens-1"),
    pytest.param("max_new_tokens", 100, id="max_new_tokens-100"),
    pytest.param("max_new_tokens", LIMITS.max_new_tokens, id="max_new_tokens-limit"),
    pytest.param("min_new_tokens", 0, id="min_new_tokens-0"),
    pytest.param("min_new_tokens", 10, id="min_new_tokens-10"),
    pytest.param("do_sample", True, id="do_sample-true"),
    pytest.param("do_sample", False, id="do_sample-false"),
    pytest.param("temperature", 0.7, id="temperature-0.7"),
    pytest.param("temperature", 1e-6, id="temperature-tiny"),
    pytest.param("temperature", 1, id="temperature-int"),
    pytest.param("temperature", 5.5, id="temperature-5.5"),
    pytest.param("top_k", 1, id="top_k-1"),
    pytest.param("top_k", 50, id="top_k-50"),
    pytest.param("top_p", 1, id="top_p-int-1"),
    pytest.param("top_p", 1.0, id="top_p-1.0"),
    pytest.param("top_p", 0.9, id="top_p-0.9"),
    pytest.param("top_p", 1e-9, id="top_p-tiny"),
    pytest.param("repetition_penalty", 1.1, id="repetition_penalty-1.1"),
    pytest.param("repetition_penalty", 0.5, id="repetition_penalty-0.5"),
    pytest.param("repetition_penalty", 1, id="repetition_penalty-int"),
    pytest.param("frequency_penalty", -2, id="frequency_penalty--2"),
    pytest.param("frequency_penalty", 2, id="frequency_penalty-2"),
    pytest.param("frequency_penalty", -2.0, id="frequency_penalty--2.0"),
    pytest.param("frequency_penalty", 0.5, id="frequency_penalty-0.5"),
    pytest.param("presence_penalty", -2, id="presence_penalty--2"),
    pytest.param("presence_penalty", 2.0, id="presence_penalty-2.0"),
    pytest.param("presence_penalty", 0, id="presence_penalty-0"),
    pytest.param("seed", 0, id="seed-0"),
    pytest.param("seed", 42, id="seed-42"),
    pytest.param("seed", 2**63, id="seed-2^63"),
    pytest.param("seed", 2**64 - 1, id="seed-2^64-1"),
    pytest.param("stop", [], id="stop-empty-list"),
    pytest.param("stop", ["\n"], id="stop-newline"),
    pytest.param("stop", [f"s{i}" for i in range(8)], id="stop-8"),
    pytest.param("stop", ["x" * 256], id="stop-256-chars"),
    pytest.param("stop", ["é" * 256], id="stop-256-two-byte-chars"),
    pytest.param("stop", ["😀" * 256], id="stop-256-emoji"),
    pytest.param("ignore_eos", True, id="ignore_eos-true"),
    pytest.param("ignore_eos", False, id="ignore_eos-false"),
    pytest.param("truncate", 1, id="truncate-1"),
    pytest.param("truncate", 100_000, id="truncate-large"),
    pytest.param("return_logprobs", True, id="return_logprobs-true"),
    pytest.param("return_logprobs", False, id="return_logprobs-false"),
    pytest.param("add_special_tokens", False, id="add_special_tokens-false"),
    pytest.param("add_special_tokens", True, id="add_special_tokens-true"),
]


@pytest.mark.parametrize(("field", "value"), VALID_PARAMETERS)
def test_parameter_valid(field: str, value: object) -> None:
    job = parse(with_parameters(**{field: value}))
    parsed = getattr(job.parameters, field)
    assert parsed == value
    assert type(parsed) is type(value) or (isinstance(value, int) and isinstance(parsed, float))


INVALID_PARAMETERS: list[Any] = [
    # ranges
    pytest.param("max_new_tokens", 0, id="max_new_tokens-0"),
    pytest.param("max_new_tokens", -1, id="max_new_tokens--1"),
    pytest.param("max_new_tokens", LIMITS.max_new_tokens + 1, id="max_new_tokens-above-limit"),
    pytest.param("min_new_tokens", -1, id="min_new_tokens--1"),
    pytest.param("temperature", 0, id="temperature-0"),
    pytest.param("temperature", 0.0, id="temperature-0.0"),
    pytest.param("temperature", -0.5, id="temperature-negative"),
    pytest.param("top_k", 0, id="top_k-0"),
    pytest.param("top_k", -1, id="top_k--1"),
    pytest.param("top_p", 0, id="top_p-0"),
    pytest.param("top_p", -0.1, id="top_p-negative"),
    pytest.param("top_p", 1.0000001, id="top_p-1.0000001"),
    pytest.param("top_p", 2, id="top_p-2"),
    pytest.param("repetition_penalty", 0, id="repetition_penalty-0"),
    pytest.param("repetition_penalty", -1.0, id="repetition_penalty-negative"),
    pytest.param("frequency_penalty", 2.01, id="frequency_penalty-2.01"),
    pytest.param("frequency_penalty", -2.01, id="frequency_penalty--2.01"),
    pytest.param("presence_penalty", 2.01, id="presence_penalty-2.01"),
    pytest.param("presence_penalty", -3, id="presence_penalty--3"),
    pytest.param("seed", 2**64, id="seed-2^64"),
    pytest.param("seed", 2**80, id="seed-2^80"),
    pytest.param("seed", -1, id="seed--1"),
    pytest.param("stop", [f"s{i}" for i in range(9)], id="stop-9"),
    pytest.param("stop", [""], id="stop-empty-string"),
    pytest.param("stop", ["ok", ""], id="stop-one-empty-string"),
    pytest.param("stop", ["x" * 257], id="stop-257-chars"),
    pytest.param("stop", ["😀" * 257], id="stop-257-emoji"),
    pytest.param("truncate", 0, id="truncate-0"),
    pytest.param("truncate", -1, id="truncate--1"),
    # bool where int is expected
    pytest.param("max_new_tokens", True, id="max_new_tokens-bool"),
    pytest.param("min_new_tokens", False, id="min_new_tokens-bool"),
    pytest.param("top_k", True, id="top_k-bool"),
    pytest.param("seed", True, id="seed-bool"),
    pytest.param("truncate", True, id="truncate-bool"),
    # bool where float is expected
    pytest.param("temperature", True, id="temperature-bool"),
    pytest.param("top_p", True, id="top_p-bool"),
    pytest.param("frequency_penalty", False, id="frequency_penalty-bool"),
    # string numbers
    pytest.param("max_new_tokens", "5", id="max_new_tokens-string"),
    pytest.param("seed", "42", id="seed-string"),
    pytest.param("temperature", "0.7", id="temperature-string"),
    pytest.param("top_p", "0.5", id="top_p-string"),
    pytest.param("repetition_penalty", "1", id="repetition_penalty-string"),
    # float for int
    pytest.param("max_new_tokens", 5.0, id="max_new_tokens-float"),
    pytest.param("min_new_tokens", 1.5, id="min_new_tokens-float"),
    pytest.param("top_k", 40.0, id="top_k-float"),
    pytest.param("seed", 1.0, id="seed-float"),
    pytest.param("truncate", 10.0, id="truncate-float"),
    # other wrong types
    pytest.param("do_sample", 1, id="do_sample-int"),
    pytest.param("do_sample", "true", id="do_sample-string"),
    pytest.param("ignore_eos", 0, id="ignore_eos-int"),
    pytest.param("ignore_eos", None, id="ignore_eos-null"),
    pytest.param("return_logprobs", "yes", id="return_logprobs-string"),
    pytest.param("add_special_tokens", None, id="add_special_tokens-null"),
    pytest.param("stop", "</s>", id="stop-string"),
    pytest.param("stop", [1], id="stop-int-item"),
    pytest.param("stop", [None], id="stop-null-item"),
    pytest.param("stop", {"a": "b"}, id="stop-object"),
    pytest.param("temperature", [1.0], id="temperature-list"),
    pytest.param("top_k", {"k": 1}, id="top_k-object"),
    pytest.param("skip_special_tokens", "no", id="skip_special_tokens-string"),
    pytest.param("stop_token_ids", [-1], id="stop_token_ids-negative"),
    pytest.param("stop_token_ids", list(range(17)), id="stop_token_ids-17"),
    pytest.param("stop_token_ids", 2, id="stop_token_ids-scalar"),
    pytest.param("stop_token_ids", ["2"], id="stop_token_ids-string"),
    pytest.param("grammar", {"type": "ebnf", "value": "x"}, id="grammar-unknown-type"),
    pytest.param("grammar", {"type": "json", "value": "{}"}, id="grammar-json-not-object"),
    pytest.param("grammar", {"type": "regex", "value": ""}, id="grammar-regex-empty"),
    pytest.param("grammar", {"type": "regex"}, id="grammar-no-value"),
    pytest.param("grammar", {"value": "a+"}, id="grammar-no-type"),
    pytest.param("grammar", "a+", id="grammar-string"),
    pytest.param(
        "grammar", {"type": "regex", "value": "a", "strict": True}, id="grammar-unknown-key"
    ),
]


@pytest.mark.parametrize(("field", "value"), INVALID_PARAMETERS)
def test_parameter_invalid(field: str, value: object) -> None:
    error = rejected(with_parameters(**{field: value}))
    assert f"parameters.{field}" in error.message
    assert error.request_id == REQUEST_ID


@pytest.mark.parametrize(
    "literal",
    [
        pytest.param(b"1e999", id="overflow-to-inf"),
        pytest.param(b"-1e999", id="overflow-to-minus-inf"),
    ],
)
@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p"])
def test_parameter_overflowing_float(field: str, literal: bytes) -> None:
    body = make_body(parameters={field: "PLACEHOLDER"}).replace(b'"PLACEHOLDER"', literal)
    error = rejected(body)
    assert f"parameters.{field}" in error.message
    assert error.request_id == REQUEST_ID


def test_parameters_not_an_object() -> None:
    error = rejected(make_body(parameters=[1, 2]))
    assert "parameters" in error.message
    assert error.request_id == REQUEST_ID


@pytest.mark.parametrize("count", [1, 7, 20])
def test_top_logprobs_with_return_logprobs(count: int) -> None:
    job = parse(with_parameters(return_logprobs=True, top_logprobs=count))
    assert job.parameters.top_logprobs == count


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(0, id="0"),
        pytest.param(21, id="21"),
        pytest.param(-1, id="negative"),
        pytest.param(True, id="bool"),
        pytest.param(3.0, id="float"),
        pytest.param("3", id="string"),
    ],
)
def test_top_logprobs_invalid(value: object) -> None:
    error = rejected(with_parameters(return_logprobs=True, top_logprobs=value))
    assert "parameters.top_logprobs" in error.message
    assert error.request_id == REQUEST_ID


@pytest.mark.parametrize("return_logprobs", [DROP, False])
def test_top_logprobs_needs_return_logprobs(return_logprobs: object) -> None:
    """Refused rather than implied, as in OpenAI's API, naming both fields."""
    parameters: dict[str, object] = {"top_logprobs": 3, "return_logprobs": return_logprobs}
    error = rejected(with_parameters(**{k: v for k, v in parameters.items() if v is not DROP}))
    assert "parameters.top_logprobs" in error.message
    assert "return_logprobs" in error.message
    assert error.request_id == REQUEST_ID


def test_max_new_tokens_bounded_by_limits() -> None:
    limits = JobLimits(max_new_tokens=100, default_max_new_tokens=10)
    job = parse(with_parameters(max_new_tokens=100), limits=limits)
    assert job.max_new_tokens(limits) == 100
    error = rejected(with_parameters(max_new_tokens=101), limits=limits)
    assert "parameters.max_new_tokens" in error.message
    assert str(limits.max_new_tokens) in error.message
    assert error.request_id == REQUEST_ID


@pytest.mark.parametrize(
    ("min_new", "max_new", "ok"),
    [
        pytest.param(0, 1, True, id="0-of-1"),
        pytest.param(5, 5, True, id="equal"),
        pytest.param(6, 5, False, id="above"),
        pytest.param(LIMITS.max_new_tokens, LIMITS.max_new_tokens, True, id="equal-at-limit"),
    ],
)
def test_min_new_tokens_against_max_new_tokens(min_new: int, max_new: int, ok: bool) -> None:
    body = with_parameters(min_new_tokens=min_new, max_new_tokens=max_new)
    if ok:
        assert parse(body).parameters.min_new_tokens == min_new
    else:
        error = rejected(body)
        assert "parameters.min_new_tokens" in error.message
        assert error.request_id == REQUEST_ID


@pytest.mark.parametrize(
    ("offset", "ok"),
    [
        pytest.param(-1, True, id="below-default"),
        pytest.param(0, True, id="equal-default"),
        pytest.param(1, False, id="above-default"),
    ],
)
def test_min_new_tokens_against_default_max_new_tokens(offset: int, ok: bool) -> None:
    """Without max_new_tokens the job generates at most the default, so min_new_tokens
    may not exceed it (even when it is within WORKER_MAX_NEW_TOKENS)."""
    limits = JobLimits(max_new_tokens=100, default_max_new_tokens=10)
    min_new = limits.default_max_new_tokens + offset
    assert min_new <= limits.max_new_tokens
    body = with_parameters(min_new_tokens=min_new)
    if ok:
        job = parse(body, limits=limits)
        assert job.parameters.min_new_tokens == min_new
        assert job.max_new_tokens(limits) == limits.default_max_new_tokens
    else:
        error = rejected(body, limits=limits)
        assert "parameters.min_new_tokens" in error.message
        assert error.request_id == REQUEST_ID


def test_all_parameters_together() -> None:
    parameters: dict[str, object] = {
        "max_new_tokens": 64,
        "min_new_tokens": 4,
        "do_sample": True,
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "seed": 7,
        "stop": ["\n\n", "</s>"],
        "ignore_eos": True,
        "truncate": 100,
        "return_logprobs": True,
        "add_special_tokens": False,
        "skip_special_tokens": False,
        "stop_token_ids": [2, 7],
        "grammar": {"type": "regex", "value": "[a-z]+"},
        "top_logprobs": 5,
    }
    job = parse(make_body(parameters=parameters))
    assert job.parameters.model_dump() == parameters
    assert job.max_new_tokens(LIMITS) == parameters["max_new_tokens"]


# --- unknown fields -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        pytest.param({"prompt": "x"}, "prompt", id="top-level"),
        pytest.param({"Inputs": "x"}, "Inputs", id="top-level-case"),
        pytest.param({"max_new_tokens": 5}, "max_new_tokens", id="parameter-at-top-level"),
        pytest.param({"parameters": {"max_tokens": 5}}, "parameters.max_tokens", id="parameters"),
        pytest.param({"parameters": {"Top_p": 0.5}}, "parameters.Top_p", id="parameters-case"),
        pytest.param(
            {"parameters": {"temperature ": 0.5}}, "parameters.temperature ", id="trailing-space"
        ),
    ],
)
def test_unknown_field(fields: dict[str, object], named: str) -> None:
    error = rejected(make_body(**fields))
    assert named in error.message
    assert "unknown field" in error.message
    assert error.request_id == REQUEST_ID


# --- deadline -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("deadline", "expected"),
    [
        pytest.param(
            "2030-01-02T03:04:05Z",
            datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),
            id="zulu",
        ),
        pytest.param(
            "2030-01-02T03:04:05+02:00",
            datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2))),
            id="plus-offset",
        ),
        pytest.param(
            "2030-01-02T03:04:05-05:30",
            datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone(-timedelta(hours=5, minutes=30))),
            id="minus-offset",
        ),
        pytest.param(
            "2030-01-02T03:04:05+00:00",
            datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),
            id="zero-offset",
        ),
        pytest.param(
            "2030-01-02T03:04:05.250Z",
            datetime(2030, 1, 2, 3, 4, 5, 250_000, tzinfo=UTC),
            id="fraction",
        ),
        pytest.param(
            "2030-01-02t03:04:05z",
            datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),
            id="lowercase-t-z",  # RFC 3339 §5.6 allows lower case "t" and "z"
        ),
    ],
)
def test_deadline_valid(deadline: str, expected: datetime) -> None:
    job = parse(make_body(deadline=deadline))
    assert job.deadline == expected
    assert job.deadline is not None
    assert job.deadline.utcoffset() == expected.utcoffset()


@pytest.mark.parametrize(
    "deadline",
    [
        pytest.param("2030-01-02T03:04:05", id="no-offset"),
        pytest.param("2030-01-02", id="date-only"),
        pytest.param("03:04:05Z", id="time-only"),
        pytest.param("tomorrow", id="words"),
        pytest.param("", id="empty"),
        pytest.param("2030-13-01T00:00:00Z", id="month-13"),
        pytest.param(1893553445, id="epoch-int"),
        pytest.param(1893553445.5, id="epoch-float"),
        pytest.param(True, id="bool"),
        pytest.param(["2030-01-02T03:04:05Z"], id="list"),
        pytest.param({"at": "2030-01-02T03:04:05Z"}, id="object"),
    ],
)
def test_deadline_invalid(deadline: object) -> None:
    error = rejected(make_body(deadline=deadline))
    assert "deadline" in error.message
    assert error.request_id == REQUEST_ID


@pytest.mark.parametrize(
    "deadline",
    [
        pytest.param("20300102T030405Z", id="iso-basic-format"),
        pytest.param("2030-01-02T03:04Z", id="no-seconds"),
        pytest.param("2030-01-02T03Z", id="hour-only"),
        pytest.param("2030-01-02T03:04:05+02", id="offset-hours-only"),
        pytest.param("2030-W01-3T03:04:05Z", id="iso-week-date"),
        pytest.param("2030-01-02T03:04:05 +02:00", id="space-before-offset"),
    ],
)
def test_deadline_not_rfc3339(deadline: str) -> None:
    """ISO 8601 forms that RFC 3339 does not allow."""
    error = rejected(make_body(deadline=deadline))
    assert "deadline" in error.message
    assert error.request_id == REQUEST_ID


def test_deadline_null_is_absent() -> None:
    assert parse(make_body(deadline=None)).deadline is None


# --- metadata -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param({}, id="empty"),
        pytest.param({"user": "u1", "n": 3, "tags": ["a", "b"], "x": None}, id="flat"),
        pytest.param({"a": {"b": {"c": [1, 2.5, True]}}}, id="nested"),
        pytest.param({"名前": "値 😀"}, id="unicode"),
        pytest.param(padded_metadata(MAX_METADATA_BYTES), id="exactly-4096-bytes"),
    ],
)
def test_metadata_valid(metadata: dict[str, object]) -> None:
    assert parse(make_body(metadata=metadata)).metadata == metadata


def test_metadata_size_counts_utf8_bytes() -> None:
    """Two-byte characters: 4096 bytes of compact JSON pass, one more character fails."""
    overhead = len(json.dumps({"k": ""}, separators=(",", ":")).encode())
    chars = (MAX_METADATA_BYTES - overhead) // 2
    fits = {"k": "é" * chars}
    too_big = {"k": "é" * (chars + 1)}
    assert len(json.dumps(fits, separators=(",", ":"), ensure_ascii=False).encode()) == (
        MAX_METADATA_BYTES
    )
    assert parse(make_body(metadata=fits)).metadata == fits
    error = rejected(make_body(metadata=too_big))
    assert "metadata" in error.message


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param(padded_metadata(MAX_METADATA_BYTES + 1), id="4097-bytes"),
        pytest.param(padded_metadata(64 * 1024), id="64-KiB"),
        pytest.param({f"k{i}": i for i in range(1000)}, id="many-keys"),
        pytest.param([1, 2], id="list"),
        pytest.param("meta", id="string"),
        pytest.param(5, id="int"),
        pytest.param(True, id="bool"),
    ],
)
def test_metadata_invalid(metadata: object) -> None:
    error = rejected(make_body(metadata=metadata))
    assert "metadata" in error.message
    assert error.request_id == REQUEST_ID


# --- the body as a whole --------------------------------------------------------------------


def test_body_of_exactly_one_mib_is_accepted() -> None:
    base = make_body(inputs="")
    body = make_body(inputs="x" * (MAX_BODY_BYTES - len(base)))
    assert len(body) == MAX_BODY_BYTES
    assert parse(body).inputs is not None


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(make_body(inputs="x" * MAX_BODY_BYTES), id="valid-json-over-limit"),
        pytest.param(b"[" * (MAX_BODY_BYTES + 1), id="nested-over-limit"),
        pytest.param(b"\xff" * (MAX_BODY_BYTES + 1), id="garbage-over-limit"),
    ],
)
@pytest.mark.parametrize("message_id", [None, "amqp-42"])
def test_body_over_one_mib_is_rejected_before_parsing(body: bytes, message_id: str | None) -> None:
    error = rejected(body, message_id=message_id)
    assert "body" in error.message
    assert str(MAX_BODY_BYTES) in error.message, "the message should state the limit"
    assert len(error.message) < 500, "the message must not echo the body"
    assert error.request_id == message_id


def test_body_one_byte_over_limit() -> None:
    base = make_body(inputs="")
    body = make_body(inputs="x" * (MAX_BODY_BYTES - len(base) + 1))
    assert len(body) == MAX_BODY_BYTES + 1
    error = rejected(body)
    assert "body" in error.message
    assert error.request_id is None


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"   ", id="blank"),
        pytest.param(b"{", id="truncated"),
        pytest.param(b'{"request_id": "req-1", "inputs": "x",}', id="trailing-comma"),
        pytest.param(b"{'request_id': 'req-1'}", id="single-quotes"),
        pytest.param(b'{"request_id": "req-1"} {}', id="two-values"),
        pytest.param(b'{"request_id": "req-1", "inputs": "x"} // c', id="comment"),
        pytest.param(b"\xef\xbb\xbf" + make_body(), id="utf8-bom"),
        pytest.param(make_body().decode().encode("utf-16"), id="utf-16"),
        pytest.param(b'{"request_id": "req-1", "inputs": "\xff"}', id="invalid-utf8"),
        pytest.param(b'{"request_id": "req-1", "inputs": "\xc0\xaf"}', id="overlong-utf8"),
        pytest.param(b'{"request_id": "req-1", "inputs": "\xe6\x97"}', id="truncated-utf8"),
        pytest.param(b'{"request_id": "req-1", "inputs": "\\ud800"}', id="lone-surrogate"),
        pytest.param(b'{"request_id": "req-1", "inputs": "\\udc00x"}', id="lone-low-surrogate"),
        pytest.param(
            b'{"request_id": "req-1", "inputs": "x", "parameters": {"temperature": NaN}}',
            id="nan",
        ),
        pytest.param(
            b'{"request_id": "req-1", "inputs": "x", "parameters": {"top_p": Infinity}}',
            id="infinity",
        ),
        pytest.param(
            b'{"request_id": "req-1", "inputs": "x", "metadata": {"v": -Infinity}}',
            id="minus-infinity-in-metadata",
        ),
        pytest.param(b"[" * 100_000, id="deeply-nested-array"),
        pytest.param(b'{"a":' * 100_000, id="deeply-nested-object"),
        pytest.param(
            b'{"request_id": "req-1", "inputs": "x", "metadata": {"v": '
            + b"[" * 100_000
            + b"]" * 100_000
            + b"}}",
            id="deeply-nested-metadata",
        ),
    ],
)
@pytest.mark.parametrize("message_id", [None, "amqp-42"])
def test_body_not_json(body: bytes, message_id: str | None) -> None:
    error = rejected(body, message_id=message_id)
    assert "body" in error.message
    assert "JSON" in error.message
    assert len(error.message) < 500
    assert error.request_id == message_id


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[]", id="array"),
        pytest.param(b'[{"request_id": "req-1", "inputs": "x"}]', id="array-of-job"),
        pytest.param(b'"req-1"', id="string"),
        pytest.param(b"42", id="number"),
        pytest.param(b"null", id="null"),
        pytest.param(b"true", id="bool"),
    ],
)
@pytest.mark.parametrize("message_id", [None, "amqp-42"])
def test_body_not_an_object(body: bytes, message_id: str | None) -> None:
    error = rejected(body, message_id=message_id)
    assert "object" in error.message
    assert error.request_id == message_id


def test_body_with_whitespace_around_is_accepted() -> None:
    assert parse(b"\n  " + make_body() + b"  \n").request_id == REQUEST_ID


# --- content type ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        pytest.param("application/json", id="json"),
        pytest.param(None, id="absent"),
        pytest.param("application/json; charset=utf-8", id="with-charset"),
        pytest.param("Application/JSON", id="upper-case"),
    ],
)
def test_content_type_accepted(content_type: str | None) -> None:
    assert parse(make_body(), content_type=content_type).request_id == REQUEST_ID


@pytest.mark.parametrize(
    "content_type",
    [
        pytest.param("text/plain", id="text-plain"),
        pytest.param("application/xml", id="xml"),
        pytest.param("application/jsonl", id="jsonl"),
        pytest.param("application/octet-stream", id="octet-stream"),
        pytest.param("text/json", id="text-json"),
    ],
)
@pytest.mark.parametrize("message_id", [None, "amqp-42"])
def test_content_type_rejected(content_type: str, message_id: str | None) -> None:
    error = rejected(make_body(), content_type=content_type, message_id=message_id)
    assert "content_type" in error.message
    assert content_type in error.message
    assert error.request_id == message_id


# --- errors in general ----------------------------------------------------------------------


def test_several_errors_name_each_field() -> None:
    error = rejected(with_parameters(top_p=0, top_k=0, temperature=0))
    for field in ("parameters.top_p", "parameters.top_k", "parameters.temperature"):
        assert field in error.message
    assert error.request_id == REQUEST_ID


def test_error_does_not_echo_a_large_value() -> None:
    error = rejected(make_body(inputs=["y" * 100_000]))
    assert "inputs" in error.message
    assert "y" * 100 not in error.message


# --- cancel messages ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(b'{"request_id": "req-1"}', "req-1", id="valid"),
        pytest.param(b'{"request_id": "' + b"a" * 128 + b'"}', "a" * 128, id="length-128"),
        pytest.param(b'{"request_id": "req-1", "reason": "user"}', "req-1", id="extra-field"),
        pytest.param(b'{"request_id": "' + b"a" * 129 + b'"}', None, id="length-129"),
        pytest.param(b'{"request_id": "a b"}', None, id="bad-id"),
        pytest.param(b'{"request_id": "abc\\n"}', None, id="trailing-newline"),
        pytest.param(b'{"request_id": 5}', None, id="int-id"),
        pytest.param(b'{"request_id": null}', None, id="null-id"),
        pytest.param(b"{}", None, id="no-id"),
        pytest.param(b'["req-1"]', None, id="array"),
        pytest.param(b'"req-1"', None, id="string"),
        pytest.param(b"", None, id="empty"),
        pytest.param(b"{", None, id="invalid-json"),
        pytest.param(b'{"request_id": "\xff"}', None, id="invalid-utf8"),
        pytest.param(b"[" * 100_000, None, id="deeply-nested"),
        pytest.param(
            b'{"request_id": "req-1", "pad": "' + b"x" * MAX_BODY_BYTES + b'"}',
            None,
            id="over-one-mib",
        ),
    ],
)
def test_parse_cancel(body: bytes, expected: str | None) -> None:
    assert parse_cancel(body) == expected
