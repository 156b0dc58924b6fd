"""The client's pure parts: typed events from stream entries, the job body and its local
validation (the worker's own messages)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from trtllm_worker.client import (
    DoneEvent,
    ErrorEvent,
    InvalidJobError,
    StreamFormatError,
    TokenEvent,
    job_body,
    parse_entry,
    validate_job,
)
from trtllm_worker.contract.job import JobLimits, Parameters


def test_token_entry() -> None:
    event = parse_entry(
        "0-3", {"event": "token", "index": "2", "token_id": "99", "text": "c", "logprob": "-1.5"}
    )
    assert event == TokenEvent(entry_id="0-3", index=2, token_id=99, text="c", logprob=-1.5)
    plain = parse_entry("0-1", {"event": "token", "index": "0", "token_id": "97", "text": ""})
    assert isinstance(plain, TokenEvent)
    assert (plain.text, plain.logprob, plain.top_logprobs) == ("", None, None)


def test_token_entry_parses_its_top_logprobs() -> None:
    fields = {
        "event": "token",
        "index": "0",
        "token_id": "99",
        "text": "c",
        "logprob": "-0.25",
        "top_logprobs": "[[99,-0.25],[4,-1.5],[7,-3.0]]",
    }
    event = parse_entry("0-1", fields)
    assert isinstance(event, TokenEvent)
    assert event.top_logprobs == [(99, -0.25), (4, -1.5), (7, -3.0)]
    assert all(isinstance(pair, tuple) for pair in event.top_logprobs)


def test_done_entry_parses_its_metadata() -> None:
    fields = {
        "event": "done",
        "finish_reason": "stop_sequence",
        "generated_tokens": "4",
        "input_tokens": "3",
        "generated_text": "abca",
        "metadata": '{"user":"u1","tags":["a"]}',
    }
    event = parse_entry("0-5", fields)
    assert isinstance(event, DoneEvent)
    assert event.metadata == {"user": "u1", "tags": ["a"]}
    assert event.generated_tokens == 4
    without = parse_entry("0-5", {k: v for k, v in fields.items() if k != "metadata"})
    assert isinstance(without, DoneEvent)
    assert without.metadata is None


def test_error_entry() -> None:
    event = parse_entry("0-1", {"event": "error", "code": "input_too_long", "message": "m"})
    assert event == ErrorEvent(entry_id="0-1", code="input_too_long", message="m")


def test_unknown_events_are_skipped_and_new_fields_ignored() -> None:
    assert parse_entry("0-2", {"event": "progress", "percent": "5"}) is None
    assert parse_entry("0-2", {"no_event": "x"}) is None
    event = parse_entry("0-1", {"event": "error", "code": "c", "message": "m", "new": "x"})
    assert isinstance(event, ErrorEvent)


@pytest.mark.parametrize(
    ("fields", "mentions"),
    [
        ({"event": "token", "index": "x", "token_id": "1", "text": ""}, "index"),
        ({"event": "token", "index": "0", "text": ""}, "token_id"),
        ({"event": "done", "finish_reason": "length"}, "generated_tokens"),
        (
            {"event": "token", "index": "0", "token_id": "1", "text": "", "top_logprobs": "[[1"},
            "top_logprobs",
        ),
        (
            {"event": "token", "index": "0", "token_id": "1", "text": "", "top_logprobs": "[1]"},
            "top_logprobs",
        ),
        (
            {
                "event": "done",
                "finish_reason": "length",
                "generated_tokens": "1",
                "input_tokens": "1",
                "generated_text": "",
                "metadata": "{not json",
            },
            "metadata",
        ),
    ],
)
def test_malformed_entries_raise(fields: dict[str, str], mentions: str) -> None:
    with pytest.raises(StreamFormatError) as info:
        parse_entry("0-7", fields)
    assert str(info.value).startswith("entry 0-7: ")
    assert mentions in str(info.value)


def test_job_body() -> None:
    deadline = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    body = job_body(
        "hi",
        {"max_new_tokens": 3},
        request_id="r1",
        deadline=deadline,
        metadata={"a": 1},
    )
    assert body == {
        "request_id": "r1",
        "inputs": "hi",
        "parameters": {"max_new_tokens": 3},
        "deadline": "2030-01-02T03:04:05+00:00",
        "metadata": {"a": 1},
    }
    assert job_body([1, 2], Parameters(top_k=5), request_id="r2") == {
        "request_id": "r2",
        "input_ids": [1, 2],
        "parameters": {"top_k": 5},
    }
    assert job_body(input_ids=[7])["input_ids"] == [7]
    assert len(job_body("x")["request_id"]) == 32


def test_validation_gives_the_workers_message() -> None:
    assert validate_job(job_body("hi", request_id="r1")).startswith(b'{"request_id": "r1"')
    with pytest.raises(InvalidJobError) as info:
        validate_job(job_body("hi", {"temperature": 0}, request_id="r1"))
    assert str(info.value) == "invalid job: parameters.temperature: Input should be greater than 0"
    assert info.value.code == "invalid_request"
    limits = JobLimits(max_new_tokens=10, default_max_new_tokens=5)
    with pytest.raises(InvalidJobError, match="at most 10"):
        validate_job(job_body("hi", {"max_new_tokens": 11}), limits)
    validate_job(job_body("hi", {"max_new_tokens": 11}))  # no limits known: schema only
    with pytest.raises(InvalidJobError, match="JSON"):
        validate_job(job_body("hi", {"temperature": float("nan")}))
    with pytest.raises(InvalidJobError, match="JSON"):
        validate_job(job_body("\ud800"))
