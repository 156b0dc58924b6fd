"""Batches in OpenAI's Batch format: ids, the Redis keys a batch lives in, the record a
line's terminal entry leaves, and the statuses. The worker (its write script records
lines), the SDK (submit, status, results) and the gateway stand on this module.

A line of batch `B` is a job with request id `B:<line>` (its index in the file, from 0).
Its side key `{<stream key>}:batch` (in the stream's hash slot) is what makes it a line:
`submit` stores it before it publishes the job, and `write.lua` turns it into the line's
record in the same call that stores the stream's terminal entry (whoever writes that
entry: a worker, a dead letter, a cancel, an expiry), so a line ends once and is counted
once, and its result outlives the stream.

Keys under the stream prefix `P` (`_` follows it: a request id never starts with one, so
no stream key is a batch key):

- `P_batch:B` (hash): the batch itself: endpoint, times, totals, submit progress;
- `P_batch:B:invalid` (hash): line → the error of a line `submit` refused (not run);
- `P_batch:B:counts` (hash `ok`, `err`), on Redis Cluster `P_batch:B:counts:{tag}` with
  `tag` hashing to the line's stream slot, one per slot (the reader sums them);
- `P_batches` (sorted set): batch ids by creation time, for `list`;
- `P_file:F` (hash) and `P_file:F:data` (list of chunks): a file uploaded to the
  gateway's Files API, id `F` (`file-` and hex), kept `WORKER_BATCH_TTL_S`;
- `P_batch:B:submitter` (string): the gateway replica publishing the batch's lines now,
  with a short expiry: when it lapses before the batch is in progress, any replica may
  take the publishing over (from the file kept under `P_file:F`)."""

from __future__ import annotations

import re
import secrets
from enum import StrEnum
from typing import Final

BATCH_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9.-]{0,63}$"
"""A batch id: the characters of a request id but `_` and `:`, so `<id>:<line>` is a
request id and names one line of one batch."""
_BATCH_ID = re.compile(BATCH_ID_PATTERN)

PENDING: Final = "pending"
"""The `state` of a line key whose line has not ended."""
ENDED: Final = "ended"

BATCH_CANCELLED: Final = "batch_cancelled"
BATCH_EXPIRED: Final = "batch_expired"


class BatchStatus(StrEnum):
    """OpenAI's Batch statuses (wire values)."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


FINAL_STATUSES: Final = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)


def new_batch_id() -> str:
    """A fresh batch id: `batch-` and 26 random hex digits."""
    return "batch-" + secrets.token_hex(13)


def valid_batch_id(value: object) -> str | None:
    """The value if it is a well-formed batch id, else None."""
    return value if isinstance(value, str) and _BATCH_ID.match(value) else None


def line_request_id(batch_id: str, line: int) -> str:
    """The request id of line `line` (from 0) of batch `batch_id`."""
    return f"{batch_id}:{line}"


def line_key(stream: str) -> str:
    """A batch line's side key (its pending marker, then its record) beside its stream."""
    return "{" + stream + "}:batch"


def batch_key(prefix: str, batch_id: str) -> str:
    return f"{prefix}_batch:{batch_id}"


def invalid_key(prefix: str, batch_id: str) -> str:
    return batch_key(prefix, batch_id) + ":invalid"


def counts_key(prefix: str, batch_id: str, tag: str | None = None) -> str:
    """The `ok` / `err` counters of the batch's lines (those of one hash slot, `tag`, on
    Redis Cluster)."""
    key = batch_key(prefix, batch_id) + ":counts"
    return key if tag is None else f"{key}:{{{tag}}}"


def index_key(prefix: str) -> str:
    return f"{prefix}_batches"


FILE_PREFIX: Final = "file-"
FILE_ID_PATTERN: Final = r"^file-[A-Za-z0-9][A-Za-z0-9.-]{0,80}$"
_FILE_ID = re.compile(FILE_ID_PATTERN)
OUTPUT_SUFFIX: Final = "-output"
ERRORS_SUFFIX: Final = "-errors"


def new_file_id() -> str:
    """A fresh uploaded file's id: `file-` and 24 random hex digits."""
    return FILE_PREFIX + secrets.token_hex(12)


def valid_file_id(value: object) -> str | None:
    return value if isinstance(value, str) and _FILE_ID.match(value) else None


def file_key(prefix: str, file_id: str) -> str:
    return f"{prefix}_file:{file_id}"


def file_data_key(prefix: str, file_id: str) -> str:
    return f"{prefix}_file:{file_id}:data"


def file_index_key(prefix: str) -> str:
    """The uploaded files by upload time (a sorted set: `GET /v1/files` lists from it;
    an id whose file expired is dropped when met)."""
    return f"{prefix}_file:index"


def submitter_key(prefix: str, batch_id: str) -> str:
    return f"{batch_key(prefix, batch_id)}:submitter"


def result_file(file_id: str) -> tuple[str, bool] | None:
    """(batch id, True for the output file / False for the errors file) of a batch's
    result file id (`file-<batch id>-output`, `file-<batch id>-errors`); None for others."""
    for suffix, output in ((OUTPUT_SUFFIX, True), (ERRORS_SUFFIX, False)):
        if file_id.startswith(FILE_PREFIX) and file_id.endswith(suffix):
            batch_id = valid_batch_id(file_id[len(FILE_PREFIX) : -len(suffix)])
            if batch_id is not None:
                return batch_id, output
    return None
