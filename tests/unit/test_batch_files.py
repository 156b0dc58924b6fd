"""OpenAI Batch files without the services: what `submit` refuses before publishing,
how a line becomes a job or an error line, and the output lines and Batch objects,
checked against the `openai` package's own models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types import Batch
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from trtllm_worker.client.batch_files import (
    InvalidBatch,
    LineError,
    LineJob,
    dumps,
    read_line,
    result_line,
    scan_file,
)
from trtllm_worker.client.batches import Counts, batch_object, window_seconds
from trtllm_worker.contract.batches import BatchStatus, valid_batch_id
from trtllm_worker.contract.job import JobLimits

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LIMITS = JobLimits(max_new_tokens=64, default_max_new_tokens=16)


def line(custom_id: str = "a", url: str = CHAT, **body: Any) -> bytes:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    if url == COMPLETIONS:
        payload = {"model": "m", "prompt": "hi", **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": payload}).encode()  # fmt: skip


def write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(raw + b"\n" for raw in lines))
    return path


def test_the_scan_counts_lines_finds_the_first_valid_endpoint_and_skips_blank_lines(
    tmp_path: Path,
) -> None:
    source = write(tmp_path / "in.jsonl", [b"not json", b"  ", line("a", COMPLETIONS), line("b")])
    scan = scan_file(source, max_lines=10, max_bytes=10_000, limits=LIMITS)
    assert (scan.lines, scan.endpoint) == (3, COMPLETIONS)
    again = scan_file(source, max_lines=10, max_bytes=10_000, limits=LIMITS)
    assert again.sha256 == scan.sha256


@pytest.mark.parametrize(
    ("max_lines", "max_bytes", "says"),
    [(2, 10_000, "more than 2 lines"), (10, 50, "over the limit of 50")],
)
def test_a_file_over_the_limits_is_refused_in_one_line(
    tmp_path: Path, max_lines: int, max_bytes: int, says: str
) -> None:
    source = write(tmp_path / "in.jsonl", [line("a"), line("b"), line("c")])
    with pytest.raises(InvalidBatch, match=says) as caught:
        scan_file(source, max_lines=max_lines, max_bytes=max_bytes, limits=LIMITS)
    assert "\n" not in str(caught.value)


def test_a_valid_line_becomes_its_job_with_the_batch_request_id() -> None:
    got = read_line("batch-1", 7, line("q", max_tokens=5, temperature=0), CHAT, LIMITS,
                    {"tenant": "acme"})  # fmt: skip
    assert isinstance(got, LineJob)
    job = json.loads(got.body)
    assert (got.custom_id, job["request_id"], job["tenant"]) == ("q", "batch-1:7", "acme")
    assert job["parameters"] == {"max_new_tokens": 5, "do_sample": False}


@pytest.mark.parametrize(
    ("raw", "custom_id", "says"),
    [
        (b"{", None, "not valid JSON"),
        (b"[1]", None, "not a JSON object"),
        (line("a", n=2), "a", "body.n"),
        (line("a", url=COMPLETIONS), "a", "url"),
        (line("a", max_tokens=1000), "a", "max_new_tokens"),
        (json.dumps({"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}).encode(), "a",
         "method"),
        (json.dumps({"method": "POST", "url": CHAT, "body": {}}).encode(), None, "custom_id"),
    ],
)  # fmt: skip
def test_a_line_that_cannot_run_is_an_error_naming_the_field(
    raw: bytes, custom_id: str | None, says: str
) -> None:
    got = read_line("b", 0, raw, CHAT, LIMITS)
    assert isinstance(got, LineError)
    assert (got.custom_id, got.code) == (custom_id, "invalid_request")
    assert says in got.message


def record(ok: bool, **entry: Any) -> dict[str, Any]:
    return {"state": "ended", "ok": ok, "t": 1_700_000_000_123, "model": "echo",
            "custom_id": "c", "entry": entry}  # fmt: skip


DONE = {"event": "done", "finish_reason": "eos_token", "generated_tokens": 3,
        "input_tokens": 4, "generated_text": "abc"}  # fmt: skip


def test_a_chat_line_is_a_chat_completion_the_openai_sdk_reads() -> None:
    rec = record(True, **DONE)
    rec["tokens"] = [[97, "a", "-0.5", "[[97,-0.5],[98,-1.25]]"], [98, "b", "-0.1", ""],
                     [99, "c", "-0.2", ""]]  # fmt: skip
    ok, out = result_line("batch-1", 2, CHAT, rec, token_text=chr)
    assert ok
    assert out["custom_id"] == "c"
    assert out["error"] is None
    assert out["response"]["request_id"] == "batch-1:2"
    completion = ChatCompletion.model_validate(out["response"]["body"])
    choice = completion.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("abc", "stop")
    assert completion.usage is not None
    assert completion.usage.total_tokens == 7
    assert completion.created == 1_700_000_000
    assert choice.logprobs is not None
    assert choice.logprobs.content is not None
    first = choice.logprobs.content[0]
    tops = [t.token for t in first.top_logprobs]
    assert (first.token, first.logprob, tops) == ("a", -0.5, ["a", "b"])


def test_a_completions_line_is_a_text_completion_the_openai_sdk_reads() -> None:
    rec = record(True, **{**DONE, "finish_reason": "length"})
    rec["tokens"] = [[97, "a", "-0.5", "[[97,-0.5]]"], [98, "bc", "-0.1", "[[98,-0.1]]"]]
    ok, out = result_line("b", 0, COMPLETIONS, rec)
    completion = Completion.model_validate(out["response"]["body"])
    choice = completion.choices[0]
    assert ok
    assert (choice.text, choice.finish_reason) == ("abc", "length")
    assert choice.logprobs is not None
    assert (choice.logprobs.tokens, choice.logprobs.text_offset) == (["a", "bc"], [0, 1])


@pytest.mark.parametrize(
    ("entry", "code"),
    [
        ({"event": "done", "finish_reason": "cancelled"}, "batch_cancelled"),
        ({"event": "done", "finish_reason": "deadline"}, "batch_expired"),
        ({"event": "error", "code": "deadline_exceeded", "message": "late"}, "batch_expired"),
        ({"event": "error", "code": "input_too_long", "message": "long"}, "input_too_long"),
    ],
)
def test_a_line_that_ended_without_an_answer_is_an_error_line(
    entry: dict[str, Any], code: str
) -> None:
    ok, out = result_line("b", 1, CHAT, record(False, **entry))
    assert not ok
    assert out["response"] is None
    assert out["error"]["code"] == code
    assert out["custom_id"] == "c"


def test_output_lines_are_the_same_bytes_every_time() -> None:
    rec = record(True, **DONE)
    assert dumps(result_line("b", 0, CHAT, rec)[1]) == dumps(result_line("b", 0, CHAT, rec)[1])
    assert dumps({"b": 1, "a": "é"}) == '{"a":"é","b":1}\n'.encode()


META = {"id": "batch-1", "endpoint": CHAT, "input_file_id": "file-batch-1",
        "completion_window": "24h", "created_at": "100", "expires_at": "86500", "total": "5",
        "ttl_s": "60"}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        ({}, "validating"),
        ({"in_progress_at": "101"}, "in_progress"),
        ({"in_progress_at": "101", "cancelling_at": "102"}, "cancelling"),
        ({"in_progress_at": "101", "finalizing_at": "103"}, "finalizing"),
        ({"in_progress_at": "101", "status": "completed", "completed_at": "104"}, "completed"),
        ({"failed_at": "101", "invalid": "5", "status": "failed"}, "failed"),
        ({"in_progress_at": "101", "status": "expired", "expired_at": "90000"}, "expired"),
        ({"in_progress_at": "101", "cancelling_at": "102", "status": "cancelled",
          "cancelled_at": "103"}, "cancelled"),
    ],
)  # fmt: skip
def test_every_status_is_a_batch_object_the_openai_sdk_reads(
    extra: dict[str, str], status: str
) -> None:
    batch = Batch.model_validate(batch_object({**META, **extra}, Counts(ok=2, err=1)))
    assert batch.status == status == BatchStatus(status)
    assert batch.request_counts is not None
    failed = 1 + int(extra.get("invalid", 0))
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (5, 2, failed)  # fmt: skip
    assert (batch.errors is not None) == (status == "failed")


def test_completion_windows_and_batch_ids() -> None:
    assert [window_seconds(w) for w in ("24h", "90m", "2d", "30s")] == [86400, 5400, 172800, 30]
    for bad in ("24", "0h", "1w", "h"):
        with pytest.raises(InvalidBatch, match="completion window"):
            window_seconds(bad)
    assert valid_batch_id("batch-abc.1") == "batch-abc.1"
    assert valid_batch_id("batch_abc") is None  # `_` and `:` would make request ids ambiguous
    assert valid_batch_id("a:b") is None
