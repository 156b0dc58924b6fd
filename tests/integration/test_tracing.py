"""Traces as an operator's collector receives them: worker processes export over OTLP
to a real receiver started here (HTTP/protobuf or gRPC), which decodes the protobuf
export. Each job is one span in its producer's trace, with the events of its path."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Producer, Spawn, Subscriber, terminal, tokens
from tests.integration.test_faults import wait_for_entries
from tests.lora_fixtures import write_adapter
from tests.otlp import Collected, ReceivedSpan, grpc_receiver, http_receiver
from trtllm_worker.client import Client
from trtllm_worker.config import Settings

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # the batch processor's delay, ms
PATH_EVENTS = ["received", "intake done", "submitted to engine", "first token"]


def rid() -> str:
    return f"trc-{uuid.uuid4().hex[:10]}"


def producer_span() -> tuple[str, str]:
    """A producer's trace id and span id (as its own tracer would make them)."""
    return secrets.token_hex(16), secrets.token_hex(8)


@pytest.fixture
async def collected() -> Collected:
    return Collected(asyncio.get_running_loop())


@pytest.fixture
def otlp_http(collected: Collected) -> Iterator[str]:
    with http_receiver(collected) as url:
        yield url


@pytest.fixture
async def client(
    make_settings: Callable[..., Settings], subscriber: Subscriber
) -> AsyncIterator[Client]:
    async with Client(make_settings()) as client:
        yield client


def of_request(request_id: str) -> Callable[[ReceivedSpan], bool]:
    return lambda span: span.attributes.get("trtllm_worker.request_id") == request_id


def assert_in_order(span: ReceivedSpan) -> None:
    """Events in time order, within the span; the span starts at the job's publication,
    so the time before `received` is the queue wait."""
    times = [event.time_ns for event in span.events]
    assert times == sorted(times), span.event_names
    assert span.start_ns <= times[0] <= times[-1] <= span.end_ns


