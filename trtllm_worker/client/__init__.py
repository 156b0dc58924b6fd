"""The client SDK a job producer or subscriber imports: `Client`, `SyncClient`, the
typed events and errors. It stands on the contract and the connection modules only: no
job runner, engine or consumer is loaded, and no global state (logging, metrics) of the
host application is touched."""

from trtllm_worker.client.admin import DeadLetter
from trtllm_worker.client.batch_files import InvalidBatch
from trtllm_worker.client.batches import BatchConflict, BatchNotFound, BatchObject
from trtllm_worker.client.sdk import (
    Client,
    ClientError,
    DoneEvent,
    ErrorEvent,
    Event,
    InvalidJobError,
    JobFailed,
    QueueFull,
    QueueMissing,
    ServiceUnavailable,
    StreamFormatError,
    SyncClient,
    TokenEvent,
    Usage,
    job_body,
    parse_entry,
    validate_job,
)

__all__ = [
    "BatchConflict",
    "BatchNotFound",
    "BatchObject",
    "Client",
    "ClientError",
    "DeadLetter",
    "DoneEvent",
    "ErrorEvent",
    "Event",
    "InvalidBatch",
    "InvalidJobError",
    "JobFailed",
    "QueueFull",
    "QueueMissing",
    "ServiceUnavailable",
    "StreamFormatError",
    "SyncClient",
    "TokenEvent",
    "Usage",
    "job_body",
    "parse_entry",
    "validate_job",
]
