"""A pause broken halfway still ends every job exactly once: the broker connection lost
between the copy and the ack (quorum: both copies run) or between the credit and the
requeue (classic), the worker killed -9 while it pauses jobs, Redis gone right after a
pause. Each test proves its fault happened."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Producer, Spawn, Subscriber, WorkerFactory
from tests.integration.test_faults import (
    assert_exact,
    close_connections_of,
    free_port,
    metric,
    run,
    start_redis,
    wait_for_entries,
    wait_until,
)
from trtllm_worker.client import Client
from trtllm_worker.config import Settings
from trtllm_worker.pipeline.output import RequestState
from trtllm_worker.pipeline.runner import JobResult


def rid(tag: str) -> str:
    return f"pf-{tag}-{uuid.uuid4().hex[:8]}"


def job(request_id: str, prompt: str, n: int) -> dict[str, Any]:
    return {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": n}}


async def test_connection_lost_between_the_copy_and_the_ack(
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    producer: Producer,
    subscriber: Subscriber,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Quorum queue: the paused job's copy is in the queue, then the broker takes the
    connection before the original is acknowledged: the original comes back too. Both
    run, one after the other; the stream gets every index once and one terminal entry,
    and usage counts the job once."""
    if shutil.which("rabbitmqctl") is None:
        pytest.fail("rabbitmqctl is needed to close the worker's connection")
    batch, urgent = rid("batch"), rid("urgent")
    async with run_worker(
        max_batch=1, echo_step_ms=20, queue_type="quorum", delivery_limit=3
    ) as service:
        consumer = service._consumer
        assert consumer is not None
        settler = consumer._settler
        put_back = settler._put_back
        closed: list[int] = []

        async def put_back_then_lose_the_connection(message: Any) -> None:
            await put_back(message)
            if not closed:  # once: the worker's own connection (its name has our pid)
                closed.append(await close_connections_of([os.getpid()]))

        monkeypatch.setattr(settler, "_put_back", put_back_then_lose_the_connection)
        skipped = asyncio.Event()  # the second copy found the stream ended
        log_result = consumer._log_result

        def log_and_say(result: JobResult, received_at: float) -> None:
            if result.terminal is None:
                skipped.set()
            log_result(result, received_at)

        monkeypatch.setattr(consumer, "_log_result", log_and_say)
        await producer.publish({**job(batch, "paused twice? ", 120), "tenant": "t1"}, priority=0)
        await wait_for_entries(subscriber, batch, 10)
        await producer.publish(job(urgent, "now ", 5), priority=9)
        results = await subscriber.read_many([batch, urgent], wait_s=60)
        async with asyncio.timeout(30):  # both copies of the batch job ran
            await skipped.wait()
    assert closed == [1], "the worker's connection was closed after the copy went back"
    assert service.metrics.paused._value.get() >= 1
    assert_exact(results[batch], "paused twice? ", 120)
    assert_exact(results[urgent], "now ", 5)
    async with Client(make_settings()) as client:  # both copies ran: counted once
        (usage,) = await client.usage(tenant="t1")
    assert (usage.jobs, usage.generated_tokens) == (1, 120)


