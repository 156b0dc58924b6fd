"""WORKER_STREAM_COMPACT_AFTER_S: a finished stream is trimmed to its terminal entry
(which holds the whole text) that long after it ends; the TTL applies either way."""

from __future__ import annotations

import signal
import uuid

import redis.asyncio as aioredis

from tests.integration.conftest import Producer, Spawn, Subscriber, WorkerFactory, terminal
from tests.integration.test_faults import echo, wait_until
from trtllm_worker.config import Settings
from trtllm_worker.connect.redis import redis_client
from trtllm_worker.streams.store import StreamStore


def rid() -> str:
    return f"cmp-{uuid.uuid4().hex[:10]}"


async def test_a_finished_stream_keeps_only_its_terminal_entry(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    redis_client: aioredis.Redis,
) -> None:
    request_id, prompt = rid(), "compact me "
    key = subscriber.key(request_id)
    async with run_worker(stream_compact_after_s=0.3, stream_ttl_s=600):
        await producer.publish(
            {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": 40}}
        )
        live = await subscriber.read_until_terminal(request_id)
        assert len(live) == 41, "a subscriber reading while it runs gets every entry"

        async def compacted() -> bool:
            return int(await redis_client.xlen(key)) == 1

        await wait_until(compacted, within_s=10)
    late = await subscriber.read_until_terminal(request_id)
    assert late == [terminal(live)], "a late subscriber gets the terminal entry"
    assert late[0]["generated_text"] == echo(prompt, 40) == terminal(live)["generated_text"]
    assert 0 < int(await redis_client.ttl(key)) <= 600, "the TTL still applies"


async def test_a_worker_that_dies_before_compacting_leaves_the_ttl(
    spawn: Spawn, producer: Producer, subscriber: Subscriber, redis_client: aioredis.Redis
) -> None:
    request_id, prompt = rid(), "whole "
    key = subscriber.key(request_id)
    worker = await spawn(WORKER_STREAM_COMPACT_AFTER_S="3600", WORKER_STREAM_TTL_S="120")
    await producer.publish(
        {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": 20}}
    )
    await subscriber.read_until_terminal(request_id)
    worker.signal(signal.SIGKILL)
    assert await worker.wait() == -signal.SIGKILL
    assert int(await redis_client.xlen(key)) == 21, "not compacted: the stream is whole"
    assert 0 < int(await redis_client.ttl(key)) <= 120, "and expires with its TTL"


async def test_compact_leaves_a_stream_that_has_not_ended(
    make_settings: type[Settings], subscriber: Subscriber, redis_client: aioredis.Redis
) -> None:
    """A stream whose last entry is not terminal (it expired and a new job with the same
    id began) is not trimmed."""
    settings = make_settings()
    store = StreamStore(redis_client_for(settings), ttl_s=60)
    running, ended = subscriber.key(rid()), subscriber.key(rid())
    try:
        for key in (running, ended):
            await redis_client.xadd(key, {"event": "token", "index": 0, "text": "a"}, id="0-1")
            await redis_client.xadd(key, {"event": "token", "index": 1, "text": "b"}, id="0-2")
        await redis_client.xadd(ended, {"event": "done", "generated_text": "ab"}, id="0-3")
        assert await store.compact([running, ended]) == 2
        assert int(await redis_client.xlen(running)) == 2
        assert [e["event"] for e in await subscriber.entries(ended[len(subscriber.prefix) :])] == [
            "done"
        ]
    finally:
        await store.close()


def redis_client_for(settings: Settings) -> aioredis.Redis:
    return redis_client(settings.redis_url, client_name="test")
