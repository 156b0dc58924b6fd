"""OpenAI Batch files without I/O to the services: reading an input file (its limits,
its endpoint, each line as a job or as the error that keeps it from running) and
writing the output and error lines from the records the worker left.

Output lines are built from the stored record alone, with sorted keys and no spaces, so
`results` writes the same bytes every time it is asked."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from trtllm_worker.client.completions import (
    Logprob,
    TokenText,
    answer_body,
    completion_id,
)
from trtllm_worker.client.errors import ClientError, InvalidJobError
from trtllm_worker.client.jobs import validate_job
from trtllm_worker.contract.batches import BATCH_CANCELLED, BATCH_EXPIRED, line_request_id
from trtllm_worker.contract.errors import DEADLINE_EXCEEDED, INVALID_REQUEST
from trtllm_worker.contract.job import JobLimits
from trtllm_worker.contract.openai import (
    ENDPOINTS,
    UnsupportedRequest,
    job_fields,
)

DEFAULT_MAX_LINES: Final = 1_000_000
"""Lines a batch file may hold (OpenAI's own limit is 50,000)."""
DEFAULT_MAX_BYTES: Final = 1 << 30
"""Bytes a batch file may hold (OpenAI's own limit is 200 MB)."""
MAX_CUSTOM_ID_CHARS: Final = 512

ENDED_MESSAGES: Final = {
    BATCH_CANCELLED: "the batch was cancelled before this line ended",
    BATCH_EXPIRED: "the batch's completion window ended before this line ended",
}


class InvalidBatch(ClientError, ValueError):
    """The batch cannot be submitted as asked (a file over the limits or without lines,
    a malformed id, priority or completion window): nothing was published."""


@dataclass(frozen=True, slots=True)
class FileScan:
    """What one pass over a batch file found."""

    lines: int
    """Its lines, blank ones not counted (a line's index counts only the others)."""
    size: int
    sha256: str
    endpoint: str | None
    """The first valid line's `url` (None: no line has a supported one)."""


@dataclass(frozen=True, slots=True)
class LineJob:
    """A valid line: its job message, encoded and checked as the worker will check it."""

    custom_id: str
    body: bytes
    logprobs: bool = False
    """Whether the job asks for logprobs: its record then keeps its tokens'."""


@dataclass(frozen=True, slots=True)
class LineError:
    """A line that will not run: it goes to the errors file as it is."""

    custom_id: str | None
    code: str
    message: str


def lines_of(path: Path) -> Iterator[bytes]:
    """The file's non-blank lines, read as a stream (never the whole file at once)."""
    with path.open("rb") as file:
        for raw in file:
            if raw.strip():
                yield raw


def scan_file(path: Path, *, max_lines: int, max_bytes: int, limits: JobLimits | None) -> FileScan:
    """Count, hash and check the file against the limits before anything is published;
    `InvalidBatch` in one line when it is over them."""
    size = path.stat().st_size
    if size > max_bytes:
        raise InvalidBatch(f"{path}: {size} bytes, over the limit of {max_bytes}")
    digest = hashlib.sha256()
    count = 0
    endpoint: str | None = None
    for raw in lines_of(path):
        count += 1
        if count > max_lines:
            raise InvalidBatch(f"{path}: more than {max_lines} lines, over the limit")
        digest.update(raw.rstrip(b"\r\n") + b"\n")
        if endpoint is None:
            endpoint = _endpoint_of(raw, limits)
    return FileScan(count, size, digest.hexdigest(), endpoint)


def _endpoint_of(raw: bytes, limits: JobLimits | None) -> str | None:
    """The line's `url` if the line is valid (so the first valid line names the batch's
    endpoint)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    url = data.get("url") if isinstance(data, dict) else None
    if url not in ENDPOINTS:
        return None
    checked = read_line("probe", 0, raw, str(url), limits)
    return str(url) if isinstance(checked, LineJob) else None


def read_line(
    batch_id: str,
    line: int,
    raw: bytes,
    endpoint: str,
    limits: JobLimits | None,
    job_extra: Mapping[str, Any] | None = None,
) -> LineJob | LineError:
    """One input line as its job (request id `<batch id>:<line>`, with `job_extra`:
    deadline, tenant), or the error that keeps it from running, naming the field."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        return LineError(None, INVALID_REQUEST, f"line {line + 1} is not valid JSON: {exc}")
    if not isinstance(data, dict):
        return LineError(None, INVALID_REQUEST, f"line {line + 1} is not a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(None, INVALID_REQUEST, "custom_id: required, a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineError(
            custom_id[:MAX_CUSTOM_ID_CHARS],
            INVALID_REQUEST,
            f"custom_id: at most {MAX_CUSTOM_ID_CHARS} characters",
        )
    for name in data:
        if name not in ("custom_id", "method", "url", "body"):
            return LineError(custom_id, INVALID_REQUEST, f"{name}: not a field of a batch line")
    if data.get("method") != "POST":
        return LineError(custom_id, INVALID_REQUEST, 'method: must be "POST"')
    if data.get("url") != endpoint:
        return LineError(
            custom_id,
            INVALID_REQUEST,
            f"url: {data.get('url')!r}; every line of this batch goes to {endpoint} "
            "(the first valid line's url)",
        )
    body = data.get("body")
    if not isinstance(body, dict):
        return LineError(custom_id, INVALID_REQUEST, "body: required, an object")
    try:
        fields = job_fields(endpoint, body)
    except UnsupportedRequest as exc:
        return LineError(custom_id, INVALID_REQUEST, f"body.{exc}")
    job = {"request_id": line_request_id(batch_id, line), **fields, **(job_extra or {})}
    try:
        encoded = validate_job(job, limits)
    except InvalidJobError as exc:
        return LineError(custom_id, exc.code, exc.message)
    return LineJob(custom_id, encoded, bool(fields["parameters"].get("return_logprobs")))


# -- output -------------------------------------------------------------------------------


def dumps(value: Any) -> bytes:
    """One output line: compact JSON with sorted keys, UTF-8, newline-terminated."""
    return (
        json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True) + "\n"
    ).encode()


def line_id(batch_id: str, line: int) -> str:
    return f"batch_req_{batch_id}-{line}"


def error_line(batch_id: str, line: int, custom_id: str | None, code: str, message: str) -> Any:
    return {
        "id": line_id(batch_id, line),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def ended_error(entry: Mapping[str, Any]) -> tuple[str, str]:
    """The error code and message of a line that ended without an answer."""
    if entry.get("event") == "done":
        code = BATCH_CANCELLED if entry.get("finish_reason") == "cancelled" else BATCH_EXPIRED
        return code, ENDED_MESSAGES[code]
    code = str(entry.get("code", "internal_error"))
    if code == DEADLINE_EXCEEDED:
        return BATCH_EXPIRED, ENDED_MESSAGES[BATCH_EXPIRED]
    return code, str(entry.get("message", ""))


def result_line(
    batch_id: str,
    line: int,
    endpoint: str,
    record: Mapping[str, Any],
    token_text: TokenText | None = None,
) -> tuple[bool, Any]:
    """(whether it goes to the output file, the line) for a line's stored record."""
    entry = record.get("entry") or {}
    custom_id = record.get("custom_id")
    if not record.get("ok"):
        code, message = ended_error(entry)
        return False, error_line(batch_id, line, custom_id, code, message)
    tokens = record.get("tokens")
    body = answer_body(
        endpoint,
        answer_id=completion_id(endpoint, f"{batch_id}-{line}"),
        created=int(record.get("t", 0)) // 1000,
        model=str(record.get("model") or ""),
        done=entry,
        logprobs=None if not tokens else [_logprob(*token) for token in tokens],
        token_text=token_text,
    )
    return True, {
        "id": line_id(batch_id, line),
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": line_request_id(batch_id, line),
            "body": body,
        },
        "error": None,
    }


def _logprob(token_id: int, text: str, logprob: str, top: str) -> Logprob:
    """A token of a stored record (its stream entry's fields, as stored)."""
    tops = [(int(t), float(lp)) for t, lp in json.loads(top)] if top else []
    return Logprob(int(token_id), text, float(logprob) if logprob != "" else 0.0, tops)
