"""The worker, the SDK and `check` on a real local Redis Cluster (three masters): the
worker is given one node's URL, finds the cluster, and every request's keys (stream,
lease, cancel mark) live in its stream's hash slot, so no request is refused with
MOVED or CROSSSLOT and none ends as a dead letter for it."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable
from typing import Any, cast

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from tests.cluster.conftest import LocalCluster, read_stream, redis_cli
from tests.integration.conftest import Producer, Spawn, WorkerFactory
from trtllm_worker.client import Client
from trtllm_worker.config import Settings
from trtllm_worker.contract.stream import Fields, lease_key

pytestmark = pytest.mark.cluster


def rid() -> str:
    return f"rc-{uuid.uuid4().hex[:10]}"


async def has_entries(client: RedisCluster, key: str, count: int) -> bool:
    return int(await client.xlen(key)) >= count


def texts(entries: list[dict[str, str]]) -> str:
    return "".join(e["text"] for e in entries if e["event"] == "token")


async def test_jobs_across_every_master(
    redis_cluster: LocalCluster,
    cluster_client: RedisCluster,
    run_worker: WorkerFactory,
    producer: Producer,
    names: dict[str, str],
) -> None:
    prefix = names["stream_prefix"]
    jobs = {rid(): f"prompt {n} " for n in range(40)}
    nodes = {getattr(cluster_client.get_node_from_key(prefix + r), "port", None) for r in jobs}
    assert len(nodes) == 3, "test data: the streams must spread over every master"
    async with run_worker(redis_url=redis_cluster.url, echo_step_ms=2) as worker:
        assert worker._store is not None
        assert worker._store.cluster
        for request_id, prompt in jobs.items():
            await producer.publish(
                {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": 30}}
            )
        results = {r: await read_stream(cluster_client, prefix + r) for r in jobs}
    for request_id, entries in results.items():
        done = entries[-1]
        assert done["event"] == "done", done
        assert [int(e["index"]) for e in entries[:-1]] == list(range(30))
        assert texts(entries) == done["generated_text"]
        key = prefix + request_id
        assert key_slot(lease_key(key).encode()) == key_slot(key.encode())
        assert await cluster_client.ttl(key) > 0


async def test_cancel_deadline_and_dead_letter_on_the_cluster(
    redis_cluster: LocalCluster,
    cluster_client: RedisCluster,
    run_worker: WorkerFactory,
    producer: Producer,
    names: dict[str, str],
) -> None:
    prefix = names["stream_prefix"]
    cancelled, late, invalid, early = rid(), rid(), rid(), rid()
    async with run_worker(redis_url=redis_cluster.url, echo_step_ms=5):
        await producer.cancel(early)  # before any worker took it: the mark in its slot
        await producer.publish({"request_id": early, "inputs": "never"})
        await producer.publish(
            {"request_id": cancelled, "inputs": "abc", "parameters": {"max_new_tokens": 2000}}
        )
        await producer.publish(
            {"request_id": late, "inputs": "x", "deadline": "2001-01-01T00:00:00Z"}
        )
        await producer.publish({"request_id": invalid, "inputs": "x", "colour": "red"})
        while not await cluster_client.xlen(prefix + cancelled):
            pass
        await producer.cancel(cancelled)
        ended = await read_stream(cluster_client, prefix + cancelled)
        before = await read_stream(cluster_client, prefix + early)
        deadline = await read_stream(cluster_client, prefix + late)
        error = await read_stream(cluster_client, prefix + invalid)
        dead = await producer.get_dead()
    assert ended[-1].get("finish_reason") == "cancelled", ended[-1]
    assert (before[-1]["finish_reason"], before[-1]["generated_tokens"]) == ("cancelled", "0")
    assert deadline[-1]["code"] == "deadline_exceeded"
    assert error[-1]["code"] == "invalid_request"
    assert dead.headers is not None
    assert dead.headers["x-error-code"] == "invalid_request"


async def test_resume_after_kill_9_on_the_cluster(
    redis_cluster: LocalCluster,
    cluster_client: RedisCluster,
    spawn: Spawn,
    producer: Producer,
    names: dict[str, str],
) -> None:
    request_id, prompt, n = rid(), "Resume on a cluster. ", 300
    key = names["stream_prefix"] + request_id
    first = await spawn(WORKER_ECHO_STEP_MS="10", WORKER_REDIS_URL=redis_cluster.url)
    await producer.publish(
        {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": n}}
    )
    while await cluster_client.xlen(key) < 30:
        pass
    first.signal(signal.SIGKILL)
    assert await first.wait() == -signal.SIGKILL
    stored = cast(list[tuple[str, dict[str, str]]], await cluster_client.xrange(key))
    partial = [fields for _, fields in stored]
    assert partial
    assert partial[-1]["event"] == "token"
    await spawn(WORKER_ECHO_STEP_MS="1", WORKER_REDIS_URL=redis_cluster.url)
    entries = await read_stream(cluster_client, key, wait_s=60)
    assert [int(e["index"]) for e in entries[:-1]] == list(range(n))
    assert entries[: len(partial)] == partial
    assert texts(entries) == entries[-1]["generated_text"] == (prompt * n)[:n]


async def test_the_sdk_on_the_cluster(
    redis_cluster: LocalCluster,
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings(redis_url=redis_cluster.url)
    async with run_worker(redis_url=redis_cluster.url), Client(settings) as client:
        done = await client.generate("hello", {"max_new_tokens": 7})
        request_id = await client.submit("abc", {"max_new_tokens": 2000})
        events: list[Any] = []
        async for event in client.stream(request_id):
            events.append(event)
            if len(events) == 3:
                await client.cancel(request_id)
    assert done.generated_text == "hellohe"
    assert events[-1].finish_reason == "cancelled"


async def test_check_finds_the_cluster(
    redis_cluster: LocalCluster,
    make_settings: Callable[..., Settings],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from trtllm_worker.app.check import Report, _check_redis

    report = Report()
    await _check_redis(make_settings(redis_url=redis_cluster.url), report)
    out = capsys.readouterr().out
    assert report.problems == 0, out
    assert "(Redis Cluster)" in out


def test_a_stream_prefix_with_braces_is_refused() -> None:
    """Braces in the prefix would make it the hash tag and put every request's keys in
    one slot, or split a request's keys from its stream's slot."""
    from trtllm_worker.config import load_settings
    from trtllm_worker.contract.errors import ConfigError

    with pytest.raises(ConfigError, match="WORKER_STREAM_PREFIX"):
        load_settings(stream_prefix="{gen}:")


async def test_min_replicas_is_refused_on_a_cluster(cluster_client: RedisCluster) -> None:
    """WAIT would have to go to every node a batch wrote to: not supported yet, and
    refused rather than ignored."""
    from trtllm_worker.contract.errors import ConfigError
    from trtllm_worker.streams.store import StreamStore

    with pytest.raises(ConfigError, match="WORKER_REDIS_MIN_REPLICAS"):
        StreamStore(cluster_client, ttl_s=60, min_replicas=1)


async def test_a_batch_for_a_slot_moved_behind_the_client_s_back_lands(
    redis_cluster: LocalCluster, names: dict[str, str]
) -> None:
    """Batches go straight to the node the client's slot map names; when that map is
    stale (a slot moved since), the node answers MOVED and the batch goes again through
    redis-py's cluster pipeline, which follows it. The batch lands on the slot's new
    node, and the client's map is corrected."""
    from trtllm_worker.connect.redis import connect_redis
    from trtllm_worker.streams.store import StreamStore
    from trtllm_worker.streams.wire import WriteBatch

    client = cast(RedisCluster, await connect_redis(redis_cluster.url, client_name="test"))
    store = StreamStore(client, ttl_s=60)
    while True:  # a slot no earlier test left keys in: only an empty slot can be moved
        keys = [names["stream_prefix"] + rid() for _ in range(12)]
        slot = key_slot(keys[0].encode())
        old = int(client.nodes_manager.get_node_from_slot(slot).port)
        if redis_cli(old, "cluster", "countkeysinslot", str(slot)).strip() == "0":
            break
    new = next(p for p in redis_cluster.ports if p != old)
    ids = {p: redis_cluster_id(p) for p in redis_cluster.ports}
    fields: Fields = {"event": "token", "index": 0, "token_id": 97, "text": "a"}
    batch = [(key, "0-1", fields) for key in keys]
    try:
        for port in redis_cluster.ports:  # an empty slot moves with one command per node
            redis_cli_ok(port, "cluster", "setslot", str(slot), "node", ids[new])
        assert client.nodes_manager.get_node_from_slot(slot).port == old, "map stale"
        assert await store.write(WriteBatch.of_entries(batch, {}, cluster=True)) == {}
        assert client.nodes_manager.get_node_from_slot(slot).port == new, "map corrected"
        assert redis_cli(new, "xlen", keys[0]).strip() == "1", "on the slot's new node"
        for key in keys:
            assert int(await client.xlen(key)) == 1
    finally:
        await client.delete(*keys)
        for port in redis_cluster.ports:
            redis_cli_ok(port, "cluster", "setslot", str(slot), "node", ids[old])
        await client.aclose()


