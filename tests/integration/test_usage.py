"""Per-tenant usage against the real services: each job is counted once, with its
terminal entry, however often its message is delivered; the SDK reads the counts back."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tests.integration.conftest import Producer, Spawn, Subscriber, WorkerFactory, terminal
from tests.integration.test_faults import wait_for_entries
from tests.integration.test_resume import store_tokens
from tests.lora_fixtures import write_adapter
from tests.services import ServiceUrls
from trtllm_worker.client import Client, Usage
from trtllm_worker.config import Settings
from trtllm_worker.connect.redis import connect_redis
from trtllm_worker.contract.stream import Fields, error_fields
from trtllm_worker.streams.store import Ended, StreamStore
from trtllm_worker.streams.usage import usage_key, utc_day
from trtllm_worker.streams.wire import Entry, WriteBatch


def rid() -> str:
    return f"use-{uuid.uuid4().hex[:10]}"


def job(request_id: str, prompt: str, n: int, **fields: Any) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "inputs": prompt,
        "parameters": {"max_new_tokens": n},
        **fields,
    }


async def usage_of(settings: Settings, **query: Any) -> list[Usage]:
    async with Client(settings) as client:
        return await client.usage(**query)


def today(usage: list[Usage]) -> list[tuple[str, int, int, int]]:
    """The rows as (tenant, jobs, input, generated), all of one UTC day: today's (a test
    that runs over midnight may see yesterday's date)."""
    assert {u.day for u in usage} <= {utc_day(), utc_day(time.time() - 86400)}
    return [(u.tenant, u.jobs, u.input_tokens, u.generated_tokens) for u in usage]


async def test_a_job_is_counted_under_its_tenant_and_one_without_as_dash(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    make_settings: Callable[..., Settings],
) -> None:
    first, second, third = rid(), rid(), rid()
    async with run_worker(max_batch=1):
        await producer.publish(job(first, "abc", 5, tenant="acme"))
        await producer.publish(job(second, "hello", 7, tenant="acme"))
        await producer.publish(job(third, "xy", 4))
        await subscriber.read_many([first, second, third])
    settings = make_settings()
    assert today(await usage_of(settings)) == [("-", 1, 2, 4), ("acme", 2, 8, 12)]
    assert today(await usage_of(settings, tenant="acme")) == [("acme", 2, 8, 12)]
    tomorrow = date.fromisoformat(utc_day(time.time() + 86400))
    assert await usage_of(settings, since=tomorrow) == []
    assert today(await usage_of(settings, since=tomorrow - timedelta(days=1)))
    # another deployment on the same Redis (its own prefix) counts apart
    assert await usage_of(settings.model_copy(update={"stream_prefix": rid() + ":"})) == []


async def test_a_duplicate_message_is_counted_once(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    make_settings: Callable[..., Settings],
) -> None:
    request_id, marker = rid(), rid()
    async with run_worker(max_batch=1) as service:
        await producer.publish(job(request_id, "ab", 3, tenant="dup"))
        await subscriber.read_until_terminal(request_id)
        await producer.publish(job(request_id, "ab", 3, tenant="dup"))
        await producer.publish(job(marker, "z", 1, tenant="marker"))
        await subscriber.read_until_terminal(marker)  # one at a time: the copy went first
        assert service.metrics.jobs.labels(outcome="skipped")._value.get() == 1
    assert today(await usage_of(make_settings(), tenant="dup")) == [("dup", 1, 2, 3)]


async def test_a_job_redelivered_after_its_worker_died_is_counted_once(
    spawn: Spawn,
    producer: Producer,
    subscriber: Subscriber,
    make_settings: Callable[..., Settings],
) -> None:
    request_id, prompt, n = rid(), "Resume me ", 300
    first = await spawn(WORKER_ECHO_STEP_MS="10")
    await producer.publish(job(request_id, prompt, n, tenant="phoenix"))
    await wait_for_entries(subscriber, request_id, 40)
    first.signal(signal.SIGKILL)
    assert await first.wait() == -signal.SIGKILL
    await spawn(WORKER_ECHO_STEP_MS="1")
    entries = await subscriber.read_until_terminal(request_id, wait_s=60)
    assert terminal(entries)["generated_tokens"] == str(n)
    assert today(await usage_of(make_settings())) == [("phoenix", 1, len(prompt), n)]


async def test_a_job_resumed_at_its_end_is_counted_once_with_every_token(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    make_settings: Callable[..., Settings],
) -> None:
    """The first attempt stored all its tokens and died before the terminal entry: the
    resumed job ends at once (no engine) and counts the tokens the first one made."""
    request_id = rid()
    await store_tokens(subscriber, request_id, list("abcab"), [ord(c) for c in "abcab"])
    async with run_worker():
        await producer.publish(job(request_id, "abc", 5, tenant="late"))
        entries = await subscriber.read_until_terminal(request_id)
    assert terminal(entries)["generated_tokens"] == "5"
    assert today(await usage_of(make_settings())) == [("late", 1, 3, 5)]


