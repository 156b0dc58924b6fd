"""The SDK's public names gathered from the modules that hold them, one concern each:
`trtllm_worker.client` re-exports them from here, and imports of
`trtllm_worker.client.sdk` written before the split keep working. Where each lives:

- `errors`: `ClientError` and its subclasses
- `events`: `TokenEvent`, `DoneEvent`, `ErrorEvent`, `Event`, `parse_entry`
- `jobs`: `JobOptions`, `job_body`, `validate_job`
- `tracecontext`: `trace_headers` (with the contract's `TRACEPARENT` pattern)
- `cancel`: the cancel broadcast
- `async_client`: `Client`, which owns the connections
- `sync_client`: `SyncClient`
- `admin`: `DeadLetter` (what a dead letter says)
- `usage`: `Usage` (one tenant's usage on one day)"""

from trtllm_worker.client.admin import DeadLetter
from trtllm_worker.client.async_client import (
    DEFAULT_CLIENT_NAME,
    XREAD_BLOCK_MS,
    Client,
    ClientOptions,
)
from trtllm_worker.client.errors import (
    ClientError,
    InvalidJobError,
    JobFailed,
    QueueFull,
    QueueMissing,
    ServiceUnavailable,
    StreamFormatError,
)
from trtllm_worker.client.events import DoneEvent, ErrorEvent, Event, TokenEvent, parse_entry
from trtllm_worker.client.jobs import JobOptions, job_body, validate_job
from trtllm_worker.client.sync_client import SyncClient
from trtllm_worker.client.tracecontext import trace_headers
from trtllm_worker.client.usage import Usage
from trtllm_worker.contract.queues import TRACEPARENT

__all__ = [
    "DEFAULT_CLIENT_NAME",
    "TRACEPARENT",
    "XREAD_BLOCK_MS",
    "Client",
    "ClientError",
    "ClientOptions",
    "DeadLetter",
    "DoneEvent",
    "ErrorEvent",
    "Event",
    "InvalidJobError",
    "JobFailed",
    "JobOptions",
    "QueueFull",
    "QueueMissing",
    "ServiceUnavailable",
    "StreamFormatError",
    "SyncClient",
    "TokenEvent",
    "Usage",
    "job_body",
    "parse_entry",
    "trace_headers",
    "validate_job",
]
