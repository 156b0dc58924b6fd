"""The contract's error codes and one error hierarchy. Each error carries its stable
`code` and, FastStream-style, what becomes of the message that raised it (`action`):
`broker.settle` is the one place that turns the action into an AMQP call."""

from __future__ import annotations

from enum import Enum
from typing import ClassVar, Final

from trtllm_worker.contract.exits import ExitCode, StartupError

INVALID_REQUEST: Final = "invalid_request"
INPUT_TOO_LONG: Final = "input_too_long"
DEADLINE_EXCEEDED: Final = "deadline_exceeded"
ENGINE_ERROR: Final = "engine_error"
INTERNAL_ERROR: Final = "internal_error"
ERROR_CODES: Final = frozenset(
    {INVALID_REQUEST, INPUT_TOO_LONG, DEADLINE_EXCEEDED, ENGINE_ERROR, INTERNAL_ERROR}
)


class Action(Enum):
    """What becomes of a message."""

    ACK = "ack"
    """Done with: its terminal entry is stored (or the job ended where it stood)."""
    DEAD_LETTER = "dead_letter"
    """It can never run: `error` entry, copy to `<queue>.dead`, acknowledge."""
    REQUEUE = "requeue"
    """Not this worker's to finish (shutdown, lost connection): back to the queue."""
    RETRY = "retry"
    """It failed here and may succeed later: back to the queue, counted as a failed
    delivery, so a job that always fails ends as a dead letter."""
    RETURN = "return"
    """It makes room for a more urgent job (paused, or given back before it started): a
    copy goes back to the queue and the message is acknowledged, so that no broker
    counts it as a delivery; the copy continues the stream."""


class WorkerError(Exception):
    """Base of every error the worker raises on purpose. Unless a subclass says
    otherwise a job that raises it is retried, counted."""

    code: ClassVar[str] = INTERNAL_ERROR
    action: ClassVar[Action] = Action.RETRY
    writes_error_entry: ClassVar[bool] = False
    """Whether the stream gets an `error` entry with `code` and the message."""

    def __init__(
        self, message: str, *, request_id: str | None = None, tenant: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.tenant = tenant
        """The job's tenant where it is known: an `error` entry counts the job's usage
        under it (None: tenant `-`)."""
        self.adapter: str | None = None
        """The job's LoRA adapter, once intake found it known: the `error` entry also
        counts under it."""
        self.lease = ""
        """The request's lease token when the job held it as it failed: its error entry
        is then written through that fence (which releases it); '' for a job that took
        none, whose entry is written only where no worker holds the lease."""


class InvalidJob(WorkerError):
    """The message can never run: dead-letter it, write an `error` entry, acknowledge."""

    code = INVALID_REQUEST
    action = Action.DEAD_LETTER
    writes_error_entry = True


class InputTooLong(InvalidJob):
    """The prompt is longer than the limits allow (and `truncate` was not given)."""

    code = INPUT_TOO_LONG


class DeliveryLimitExceeded(InvalidJob):
    """The message was delivered too many times without finishing (a poison job)."""

    code = INTERNAL_ERROR


class StreamUnusable(InvalidJob):
    """The request's stream key holds something Redis cannot append to (not a stream)."""

    code = INTERNAL_ERROR
    writes_error_entry = False  # the key cannot take one: the dead letter says why


class DeadlineExceeded(WorkerError):
    """The job's deadline passed before it started: `error` entry, acknowledge."""

    code = DEADLINE_EXCEEDED
    action = Action.ACK
    writes_error_entry = True


class HandBack(WorkerError):
    """The job was not finished here and must go back to the queue unacknowledged
    (shutdown, lost connection or lease, dead engine); another worker continues it."""

    action = Action.REQUEUE


class Returned(WorkerError):
    """The job was paused (or not started) to make room for a job of higher priority:
    it goes back to the queue, never counted as a delivery (see `Action.RETURN`)."""

    action = Action.RETURN


class RetryLater(WorkerError):
    """Something this job needs failed (Redis refused a write, a bug): requeue it counted."""

    action = Action.RETRY


class ConfigError(StartupError):
    """A setting is malformed or out of range; the message is one line naming it (exit 2)."""

    exit_code = ExitCode.CONFIG
