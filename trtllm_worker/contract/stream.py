"""The token stream as subscribers see it: key names, event types, entry ids and the
fields of each entry. Producers, subscribers and the worker all stand on this module."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Final

Fields = dict[str, str | int | float]
"""One stream entry's fields as written."""

TOKEN: Final = "token"
DONE: Final = "done"
ERROR: Final = "error"
TERMINAL_EVENTS: Final = frozenset({DONE, ERROR})


class FinishReason(StrEnum):
    """The contract's finish reasons; their strings are wire values."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"


def stream_key(prefix: str, request_id: str) -> str:
    """A request's stream: `WORKER_STREAM_PREFIX + request_id`."""
    return prefix + request_id


def wake_key(prefix: str, reader_id: str) -> str:
    """A gateway process's wake stream: an entry added there returns its stream reader's
    blocked XREAD, so that it reads a stream that joined meanwhile (gateway/reader.py)."""
    return f"{prefix}_gateway:{reader_id}:wake"


def lease_key(key: str) -> str:
    """The request's lease. Side keys are named `{<stream key>}:<suffix>`: the braces put
    them in the stream's hash slot, so one script may touch them together on a cluster."""
    return "{" + key + "}:lease"


def cancel_key(key: str) -> str:
    """The cancel mark of a request that may not have been taken yet."""
    return "{" + key + "}:cancel"


def deliveries_key(key: str) -> str:
    """How often a classic queue delivered the request's message."""
    return "{" + key + "}:deliveries"


def entry_id(seq: int) -> str:
    """Stream entry ids are `0-<seq>`, seq = index + 1 for tokens and one more for the
    terminal entry: Redis then refuses to store any index twice or out of order."""
    return f"0-{seq}"


_ENTRY_ID = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def entry_order(entry_id: str) -> tuple[int, int] | None:
    """A stream entry id (`ms-seq`, or `ms` alone: seq 0) as a pair that sorts as Redis
    orders entries; None when it is not an entry id."""
    found = _ENTRY_ID.fullmatch(entry_id)
    if found is None:
        return None
    ms, seq = found.groups()
    return int(ms), int(seq or 0)


def error_fields(code: str, message: str) -> Fields:
    """An `error` entry: its message on one line."""
    return {"event": ERROR, "code": code, "message": " ".join(message.split())}
