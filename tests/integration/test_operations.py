"""What operators rely on: probes, metrics, engine failure, draining."""

from __future__ import annotations

import asyncio
import re
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal
from trtllm_worker.config import Settings
from trtllm_worker.engine.base import Engine, EngineLimits, EngineOutput, EngineStats
from trtllm_worker.engine.echo import EchoEngine

METRICS_PAGE = (Path(__file__).parents[2] / "docs" / "observability.md").read_text(encoding="utf-8")


def rid() -> str:
    return f"op-{uuid.uuid4().hex[:10]}"


async def http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


async def test_probes_and_metrics(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    ids = [rid() for _ in range(3)]
    async with run_worker() as service:
        port = service.http_port
        assert await http_get(port, "/healthz") == (200, "ok\n")
        assert await http_get(port, "/readyz") == (200, "ok\n")
        for request_id in ids:
            await producer.publish(
                {"request_id": request_id, "inputs": "abc", "parameters": {"max_new_tokens": 4}},
                timestamp=datetime.now(UTC),
            )
        for request_id in ids:
            await subscriber.read_until_terminal(request_id)
        await producer.publish(b"garbage")
        await producer.get_dead()
        status, metrics = await http_get(port, "/metrics")
        assert (await http_get(port, "/nope"))[0] == 404
    assert status == 200
    samples = dict(
        line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#")
    )
    assert float(samples['worker_jobs_total{outcome="done:length"}']) == 3
    assert float(samples['worker_jobs_total{outcome="dead_lettered"}']) == 1
    assert float(samples["worker_generated_tokens_total"]) == 12
    # by priority class: the jobs were published without a priority (normal)
    normal = '{priority_class="normal"}'
    assert float(samples[f"worker_time_to_first_token_seconds_count{normal}"]) == 3
    assert float(samples["worker_in_flight_requests"]) == 0
    assert float(samples["worker_capacity_requests"]) == 64
    # engine statistics, sampled by the engine thread
    assert float(samples["worker_engine_active_requests"]) >= 0
    assert float(samples["worker_engine_queued_requests"]) >= 0
    assert "worker_engine_step_seconds" in samples
    assert float(samples[f"worker_queue_wait_seconds_count{normal}"]) == 3
    assert 'worker_queue_wait_seconds_count{priority_class="interactive"}' not in samples
    assert float(samples["worker_job_duration_seconds_count"]) == 3
    assert float(samples["worker_input_tokens_total"]) == 9
    assert float(samples["worker_inter_token_latency_seconds_count"]) >= 1
    assert float(samples["worker_broker_connected"]) == 1
    assert float(samples["worker_redis_connected"]) == 1
    assert float(samples["worker_ready"]) == 1
    # every family docs/observability.md documents is exposed
    documented = set(re.findall(r"`(worker_[a-z_]+)`", METRICS_PAGE))
    exposed = {line.split()[2] for line in metrics.splitlines() if line.startswith("# TYPE")}
    assert (
        documented
        - {
            "worker_engine_kv_cache_used_blocks",
            "worker_engine_kv_cache_max_blocks",
            "worker_engine_kv_cache_usage_ratio",
        }
        <= exposed
    )


async def test_readyz_is_503_while_draining(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker(echo_step_ms=5, drain_timeout_s=10) as service:
        await producer.publish(
            {"request_id": request_id, "inputs": "abc", "parameters": {"max_new_tokens": 100}}
        )
        await subscriber.first_entry(request_id)
        stopping = asyncio.create_task(service.stop())
        await asyncio.sleep(0)  # let stop() mark the worker as draining
        status, _ = await http_get(service.http_port, "/readyz")
        await stopping
    assert status == 503
    # the running job was allowed to finish within the drain timeout
    entries = await subscriber.read_until_terminal(request_id)
    assert terminal(entries)["generated_tokens"] == "100"


async def test_drain_timeout_hands_running_jobs_back(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber, names: dict[str, str]
) -> None:
    request_id = rid()
    async with run_worker(echo_step_ms=10, drain_timeout_s=0.2):
        await producer.publish(
            {"request_id": request_id, "inputs": "abc", "parameters": {"max_new_tokens": 2000}}
        )
        await subscriber.first_entry(request_id)
    # the worker stopped without a terminal entry; the job is back in the queue
    entries = await subscriber.entries(request_id)
    assert entries
    assert all(fields["event"] == "token" for fields in entries)
    queue = await producer.channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "quorum"}
    )
    assert queue.declaration_result.message_count == 1


class FailingEngine:
    """The echo engine until `fail` is set; then `wait` raises, as a dead GPU would."""

    def __init__(self, inner: EchoEngine) -> None:
        self.inner = inner
        self.fail = threading.Event()

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def limits(self) -> EngineLimits:
        return self.inner.limits

    def enqueue(self, request: object) -> None:
        self.inner.enqueue(request)  # type: ignore[arg-type]

    def cancel(self, request_id: int) -> None:
        self.inner.cancel(request_id)

    def wait(self, timeout: float) -> list[EngineOutput]:
        if self.fail.is_set():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.inner.wait(timeout)

    def wake(self) -> None:
        self.inner.wake()

    def stats(self) -> EngineStats:
        return self.inner.stats()

    def shutdown(self) -> None:
        self.inner.shutdown()


async def test_engine_death_hands_jobs_back_and_turns_unready(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    monkeypatch: pytest.MonkeyPatch,
    names: dict[str, str],
) -> None:
    engines: list[FailingEngine] = []

    def factory(
        settings: Settings, tokenizer: object, adapters: object = None
    ) -> Callable[[], Engine]:
        def create() -> Engine:
            engine = FailingEngine(EchoEngine(capacity=settings.max_batch, step_s=0.01))
            engines.append(engine)
            return engine

        return create

    monkeypatch.setattr("trtllm_worker.app.service.engine_factory", factory)
    ids = [rid(), rid()]
    async with run_worker() as service:
        for request_id in ids:
            await producer.publish(
                {"request_id": request_id, "inputs": "abc", "parameters": {"max_new_tokens": 2000}}
            )
        for request_id in ids:
            await subscriber.first_entry(request_id)
        engines[0].fail.set()
        await asyncio.wait_for(service.wait_stopped(), 10)
        assert service.engine_failed
        assert not service.ready()
        assert (await http_get(service.http_port, "/readyz"))[0] == 503
        assert (await http_get(service.http_port, "/healthz"))[0] == 503
    # the jobs are not at fault: they went back to the queue, their streams unfinished
    for request_id in ids:
        entries = await subscriber.entries(request_id)
        assert entries
        assert all(fields["event"] == "token" for fields in entries)
    queue = await producer.channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "quorum"}
    )
    assert queue.declaration_result.message_count == 2


async def test_one_failing_request_leaves_the_others_running(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    bad, good = rid(), rid()
    async with run_worker(echo_fault_token_id=255, echo_step_ms=2) as service:
        await producer.publish(
            {"request_id": good, "inputs": "abc", "parameters": {"max_new_tokens": 50}}
        )
        await subscriber.first_entry(good)
        await producer.publish({"request_id": bad, "input_ids": [97, 255]})
        failed = await subscriber.read_until_terminal(bad)
        finished = await subscriber.read_until_terminal(good)
        assert service.ready()
    assert failed == [
        {
            "event": "error",
            "code": "engine_error",
            "message": "echo engine failed the request on token 255 (test switch)",
        }
    ]
    assert terminal(finished)["generated_tokens"] == "50"