def redis_cluster_id(port: int) -> str:
    return redis_cli(port, "cluster", "myid").strip()


def redis_cli_ok(port: int, *args: str) -> None:
    assert redis_cli(port, *args).strip() == "OK", args


def evalsha_calls(port: int) -> int:
    """How many EVALSHA calls the node has run (INFO commandstats)."""
    for line in redis_cli(port, "info", "commandstats").splitlines():
        if line.startswith("cmdstat_evalsha:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


async def test_a_batch_is_one_call_per_node(
    redis_cluster: LocalCluster, names: dict[str, str]
) -> None:
    """A step of many streams, each in a slot of its own, goes to each master as one
    script call (one per stream would cost a reply and a script run per stream), and
    every entry lands in its stream, in order, with its lease honoured."""
    from trtllm_worker.connect.redis import connect_redis
    from trtllm_worker.streams.store import StreamStore
    from trtllm_worker.streams.wire import WriteBatch

    client = cast(RedisCluster, await connect_redis(redis_cluster.url, client_name="test"))
    store = StreamStore(client, ttl_s=60)
    keys = [names["stream_prefix"] + rid() for _ in range(60)]
    nodes = {int(client.nodes_manager.get_node_from_slot(key_slot(k.encode())).port) for k in keys}
    assert nodes == set(redis_cluster.ports), "test data: streams on every master"
    try:
        for key in keys:
            assert await store.start(key, "mine") is not None
        await store.write(WriteBatch.of_entries([], {}, cluster=True))  # nothing: no call
        token: Fields = {"event": "token", "index": 0, "token_id": 97, "text": "a"}
        second: Fields = {"event": "token", "index": 1, "token_id": 98, "text": "b"}
        entries = [(key, "0-1", token) for key in keys] + [(key, "0-2", second) for key in keys]
        batch = WriteBatch.of_entries(entries, dict.fromkeys(keys, "mine"), cluster=True)
        await store.write(WriteBatch.of_entries(entries[:1], {keys[0]: "mine"}, cluster=True))
        before = {port: evalsha_calls(port) for port in redis_cluster.ports}  # script loaded
        assert await store.write(batch) == {}
        after = {port: evalsha_calls(port) for port in redis_cluster.ports}
        assert {port: after[port] - before[port] for port in after} == dict.fromkeys(
            redis_cluster.ports, 1
        )
        for key in keys:
            stored = cast(list[tuple[bytes, dict[bytes, bytes]]], await client.xrange(key))
            assert [(i, f[b"index"], f[b"text"]) for i, f in stored] == [
                (b"0-1", b"0", b"a"), (b"0-2", b"1", b"b")
            ]  # fmt: skip
        refused = await store.write(
            WriteBatch.of_entries([(keys[1], "0-3", token)], {keys[1]: "stale"}, cluster=True)
        )
        assert refused[keys[1]].startswith("the lease was lost")
    finally:
        await client.delete(*keys, *(lease_key(k) for k in keys))
        await client.aclose()


async def test_usage_is_counted_in_each_streams_slot_and_summed_over_every_master(
    redis_cluster: LocalCluster,
    cluster_client: RedisCluster,
    run_worker: WorkerFactory,
    producer: Producer,
    names: dict[str, str],
) -> None:
    """Each terminal entry counts into a usage key of its stream's own slot (a script may
    touch one slot only); the SDK's reader sums the keys of every master."""
    from trtllm_worker.streams.usage import usage_day

    prefix = names["stream_prefix"]
    jobs = {rid(): ("even" if n % 2 else None) for n in range(30)}
    async with run_worker(redis_url=redis_cluster.url, echo_step_ms=1) as worker:
        for request_id, tenant in jobs.items():
            body: dict[str, Any] = {"request_id": request_id, "inputs": "abc"}
            body["parameters"] = {"max_new_tokens": 4}
            if tenant:
                body["tenant"] = tenant
            await producer.publish(body)
        for request_id in jobs:
            assert (await read_stream(cluster_client, prefix + request_id))[-1]["event"] == "done"
        settings = worker.settings
    keys = [
        str(k)
        async for k in cluster_client.scan_iter(
            match=prefix + "_usage:*", target_nodes=RedisCluster.PRIMARIES
        )
    ]
    slots = {key_slot((prefix + r).encode()) for r in jobs}
    assert {key_slot(k.encode()) for k in keys} == slots
    assert all(usage_day(prefix, k) for k in keys)
    try:
        async with Client(settings) as client:
            usage = await client.usage()
        assert [(u.tenant, u.jobs, u.input_tokens, u.generated_tokens) for u in usage] == [
            ("-", 15, 45, 60),
            ("even", 15, 45, 60),
        ]
    finally:
        await cluster_client.delete(*keys)