async def test_connection_lost_between_the_credit_and_the_requeue(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Classic queue: a paused job goes back with a requeue, the worker having told
    Redis first that the redelivery is not a failed one. The connection goes between
    the two: the broker requeues the job itself, and under delivery limit 1 it still
    runs to its end (the credit covers that redelivery), never dead-lettered."""
    if shutil.which("rabbitmqctl") is None:
        pytest.fail("rabbitmqctl is needed to close the worker's connection")
    batch, urgent = rid("batch"), rid("urgent")
    async with run_worker(
        max_batch=1, echo_step_ms=20, queue_type="classic", delivery_limit=1
    ) as service:
        consumer = service._consumer
        assert consumer is not None
        settler = consumer._settler
        in_place = settler._return_in_place
        closed: list[int] = []

        async def credit_then_lose_the_connection(message: Any, error: Any) -> bool:
            credited = await in_place(message, error)
            if not closed:
                closed.append(await close_connections_of([os.getpid()]))
            return credited

        monkeypatch.setattr(settler, "_return_in_place", credit_then_lose_the_connection)
        await producer.publish(job(batch, "come back ", 120), priority=0)
        await wait_for_entries(subscriber, batch, 10)
        await producer.publish(job(urgent, "now ", 5), priority=9)
        results = await subscriber.read_many([batch, urgent], wait_s=60)
    assert closed == [1], "the worker's connection was closed before the requeue"
    assert service.metrics.paused._value.get() >= 1
    assert_exact(results[batch], "come back ", 120)
    assert_exact(results[urgent], "now ", 5)


async def test_worker_killed_while_pausing_jobs_another_finishes_them(
    spawn: Spawn, producer: Producer, subscriber: Subscriber
) -> None:
    """A worker pausing batch jobs for a stream of interactive ones is killed -9: the
    next worker ends every job exactly once, paused ones included."""
    first = await spawn(WORKER_ECHO_STEP_MS="10", WORKER_MAX_BATCH="2", WORKER_QUEUE_TYPE="classic")
    batch = {rid("batch"): f"batch {n} " for n in range(6)}
    for request_id, prompt in batch.items():
        await producer.publish(job(request_id, prompt, 150), priority=1)
    await wait_for_entries(subscriber, next(iter(batch)), 5)
    urgent = {rid("urgent"): f"urgent {n} " for n in range(6)}
    for request_id, prompt in urgent.items():
        await producer.publish(job(request_id, prompt, 30), priority=8)
    try:
        await wait_until(
            lambda: _at_least(metric(first.http_port, "worker_jobs_paused_total"), 1), within_s=30
        )
    except TimeoutError:
        raise AssertionError("no pauses:\n" + first.log()) from None
    first.signal(signal.SIGKILL)
    assert await first.wait() == -signal.SIGKILL
    await spawn(WORKER_ECHO_STEP_MS="2", WORKER_MAX_BATCH="4", WORKER_QUEUE_TYPE="classic")
    results = await subscriber.read_many([*batch, *urgent], wait_s=120)
    for request_id, prompt in batch.items():
        assert_exact(results[request_id], prompt, 150)
    for request_id, prompt in urgent.items():
        assert_exact(results[request_id], prompt, 30)


async def _at_least(value: Any, floor: float) -> bool:
    return float(await value) >= floor


async def test_redis_gone_right_after_a_pause(
    run_worker: WorkerFactory,
    producer: Producer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    names: dict[str, str],
) -> None:
    """Redis stops the moment a job is paused: the lease is not released (Redis is
    down), the copy waits for Redis and then for the lease to expire, and resumes the
    stream where the paused attempt left it."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is needed for a private Redis")
    import redis.asyncio as aioredis

    port = free_port()
    await start_redis(port, tmp_path)
    private = aioredis.Redis(port=port, decode_responses=True)
    reader = Subscriber(private, names["stream_prefix"])
    try:
        async with run_worker(
            redis_url=f"redis://127.0.0.1:{port}/0",
            max_batch=1,
            echo_step_ms=20,
            queue_type="classic",
            lease_ttl_s=2,
        ) as service:
            runner = service._runner
            assert runner is not None
            pump = runner._pump
            pause = pump.pause
            stopped: list[bool] = []
            redis_stopped = asyncio.Event()

            def pause_then_stop_redis(state: RequestState, reason: str) -> bool:
                paused = pause(state, reason)
                if stopped:  # once: later pauses (the jobs meet again) run as usual
                    return paused
                stopped.append(paused)
                # synchronously: Redis is gone before the lease release the pause started
                # in the background gets to run
                subprocess.run(
                    ["redis-cli", "-p", str(port), "shutdown", "nosave"],
                    check=False,
                    capture_output=True,
                )
                redis_stopped.set()
                return paused

            monkeypatch.setattr(pump, "pause", pause_then_stop_redis)
            batch, urgent = rid("batch"), rid("urgent")
            await producer.publish(job(batch, "keep going ", 100), priority=0)
            await wait_for_entries(reader, batch, 10)
            await producer.publish(job(urgent, "first ", 4), priority=9)
            async with asyncio.timeout(30):
                await redis_stopped.wait()
            assert stopped == [True]
            assert not await _answers(private)
            await start_redis(port, tmp_path)
            results = await reader.read_many([batch, urgent], wait_s=60)
        assert_exact(results[batch], "keep going ", 100)
        assert_exact(results[urgent], "first ", 4)
        assert service.metrics.resumed._value.get() >= 1
    finally:
        await private.aclose()
        await run("redis-cli", "-p", str(port), "shutdown", "nosave")


async def _answers(client: Any) -> bool:
    try:
        await client.ping()
    except Exception:
        return False
    return True
