"""One error hierarchy. Each error carries a stable contract `code`; its type decides
what the consumer does with the message (see `consumer.settle`)."""

from __future__ import annotations


class WorkerError(Exception):
    """Base of every error the worker raises on purpose."""

    code = "internal_error"

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class InvalidJob(WorkerError):
    """The message can never run: dead-letter it, write an `error` entry, acknowledge."""

    code = "invalid_request"


class InputTooLong(InvalidJob):
    """The prompt is longer than the limits allow (and `truncate` was not given)."""

    code = "input_too_long"


class DeliveryLimitExceeded(InvalidJob):
    """The message was delivered too many times without finishing (a poison job)."""

    code = "internal_error"


class StreamUnusable(InvalidJob):
    """The request's stream key holds something Redis cannot append to (not a stream)."""

    code = "internal_error"


class DeadlineExceeded(WorkerError):
    """The job's deadline passed before it started: `error` entry, acknowledge."""

    code = "deadline_exceeded"


class HandBack(WorkerError):
    """The job was not finished here and must go back to the queue unacknowledged
    (shutdown, lost connection); another worker continues it."""


class ConfigError(Exception):
    """A setting is malformed or out of range; the message is one line naming it."""
