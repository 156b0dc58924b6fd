"""Batches on a real local Redis Cluster (three masters): a line's side key and its
batch's counters live in its stream's hash slot, one counters hash per slot, and the
reader sums them. Checked: the Batch object's counts are those sums over lines spread
across every master, the results come in input order with each line once, a cancel ends
every line `batch_cancelled`, and once a batch ends every key of it lives
`WORKER_BATCH_TTL_S` more."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
from openai.types import Batch
from openai.types.completion import Completion
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from tests.cluster.conftest import LocalCluster
from tests.integration.conftest import WorkerFactory
from trtllm_worker.client import Client
from trtllm_worker.config import Settings
from trtllm_worker.contract.batches import (
    batch_key,
    counts_key,
    invalid_key,
    line_key,
    line_request_id,
)
from trtllm_worker.contract.stream import stream_key
from trtllm_worker.streams.usage import slot_tags

pytestmark = pytest.mark.cluster

BATCH_TTL_S = 4321
"""Distinct from the stream TTL and from any completion window, so a key's TTL says
which expiry set it."""
STREAM_TTL_S = 777
WINDOW = "2h"


def completion_line(custom_id: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "echo", "prompt": prompt, "max_tokens": max_tokens},
    }


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def node_of(cluster: RedisCluster, key: str) -> int | None:
    return cast(int | None, getattr(cluster.get_node_from_key(key), "port", None))


async def slot_counters(
    cluster: RedisCluster, prefix: str, batch_id: str, total: int
) -> dict[str, dict[str, int]]:
    """Per counters key of the batch's lines' slots (read straight from the cluster),
    its fields; the keys that do not exist are left out."""
    tags = sorted(
        {
            slot_tags()[key_slot(stream_key(prefix, line_request_id(batch_id, i)).encode())]
            for i in range(total)
        }
    )
    found: dict[str, dict[str, int]] = {}
    for tag in tags:
        key = counts_key(prefix, batch_id, tag)
        fields = cast(dict[str, str], await cluster.hgetall(key))
        if fields:
            found[key] = {name: int(value) for name, value in fields.items()}
    return found


async def batch_keys(
    cluster: RedisCluster, prefix: str, batch_id: str, total: int, invalid: set[int]
) -> list[str]:
    """Every key of the batch: its hash, its refusals, its counters, its lines' records."""
    counters = await slot_counters(cluster, prefix, batch_id, total)
    keys = [batch_key(prefix, batch_id), *counters]
    if invalid:
        keys.append(invalid_key(prefix, batch_id))
    keys += [
        line_key(stream_key(prefix, line_request_id(batch_id, i)))
        for i in range(total)
        if i not in invalid
    ]
    return keys


async def assert_kept_batch_ttl(
    cluster: RedisCluster, prefix: str, batch_id: str, total: int, invalid: set[int]
) -> None:
    keys = await batch_keys(cluster, prefix, batch_id, total, invalid)
    ttls = {key: int(await cluster.ttl(key)) for key in keys}
    wrong = {key: ttl for key, ttl in ttls.items() if not BATCH_TTL_S - 60 <= ttl <= BATCH_TTL_S}
    assert not wrong, f"{len(wrong)} of {len(keys)} batch keys: {list(wrong.items())[:5]}"


