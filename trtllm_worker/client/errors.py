"""The errors the SDK raises, apart so that code catching them needs none of the
client's connections: each message is one line a user can act on."""

from __future__ import annotations


class ClientError(Exception):
    """Base of the client's errors; the message is one line a user can act on."""


class InvalidJobError(ClientError, ValueError):
    """The job would be rejected by the worker; nothing was published. The message is
    the worker's own (it names the field)."""

    def __init__(self, message: str, *, code: str = "invalid_request") -> None:
        super().__init__(f"invalid job: {message}")
        self.code = code
        self.message = message


class JobFailed(ClientError):
    """The job ended with an `error` entry."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {code}: {message}")
        self.request_id = request_id
        self.code = code
        self.message = message


class ServiceUnavailable(ClientError, ConnectionError):
    """RabbitMQ or Redis does not answer (or stopped answering for too long)."""


class QueueMissing(ServiceUnavailable):
    """The job queue does not exist: no worker has declared it yet."""


class QueueFull(ServiceUnavailable):
    """The broker refused the job (a negative publisher confirm: a queue at its
    `x-max-length` with `reject-publish`, or a broker in memory or disk alarm). Nothing
    was queued; try again later."""


class StreamFormatError(ClientError):
    """A stream entry does not have the fields the contract gives its event."""
