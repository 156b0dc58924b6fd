"""Traces: one span per job, built when its message is settled from timings the worker
takes on the way anyway (no span per token, nothing live while the job runs).

The worker process never imports OpenTelemetry. When the standard variables ask for
traces (`OTEL_EXPORTER_OTLP_ENDPOINT`), a finished job's trace is packed (MessagePack,
a few microseconds) and piped to an exporter process (`trtllm_worker.ops.otel`) that builds
the span with the OpenTelemetry SDK and exports it with the SDK's batch processor: the
SDK's span objects and its pure-Python OTLP encoder cost about 0.2 ms per span, which
on the worker's event loop would have halved the rate of short jobs. Without the
variables, a job's trace is None and nothing is started."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import random
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from trtllm_worker.config import redact_url
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.queues import TRACEPARENT

if TYPE_CHECKING:
    from trtllm_worker.contract.errors import WorkerError
    from trtllm_worker.contract.job import Job

AttributeValue = str | int | float | bool | tuple[str, ...]
Attributes = dict[str, AttributeValue]

# Event names, in the order a job meets them (the README's observability section).
RECEIVED = "received"
"""The worker took the message: the queue wait ends (it began at the span's start)."""
INTAKE = "intake done"
"""Validated, leased, chat template rendered, tokenized."""
RESUMED = "resumed"
"""An earlier attempt stored tokens; this one continues after them."""
SUBMITTED = "submitted to engine"
"""Handed to the engine thread; the engine schedules it when it has a free slot."""
FIRST_TOKEN = "first token"
"""The first token entry is stored: what a subscriber sees first."""
TERMINAL = "terminal entry"
"""The `done` or `error` entry is stored."""
DEAD_LETTERED = "dead-lettered"
HANDED_BACK = "handed back"

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_PROTOCOL = "http/protobuf"
"""The specification's default (Python's SDK alone would pick gRPC)."""
PIPE_LIMIT_BYTES = 16 * 2**20
"""Packed traces the exporter process has not read yet, at most: beyond, new ones are
dropped (counted in the log) rather than held without bound."""
STOP_TIMEOUT_S = 5.0
"""On stop, how long the exporter process may take to read the last traces, export what
it holds and exit (the README's promise); then it is killed."""
FLUSH_S = 0.05

log = logging.getLogger(__name__)


def _nonzero(bits: int) -> int:
    """A random id of `bits` bits; W3C forbids the all-zero id."""
    return random.getrandbits(bits) or 1


class JobTrace:
    """What happened to one job, as the worker saw it: monotonic times and attributes,
    turned into one span by `Tracing.finish`.

    The span's ids are picked here, when the job is received, not by the exporter
    process when it ends: the engine's own spans (TensorRT-LLM's `trace_headers`) can
    then name the job's span as their parent while the job runs."""

    __slots__ = (
        "_mono",
        "_wall_ns",
        "attributes",
        "carrier",
        "events",
        "flags",
        "name",
        "published_ns",
        "span_id",
        "trace_id",
    )

    def __init__(
        self, carrier: dict[str, str], published_ns: int | None, received_at: float
    ) -> None:
        self.carrier = carrier
        """The message's trace headers (`traceparent`, `tracestate`, …)."""
        parent = TRACEPARENT.match(carrier.get("traceparent", "").strip().lower())
        if (
            parent is not None
            and parent.group(1) == "00"  # the version whose fields are read here
            and int(parent.group(2), 16)
            and int(parent.group(3), 16)
        ):
            self.trace_id = int(parent.group(2), 16)
            self.flags = parent.group(4)
        else:  # no parent, or one OpenTelemetry would not take: a trace of its own
            self.trace_id = _nonzero(128)
            self.flags = "01"
        self.span_id = _nonzero(64)
        self._wall_ns = time.time_ns()
        self._mono = received_at
        self.published_ns = None if published_ns is None else min(published_ns, self._wall_ns)
        self.name = ""
        self.attributes: Attributes = {}
        self.events: list[tuple[str, float, Attributes | None]] = [(RECEIVED, received_at, None)]

    def event(
        self, name: str, at: float | None = None, attributes: Attributes | None = None
    ) -> None:
        """Record `name` at monotonic time `at` (now when None)."""
        self.events.append((name, time.monotonic() if at is None else at, attributes))

    def packed(self, error: WorkerError | None) -> bytes:
        """The span as the exporter process reads it: name, start, end, trace headers,
        attributes, events (name, time, attributes), error message or None."""
        wall_ns = self.wall_ns
        events = [(name, wall_ns(at), attributes) for name, at, attributes in self.events]
        end = max(wall_ns(time.monotonic()), max(at for _, at, _ in events))
        message = None if error is None else error.message[:256]
        record = (
            self.name,
            self.start_ns,
            end,
            self.carrier,
            self.attributes,
            events,
            message,
            self.trace_id.to_bytes(16, "big"),
            self.span_id.to_bytes(8, "big"),
        )
        return bytes(msgpack.packb(record))

    def wall_ns(self, at: float) -> int:
        """A monotonic time of this job as nanoseconds since the epoch."""
        return self._wall_ns + round((at - self._mono) * 1e9)

    @property
    def start_ns(self) -> int:
        """When the job's life began: its publication when the message says, else its
        receipt."""
        return self._wall_ns if self.published_ns is None else self.published_ns


def begin_trace(
    headers: Mapping[str, Any] | None,
    published_ns: int | None,
    received_at: float,
    queue: str,
    message_id: str | None,
) -> JobTrace:
    """A job's trace from its message: named after the queue until the job is read."""
    trace = JobTrace(trace_carrier(headers), published_ns, received_at)
    trace.name = f"process {queue}"
    attributes = trace.attributes
    attributes["messaging.system"] = "rabbitmq"
    attributes["messaging.operation.type"] = "process"
    attributes["messaging.destination.name"] = queue
    if message_id:
        attributes["messaging.message.id"] = message_id
    return trace


def describe_job(trace: JobTrace, job: Job, model: str) -> None:
    """Name the span as OpenTelemetry's GenAI conventions do (`{operation} {model}`)."""
    operation = "text_completion" if job.messages is None else "chat"
    trace.name = f"{operation} {model}"
    attributes = trace.attributes
    attributes["gen_ai.operation.name"] = operation
    attributes["gen_ai.request.model"] = model
    attributes["trtllm_worker.request_id"] = job.request_id
    if job.tenant is not None:
        attributes["trtllm_worker.tenant"] = job.tenant
    if job.adapter is not None:
        attributes["trtllm_worker.adapter"] = job.adapter
    params = job.parameters
    if params.temperature is not None:
        attributes["gen_ai.request.temperature"] = params.temperature
    if params.top_p is not None:
        attributes["gen_ai.request.top_p"] = params.top_p
    if params.top_k is not None:
        attributes["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None and params.seed < 2**63:  # OTLP integers are 64-bit signed
        attributes["gen_ai.request.seed"] = params.seed
    if params.stop:
        attributes["gen_ai.request.stop_sequences"] = tuple(params.stop)


class Tracing(Protocol):
    """Where finished job traces go (the OpenTelemetry SDK's batch processor)."""

    description: str
    """Protocol and endpoint, for the startup line."""

    def finish(self, trace: JobTrace, error: WorkerError | None = None) -> None: ...

    async def close(self) -> None: ...


def trace_carrier(headers: Mapping[str, Any] | None) -> dict[str, str]:
    """The text headers of a message, as a propagator reads them (AMQP headers may
    arrive as bytes)."""
    if not headers:
        return {}
    carrier: dict[str, str] = {}
    for key, value in headers.items():
        if isinstance(value, str):
            carrier[key] = value
        elif isinstance(value, bytes):
            carrier[key] = value.decode("utf-8", "replace")
    return carrier


def trace_context(trace: JobTrace | None) -> dict[str, str] | None:
    """The job's span as a W3C trace context, for an engine that makes spans of its own
    (TensorRT-LLM 1.4's `trace_headers`): its spans become children of the job's span.
    The message's `tracestate` goes along. None when traces are off."""
    if trace is None:
        return None
    context = {"traceparent": f"00-{trace.trace_id:032x}-{trace.span_id:016x}-{trace.flags}"}
    if "tracestate" in trace.carrier:
        context["tracestate"] = trace.carrier["tracestate"]
    return context


def tracing_enabled(environ: Mapping[str, str]) -> bool:
    """True when the standard variables ask for traces: an OTLP endpoint set, the SDK
    not disabled and the traces exporter not `none`."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if exporter == "none":
        return False
    if not any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES):
        return False
    if exporter != "otlp":
        raise ConfigError(
            f"invalid setting OTEL_TRACES_EXPORTER={exporter!r}: the worker exports "
            "traces over OTLP only (otlp, or none to turn traces off)"
        )
    return True


def protocol_of(environ: Mapping[str, str]) -> str:
    for name in PROTOCOL_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            if value not in PROTOCOLS:
                raise ConfigError(
                    f"invalid setting {name}={value!r}: the worker exports http/protobuf or grpc"
                )
            return value
    return DEFAULT_PROTOCOL


class TraceShipper:
    """Pipes finished traces to the exporter process, gathered into one write per
    `FLUSH_S` (a write per job cost the event loop a system call each). Never blocks
    the event loop and never fails a job: when the process falls behind or dies, traces
    are dropped and the log says how many."""

    def __init__(self, process: asyncio.subprocess.Process, description: str) -> None:
        self._process = process
        assert process.stdin is not None
        self._pipe = process.stdin
        self.description = description
        self.dropped = 0
        self._gathered: list[bytes] = []
        self._flush_at: asyncio.TimerHandle | None = None

    def finish(self, trace: JobTrace, error: WorkerError | None = None) -> None:
        self._gathered.append(trace.packed(error))
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)

    def _flush(self) -> None:
        self._flush_at = None
        gathered, self._gathered = self._gathered, []
        pipe = self._pipe
        if pipe.is_closing() or pipe.transport.get_write_buffer_size() > PIPE_LIMIT_BYTES:
            before = self.dropped
            self.dropped += len(gathered)
            if before == 0 or before // 1000 != self.dropped // 1000:
                log.warning(
                    "trace exporter %s: %d traces dropped so far",
                    "is gone" if pipe.is_closing() else "falls behind",
                    self.dropped,
                )
            return
        pipe.write(b"".join(gathered))

    async def close(self) -> None:
        """End of input: the exporter exports what it has and exits, all within
        `STOP_TIMEOUT_S`; one that does not (stalled: it stopped reading, or its export
        hangs) is killed, and what it had not read yet is dropped."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush()
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                with contextlib.suppress(ConnectionError):
                    self._pipe.close()
                    await self._pipe.wait_closed()
                await self._process.wait()
        except TimeoutError:
            unread = self._pipe.transport.get_write_buffer_size()
            log.warning(
                "trace exporter did not stop within %.0fs (%d bytes of traces not read); killed",
                STOP_TIMEOUT_S,
                unread,
            )
            self._pipe.transport.abort()
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            await self._process.wait()
        if self.dropped:
            log.warning("%d traces were dropped", self.dropped)


async def start_tracing(environ: Mapping[str, str], *, instance_id: str) -> Tracing | None:
    """The exporter process the standard variables ask for (it inherits them), or None."""
    if not tracing_enabled(environ):
        return None
    protocol = protocol_of(environ)
    exporter = "opentelemetry.exporter.otlp.proto." + protocol.split("/")[0]
    missing = next((m for m in ("opentelemetry.sdk", exporter) if not _importable(m)), None)
    if missing is not None:
        raise ConfigError(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed "
            f"(no module {missing!r}): pip install 'trtllm-worker[otel]', or unset it"
        )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "trtllm_worker.ops.otel",
        instance_id,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    line = await process.stdout.readline()
    if not line.startswith(b"ready"):
        code = await process.wait()
        raise ConfigError(f"the trace exporter did not start (exit {code}; its error is above)")
    endpoint = next((environ[n] for n in ENDPOINT_VARIABLES if environ.get(n, "").strip()), "")
    where = redact_url(endpoint.strip())
    return TraceShipper(process, f"OTLP {protocol} to {where}, exporter pid {process.pid}")


def _importable(module: str) -> bool:
    """Whether `module` could be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing or blocked
        return False