async def test_a_batch_across_every_master(
    redis_cluster: LocalCluster,
    cluster_client: RedisCluster,
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    names: dict[str, str],
    tmp_path: Path,
    amqp_channel: object,  # deletes the test's queues after
) -> None:
    prefix = names["stream_prefix"]
    total, tokens = 300, 5
    lines = [completion_line(f"line-{i}", f"p{i} ", tokens) for i in range(total)]
    invalid = {7, 150}  # refused by submit: never run, still one error line each
    for i in invalid:
        lines[i]["body"]["n"] = 2
    source = write_lines(tmp_path / "in.jsonl", lines)
    settings = make_settings(
        redis_url=redis_cluster.url, batch_ttl_s=BATCH_TTL_S, stream_ttl_s=STREAM_TTL_S
    )
    async with (
        run_worker(redis_url=redis_cluster.url, echo_step_ms=0) as worker,
        Client(settings) as client,
    ):
        assert worker._store is not None
        assert worker._store.cluster
        batch_id = await client.submit_batch(source, completion_window=WINDOW)
        # the lines really spread: over many slots, on every master
        streams = [stream_key(prefix, line_request_id(batch_id, i)) for i in range(total)]
        assert len({key_slot(s.encode()) for s in streams}) > 250
        assert {node_of(cluster_client, s) for s in streams} == set(redis_cluster.ports)
        async with asyncio.timeout(120):
            final = await client.wait_batch(batch_id, poll_s=0.1)
        again = await client.batch(batch_id)
        out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
        assert await client.write_batch_results(batch_id, out, err) == (total - 2, 2)
    batch = Batch.model_validate(final)
    assert batch.status == "completed", final
    assert batch.request_counts is not None
    counts = (batch.request_counts.total, batch.request_counts.completed,
              batch.request_counts.failed)  # fmt: skip
    assert counts == (total, total - 2, 2)
    assert again == final  # a read after the end changes nothing

    # the Batch object's counts are the sums of the per-slot counters, which are
    # spread over many slots on every master
    counters = await slot_counters(cluster_client, prefix, batch_id, total)
    assert sum(c.get("ok", 0) for c in counters.values()) == batch.request_counts.completed
    assert sum(c.get("err", 0) for c in counters.values()) == 0  # the 2 refused: not run
    assert len(counters) > 100
    assert {node_of(cluster_client, key) for key in counters} == set(redis_cluster.ports)
    for key in counters:  # each counters key in the slot of one of its lines
        assert key_slot(key.encode()) in {key_slot(s.encode()) for s in streams}

    # results: input order, each line once, each its own text
    output, errors = read_jsonl(out), read_jsonl(err)
    expected = [f"line-{i}" for i in range(total) if i not in invalid]
    assert [line["custom_id"] for line in output] == expected
    assert len({line["id"] for line in output + errors}) == total
    for line in output:
        i = int(line["custom_id"].removeprefix("line-"))
        assert line["response"]["request_id"] == line_request_id(batch_id, i)
        completion = Completion.model_validate(line["response"]["body"])
        assert completion.usage is not None
        assert completion.usage.completion_tokens == tokens
        assert completion.choices[0].text == (f"p{i} " * tokens)[:tokens]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (f"line-{i}", "invalid_request") for i in sorted(invalid)
    ]
    await assert_kept_batch_ttl(cluster_client, prefix, batch_id, total, invalid)


async def test_cancel_a_batch_on_the_cluster(
    redis_cluster: LocalCluster,
    cluster_client: RedisCluster,
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    names: dict[str, str],
    tmp_path: Path,
    amqp_channel: object,  # deletes the test's queues after
) -> None:
    prefix = names["stream_prefix"]
    total = 60
    lines = [completion_line(f"slow-{i}", "slow ", 2000) for i in range(total)]
    source = write_lines(tmp_path / "slow.jsonl", lines)
    settings = make_settings(
        redis_url=redis_cluster.url, batch_ttl_s=BATCH_TTL_S, stream_ttl_s=STREAM_TTL_S
    )
    async with (
        # 8 lines at a time: the cancel meets running lines and queued ones
        run_worker(redis_url=redis_cluster.url, echo_step_ms=20, max_batch=8),
        Client(settings) as client,
    ):
        batch_id = await client.submit_batch(source, completion_window=WINDOW)
        streams = [stream_key(prefix, line_request_id(batch_id, i)) for i in range(total)]
        assert {node_of(cluster_client, s) for s in streams} == set(redis_cluster.ports)
        async with asyncio.timeout(30):  # some lines running (token entries), so the
            while True:  # cancel meets both running and queued lines
                started = [s for s in streams if await cluster_client.xlen(s)]
                if len(started) >= 2:
                    break
                await asyncio.sleep(0.05)
        cancelling = await client.cancel_batch(batch_id)
        assert cancelling["status"] in ("cancelling", "cancelled")
        async with asyncio.timeout(60):
            final = await client.wait_batch(batch_id, poll_s=0.1)
        out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
        assert await client.write_batch_results(batch_id, out, err) == (0, total)
    batch = Batch.model_validate(final)
    assert batch.status == "cancelled", final
    assert batch.cancelled_at is not None
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (0, total)
    counters = await slot_counters(cluster_client, prefix, batch_id, total)
    assert sum(c.get("err", 0) for c in counters.values()) == total
    assert sum(c.get("cancelled", 0) for c in counters.values()) == total
    assert {node_of(cluster_client, key) for key in counters} == set(redis_cluster.ports)
    lengths = [int(await cluster_client.xlen(s)) for s in streams]
    assert any(n > 1 for n in lengths)  # stopped by the worker, after some tokens
    assert lengths.count(1) > total // 2  # ended before any worker started them
    assert read_jsonl(out) == []
    errors = read_jsonl(err)
    assert [e["custom_id"] for e in errors] == [f"slow-{i}" for i in range(total)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    await assert_kept_batch_ttl(cluster_client, prefix, batch_id, total, set())
