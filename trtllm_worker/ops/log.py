"""Logging: key=value text locally, one JSON object per line in production. Every line
about a job carries its `request_id`: from the job's own task (a context variable set
when its message is read), or passed as `extra={"request_id": ...}` by code that serves
many jobs at once (the output pump)."""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime

request_id_var: ContextVar[str | None] = ContextVar("request_id", default=None)
"""The request the current task works on (each job runs in a task of its own)."""


def about(request_id: str) -> dict[str, str]:
    """`extra=` for a log line about one request, from code outside its task."""
    return {"request_id": request_id}


class RequestIdFilter(logging.Filter):
    """Gives every record a `request_id` attribute: the one passed in `extra`, else the
    current task's, else None."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = getattr(record, "request_id", None)
        return text if request_id is None else f"{text} request_id={request_id}"


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger of the worker's own process (never called on import:
    an application that imports the SDK keeps its logging as it was)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aio-pika and aiormq log every reconnect attempt at INFO with tracebacks
    logging.getLogger("aiormq").setLevel(max(logging.WARNING, root.level))
    logging.getLogger("aio_pika").setLevel(max(logging.WARNING, root.level))
