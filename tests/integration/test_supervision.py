"""A worker whose background task dies stops, with a non-zero exit code, instead of
hanging on half alive (before supervision the dead task was noticed by no one: the
worker kept its jobs, took new ones and never wrote their streams). And the JSON log
lines about a job carry its `request_id`."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Iterator

import pytest

from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal
from tests.integration.test_faults import http_is
from trtllm_worker.broker.cancel import CancelListener
from trtllm_worker.contract.exits import ExitCode
from trtllm_worker.ops.log import JsonFormatter, RequestIdFilter
from trtllm_worker.pipeline.leases import Leases
from trtllm_worker.pipeline.output import OutputProcessor

DIED_WITHIN_S = 10


def rid() -> str:
    return f"sup-{uuid.uuid4().hex[:10]}"


def _boom(*_: object, **__: object) -> None:
    raise RuntimeError("injected fault")


async def test_a_dead_output_pump_stops_the_worker(
    run_worker: WorkerFactory, producer: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(OutputProcessor, "process", _boom)
    async with run_worker() as service:
        await producer.publish({"request_id": rid(), "inputs": "abc"})
        await asyncio.wait_for(service.wait_stopped(), DIED_WITHIN_S)
        assert service.supervisor.dead == "pump"
        assert service.exit_code == ExitCode.TASK_DIED
        assert await http_is(service.http_port, "/healthz", 503)
        assert await http_is(service.http_port, "/readyz", 503)


async def test_a_dead_cancel_listener_stops_the_worker(
    run_worker: WorkerFactory, producer: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(CancelListener, "handle", _boom)
    async with run_worker() as service:
        assert await http_is(service.http_port, "/healthz", 200)
        await producer.cancel(rid())
        await asyncio.wait_for(service.wait_stopped(), DIED_WITHIN_S)
        assert service.supervisor.dead == "cancels"
        assert service.exit_code == ExitCode.TASK_DIED
        assert await http_is(service.http_port, "/healthz", 503)


async def test_a_dead_lease_keeper_stops_the_worker(
    run_worker: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Leases, "renew", _boom)
    async with run_worker(lease_ttl_s=0.5) as service:
        await asyncio.wait_for(service.wait_stopped(), DIED_WITHIN_S)
        assert service.supervisor.dead == "leases"
        assert service.exit_code == ExitCode.TASK_DIED


class JsonLines(logging.Handler):
    """The worker's production log format, captured."""

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(RequestIdFilter())
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def json_log() -> Iterator[JsonLines]:
    handler = JsonLines()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


async def test_json_log_lines_about_a_job_carry_its_request_id(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber, json_log: JsonLines
) -> None:
    done, invalid, late, cancelled = rid(), rid(), rid(), rid()
    async with run_worker(echo_step_ms=5):
        await producer.publish({"request_id": done, "inputs": "abc"})
        await producer.publish({"request_id": invalid, "inputs": "x", "colour": "red"})
        await producer.publish(
            {"request_id": late, "inputs": "x", "deadline": "2001-01-01T00:00:00Z"}
        )
        await producer.publish(
            {"request_id": cancelled, "inputs": "abc", "parameters": {"max_new_tokens": 2000}}
        )
        await subscriber.first_entry(cancelled)
        await producer.cancel(cancelled)
        for request_id in (done, invalid, late, cancelled):
            assert terminal(await subscriber.read_until_terminal(request_id))
    ids = {done, invalid, late, cancelled}
    about_jobs = [line for line in json_log.lines if line.get("request_id") in ids]
    assert {line["request_id"] for line in about_jobs} == ids  # each job has its lines
    for line in json_log.lines:  # a line that names a job is tagged with it
        named = {i for i in ids if i in line["message"]}
        assert named <= {line.get("request_id")}, line
    job_loggers = {
        "trtllm_worker.broker.consumer",
        "trtllm_worker.broker.settle",
        "trtllm_worker.broker.cancel",
    }
    outcome_lines = [
        line
        for line in json_log.lines
        if line["logger"] in job_loggers
        # the consumer's lines at start: what it consumes, whether the broker orders
        and not line["message"].startswith(("consuming", "RabbitMQ "))
    ]
    assert outcome_lines
    assert all(line.get("request_id") in ids for line in outcome_lines), outcome_lines