async def test_error_ended_jobs_are_counted(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    make_settings: Callable[..., Settings],
) -> None:
    invalid, bad_tenant, too_long = rid(), rid(), rid()
    async with run_worker(max_input_tokens=8):
        await producer.publish(job(invalid, "abc", 0, tenant="oops"))  # max_new_tokens 0
        await producer.publish(job(bad_tenant, "abc", 3, tenant="no spaces here"))
        await producer.publish(job(too_long, "0123456789", 3, tenant="oops"))
        ended = await subscriber.read_many([invalid, bad_tenant, too_long])
    errors = {request_id: terminal(entries) for request_id, entries in ended.items()}
    assert errors[invalid]["code"] == "invalid_request"
    assert errors[bad_tenant]["code"] == "invalid_request"
    assert errors[bad_tenant]["message"].startswith("tenant:")
    assert errors[too_long]["code"] == "input_too_long"
    # errors before the engine count the job, no tokens; a malformed tenant counts as -
    assert today(await usage_of(make_settings())) == [("-", 1, 0, 0), ("oops", 2, 0, 0)]


async def test_usage_keys_expire_after_the_retention(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    redis_client: aioredis.Redis,
    names: dict[str, str],
) -> None:
    request_id = rid()
    async with run_worker(usage_ttl_s=4321):
        await producer.publish(job(request_id, "ab", 2))
        await subscriber.read_until_terminal(request_id)
    keys = [k async for k in redis_client.scan_iter(match=names["stream_prefix"] + "_usage:*")]
    assert len(keys) == 1
    assert keys[0] in (usage_key(names["stream_prefix"], utc_day()),
                       usage_key(names["stream_prefix"], utc_day(time.time() - 86400)))  # fmt: skip
    assert 4000 < await redis_client.ttl(keys[0]) <= 4321


async def test_a_stream_ended_already_or_a_retried_end_counts_nothing(
    services: ServiceUrls, names: dict[str, str], subscriber: Subscriber
) -> None:
    """The store's two paths to a terminal entry: `end` (settling, ending at once) and
    a batch (the pump). Each counts only when it stores the entry."""
    prefix = names["stream_prefix"]
    store = StreamStore(
        await connect_redis(services.redis, client_name="test"), ttl_s=60, prefix=prefix
    )
    try:
        key = prefix + rid()
        fields = error_fields("invalid_request", "bad")
        assert await store.end(key, fields, tenant="t") is Ended.STORED
        assert await store.end(key, fields, tenant="t") is Ended.ALREADY_ENDED
        other = prefix + rid()
        done: Fields = {"event": "done", "finish_reason": "length", "generated_tokens": 1,
                "input_tokens": 4, "generated_text": "a"}  # fmt: skip
        token: Fields = {"event": "token", "index": 0, "token_id": 97, "text": "a"}
        entries: list[Entry] = [(other, "0-1", token), (other, "0-2", done)]
        for _ in range(2):  # a batch sent again after a lost reply
            batch = WriteBatch.of_entries(entries, {}, usage=store.usage, tenants={other: "t"})
            assert await store.write(batch) == {}
        assert await store.end(other, fields, tenant="t") is Ended.ALREADY_ENDED
    finally:
        await store.close()
    async with Client(stream_prefix=prefix, redis_url=services.redis) as client:
        assert today(await client.usage()) == [("t", 2, 4, 1)]


async def test_a_lora_job_runs_and_is_counted_per_adapter_within_its_tenants_totals(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    make_settings: Callable[..., Settings],
    tmp_path: Path,
) -> None:
    """The echo engine checks the adapter and ignores it; the tenant's row keeps its
    totals and breaks them down per adapter; an unknown adapter is dead-lettered
    `invalid_request` naming `adapter`, counted under its tenant only."""
    write_adapter(tmp_path, "sql")
    write_adapter(tmp_path, "chat")
    first, second, third, unknown = rid(), rid(), rid(), rid()
    async with run_worker(max_batch=1, lora_dir=tmp_path):
        await producer.publish(job(first, "abc", 5, tenant="acme", adapter="sql"))
        await producer.publish(job(second, "hello", 7, tenant="acme", adapter="sql"))
        await producer.publish(job(third, "xy", 4, tenant="acme"))
        await producer.publish(job(unknown, "xy", 4, tenant="acme", adapter="nope"))
        streams = await subscriber.read_many([first, second, third, unknown])
        dead = await producer.get_dead()
    assert terminal(streams[first])["generated_text"] == "abcab"
    assert terminal(streams[unknown])["code"] == "invalid_request"
    assert str(terminal(streams[unknown])["message"]).startswith("adapter: unknown adapter")
    assert dead.headers["x-error-code"] == "invalid_request"
    assert str(dead.headers["x-error-message"]).startswith("adapter: ")
    (row,) = await usage_of(make_settings())
    # the totals as without adapters: 4 jobs, the refused one with no tokens
    assert (row.tenant, row.jobs, row.input_tokens, row.generated_tokens) == ("acme", 4, 10, 16)
    assert row.adapters == {"sql": {"jobs": 2, "input_tokens": 8, "generated_tokens": 12}}
    assert row.as_dict()["adapters"] == row.adapters
    assert "adapters" not in Usage("t", "2025-01-02", 1, 1, 1).as_dict()