async def test_a_resumed_job_is_a_span_per_attempt_in_the_producers_trace(
    spawn: Spawn,
    client: Client,
    subscriber: Subscriber,
    collected: Collected,
    otlp_http: str,
) -> None:
    """Submitted by the SDK under a producer's span; the first worker stops mid-stream
    (SIGTERM, drain timeout passed) and hands the job back, a second one resumes it.
    Both attempts are children of the producer's span; the second has a `resumed` event
    and the job's GenAI attributes."""
    trace_id, parent_id = producer_span()
    prompt, n = "Trace me, 日本! ", 200
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_http, **FAST_EXPORT}
    first = await spawn(WORKER_ECHO_STEP_MS="10", WORKER_DRAIN_TIMEOUT_S="0", **env)
    published = time.time_ns()
    request_id = await client.submit(
        prompt,
        {"max_new_tokens": n},
        trace_context={"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "p=1"},
    )
    await wait_for_entries(subscriber, request_id, 30)
    first.signal(signal.SIGTERM)
    assert await first.wait() == 0
    assert "handed back" in first.log()
    stored = len(tokens(await subscriber.entries(request_id)))
    assert 30 <= stored < n
    await spawn(WORKER_ECHO_STEP_MS="1", **env)
    done = terminal(await subscriber.read_until_terminal(request_id, wait_s=60))
    assert done["generated_tokens"] == str(n)

    handed_back, resumed = await collected.wait_for(of_request(request_id), count=2)
    for span in (handed_back, resumed):
        assert (span.trace_id, span.parent_span_id) == (trace_id, parent_id)
        assert span.kind == "SPAN_KIND_CONSUMER"
        assert span.name == "text_completion echo"
        assert span.resource["service.name"] == "trtllm-worker"
        assert_in_order(span)
        # the queue wait starts at publication (the SDK's millisecond header)
        assert published - 2_000_000 <= span.start_ns <= span.event("received").time_ns
    assert handed_back.resource["service.instance.id"] != resumed.resource["service.instance.id"]
    assert handed_back.event_names == [*PATH_EVENTS, "handed back"]
    assert handed_back.status == "STATUS_CODE_UNSET"

    # the stream's first token came from the first attempt: this one has none
    assert resumed.event_names == [
        "received",
        "intake done",
        "resumed",
        "submitted to engine",
        "terminal entry",
    ]
    assert resumed.event("resumed").attributes == {"trtllm_worker.resumed_tokens": stored}
    attributes = resumed.attributes
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"] == "echo"
    assert attributes["gen_ai.request.max_tokens"] == n
    assert attributes["gen_ai.usage.input_tokens"] == len(prompt.encode())
    assert attributes["gen_ai.usage.output_tokens"] == n
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["trtllm_worker.outcome"] == "done:length"
    assert attributes["messaging.destination.name"] == client.queue
    assert attributes["messaging.message.id"] == request_id
    assert "trtllm_worker.time_to_first_token_s" not in attributes
    assert resumed.status == "STATUS_CODE_UNSET"


async def test_a_dead_lettered_job_is_a_failed_span_under_its_message_parent(
    spawn: Spawn,
    producer: Producer,
    subscriber: Subscriber,
    collected: Collected,
    otlp_http: str,
) -> None:
    """A job the worker rejects (max_new_tokens over the limit): its error entry and
    dead letter are events of a span whose status is ERROR with the error's code."""
    await spawn(
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_http,
        WORKER_MAX_NEW_TOKENS="16",
        WORKER_DEFAULT_MAX_NEW_TOKENS="8",
        **FAST_EXPORT,
    )
    trace_id, parent_id = producer_span()
    request_id = rid()
    await producer.publish(
        {"request_id": request_id, "inputs": "too long", "parameters": {"max_new_tokens": 17}},
        message_id=request_id,
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    dead = await producer.get_dead()
    assert dead.headers["x-error-code"] == "invalid_request"
    assert terminal(await subscriber.read_until_terminal(request_id))["event"] == "error"

    (span,) = await collected.wait_for(lambda s: s.attributes.get("error.type") is not None)
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent_id)
    assert span.status == "STATUS_CODE_ERROR"
    assert "max_new_tokens" in span.status_message
    assert span.attributes["error.type"] == "invalid_request"
    assert span.attributes["messaging.message.id"] == request_id
    assert span.event_names == ["received", "terminal entry", "dead-lettered"]
    assert span.event("dead-lettered").attributes == {"error.type": "invalid_request"}
    assert_in_order(span)


async def test_grpc_export_and_a_job_without_trace_headers_starts_a_trace(
    spawn: Spawn,
    producer: Producer,
    subscriber: Subscriber,
    collected: Collected,
    tmp_path: Path,
) -> None:
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc exports over gRPC; a message without a
    `traceparent` begins a new trace (no parent); OTEL_SERVICE_NAME names the service."""
    with grpc_receiver(collected) as url:
        await spawn(
            OTEL_EXPORTER_OTLP_ENDPOINT=url,
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_SERVICE_NAME="gen-workers",
            WORKER_CHAT_TEMPLATE=str(TEMPLATES / "qwen2.5.jinja"),
            WORKER_LORA_DIR=str(write_adapter(tmp_path / "loras", "sql").parent),
            **FAST_EXPORT,
        )
        request_id = rid()
        await producer.publish(
            {
                "request_id": request_id,
                "messages": [{"role": "user", "content": "hi"}],
                "parameters": {"max_new_tokens": 4},
                "tenant": "acme",
                "adapter": "sql",
            },
            priority=7,
        )
        assert terminal(await subscriber.read_until_terminal(request_id))["event"] == "done"
        (span,) = await collected.wait_for(of_request(request_id))
    assert span.parent_span_id == ""
    # the job's priority and tenant are on its span (never a metric label: unbounded)
    assert (span.attributes["trtllm_worker.priority"], span.attributes["trtllm_worker.tenant"]) == (
        7,
        "acme",
    )
    assert span.attributes["trtllm_worker.adapter"] == "sql"
    assert len(span.trace_id) == 32
    assert span.trace_id != "0" * 32
    assert span.name == "chat echo"
    assert span.resource["service.name"] == "gen-workers"
    assert span.attributes["gen_ai.usage.output_tokens"] == 4
    assert span.event_names == [*PATH_EVENTS, "terminal entry"]
    ttft = span.attributes["trtllm_worker.time_to_first_token_s"]
    received, first_token = span.event("received"), span.event("first token")
    assert isinstance(ttft, float)
    assert ttft == pytest.approx((first_token.time_ns - received.time_ns) / 1e9, abs=0.002)


@pytest.fixture
def without_opentelemetry(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import OpenTelemetry (as without the extra)."""
    site = tmp_path / "no-otel"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\nsys.modules['opentelemetry'] = None  # import opentelemetry fails\n"
    )
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


async def test_the_worker_runs_without_opentelemetry_installed(
    spawn: Spawn,
    producer: Producer,
    subscriber: Subscriber,
    without_opentelemetry: dict[str, str],
) -> None:
    worker = await spawn(**without_opentelemetry)
    assert "traces:" not in worker.log()
    request_id = rid()
    await producer.publish(
        {"request_id": request_id, "inputs": "plain", "parameters": {"max_new_tokens": 5}}
    )
    assert terminal(await subscriber.read_until_terminal(request_id))["generated_tokens"] == "5"


async def test_traces_asked_for_without_opentelemetry_installed_is_a_config_error(
    spawn: Spawn, without_opentelemetry: dict[str, str]
) -> None:
    worker = await spawn(
        ready=False, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4318", **without_opentelemetry
    )
    assert await worker.wait() == 2
    assert (
        "OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed "
        "(no module 'opentelemetry.sdk'): pip install 'trtllm-worker[otel]', or unset it"
    ) in worker.log()


def test_without_the_variables_opentelemetry_is_never_imported() -> None:
    """The worker's modules and a service start's tracing step import no OpenTelemetry
    module when no OTLP endpoint is set. (redis-py itself imports OpenTelemetry's
    metrics SDK when it is installed, for its own opt-in metrics: that is the baseline.)"""
    code = (
        "import asyncio, sys\n"
        "import redis.asyncio, aio_pika\n"
        "def loaded(): return {m for m in sys.modules if m.startswith('opentelemetry')}\n"
        "baseline = loaded()\n"
        "import trtllm_worker.app.service, trtllm_worker.broker.consumer\n"
        "import trtllm_worker.pipeline.runner\n"
        "from trtllm_worker.ops.tracing import start_tracing\n"
        "url = {'OTEL_EXPORTER_OTLP_ENDPOINT': 'http://h:4318'}\n"
        "for env in ({'OTEL_SERVICE_NAME': 'x'}, {**url, 'OTEL_SDK_DISABLED': 'true'},\n"
        "            {**url, 'OTEL_TRACES_EXPORTER': 'none'}):\n"
        "    assert asyncio.run(start_tracing(env, instance_id='i')) is None\n"
        "print(sorted(loaded() - baseline), 'trtllm_worker.ops.otel' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[] False"


async def test_jobs_go_on_when_the_exporter_process_dies(
    spawn: Spawn, producer: Producer, subscriber: Subscriber, otlp_http: str
) -> None:
    """Tracing never fails a job: with its exporter process killed, the worker runs
    jobs on and logs the traces it drops."""
    worker = await spawn(OTEL_EXPORTER_OTLP_ENDPOINT=otlp_http, **FAST_EXPORT)
    match = re.search(r"exporter pid (\d+)", worker.log())
    assert match, worker.log()
    exporter = int(match.group(1))
    os.kill(exporter, signal.SIGKILL)
    jobs = 0
    while "trace exporter is gone" not in worker.log():  # jobs until a gathering meets it
        jobs += 1
        assert jobs <= 500, worker.log()
        request_id = rid()
        await producer.publish(
            {"request_id": request_id, "inputs": "on", "parameters": {"max_new_tokens": 3}}
        )
        done = terminal(await subscriber.read_until_terminal(request_id))
        assert done["generated_tokens"] == "3"
    assert "traces dropped so far" in worker.log()
    worker.signal(signal.SIGTERM)
    assert await worker.wait() == 0


def process_state(pid: int) -> str:
    """The kernel's state letter of a process (`T`: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_a_stalled_exporter_does_not_hold_the_worker_past_the_bound(
    spawn: Spawn, producer: Producer, subscriber: Subscriber, otlp_http: str, loop: str
) -> None:
    """An exporter process that stops reading (SIGSTOP) with traces still in the pipe:
    on SIGTERM the worker gives it the README's 5 s, kills it and exits 0."""
    worker = await spawn(
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_http, WORKER_EVENT_LOOP=loop, **FAST_EXPORT
    )
    assert f"event loop {loop}" in worker.log()
    match = re.search(r"exporter pid (\d+)", worker.log())
    assert match, worker.log()
    exporter = int(match.group(1))
    os.kill(exporter, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while process_state(exporter) != "T":  # another process: polled
            assert time.monotonic() < deadline, process_state(exporter)
            await asyncio.sleep(0.01)
        # ~2.5 KB of trace a job (8 long stop strings): far more than a pipe holds
        stops = [f"{i}{'z' * 255}" for i in range(8)]
        request_ids = [rid() for _ in range(150)]
        for request_id in request_ids:
            await producer.publish(
                {"request_id": request_id, "inputs": "on",
                 "parameters": {"max_new_tokens": 1, "stop": stops}}
            )  # fmt: skip
        await subscriber.read_many(request_ids)
        assert process_state(exporter) == "T"  # still stalled when the worker stops
        started = time.monotonic()
        worker.signal(signal.SIGTERM)
        code = await worker.wait(within_s=30)
        elapsed = time.monotonic() - started
        with pytest.raises(ProcessLookupError):  # killed and reaped by the worker
            os.kill(exporter, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(exporter, signal.SIGKILL)
    assert code == 0, worker.log()
    unread = re.search(r"trace exporter did not stop within 5s \((\d+) bytes", worker.log())
    assert unread, worker.log()  # the fault happened: traces were left in the pipe
    assert int(unread.group(1)) > 0
    assert elapsed < 5 + 2.5, (elapsed, worker.log())
