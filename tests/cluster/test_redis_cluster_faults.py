"""Redis Cluster reconfigured under a running worker: a master killed (its replica takes
over) and slots migrated with `redis-cli --cluster reshard`. Each test starts its own
cluster (the shared one is never broken) and asserts that the fault happened before it
asserts that every job completed, each index exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from tests.cluster.conftest import LocalCluster, assert_complete, local_cluster
from tests.integration.conftest import Producer, WorkerFactory

pytestmark = pytest.mark.cluster

TOKENS = 300
RESHARD_TOKENS = 600


def rid() -> str:
    return f"rf-{uuid.uuid4().hex[:10]}"


async def publish_jobs(producer: Producer, count: int, tokens: int = TOKENS) -> dict[str, str]:
    jobs = {rid(): f"job {n}. " for n in range(count)}
    for request_id, prompt in jobs.items():
        await producer.publish(
            {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": tokens}}
        )
    return jobs


async def wait_for_entries(client: RedisCluster, key: str, count: int) -> None:
    async with asyncio.timeout(30):
        while int(await client.xlen(key)) < count:
            pass  # each XLEN is a round trip: the worker runs meanwhile


def master_of(cluster: LocalCluster, key: str) -> int:
    """The port of the master serving `key`'s slot, as the cluster itself says."""
    slot = key_slot(key.encode())
    for port in cluster.ports:
        if slot in cluster.slots(port):
            return port
    raise AssertionError(f"no master serves slot {slot}")


async def test_a_master_killed_mid_run_its_replica_takes_over(
    tmp_path: Path, run_worker: WorkerFactory, producer: Producer, names: dict[str, str]
) -> None:
    prefix = names["stream_prefix"]
    with local_cluster(tmp_path, masters=3, replicas=1) as cluster:
        client = cluster.client()
        await client.initialize()
        try:
            async with run_worker(redis_url=cluster.url, echo_step_ms=4):
                jobs = await publish_jobs(producer, 24)
                # the node the worker was given is the one that dies
                victim = cluster.ports[0]
                on_victim = [r for r in jobs if master_of(cluster, prefix + r) == victim]
                assert on_victim, "test data: some streams must live on the victim"
                replica = cluster.replica_of(victim)
                await wait_for_entries(client, prefix + on_victim[0], 30)
                os.kill(cluster.pid(victim), signal.SIGKILL)
                assert not cluster.answers(victim), "the master did not go down"
                await asyncio.to_thread(cluster.wait_role, replica, "master")
                partial = int(await client.xlen(prefix + on_victim[0]))
                assert partial < TOKENS, "the job finished before its master was killed"
                await assert_complete(client, prefix, jobs, TOKENS)
        finally:
            await client.aclose()


async def test_slots_resharded_mid_run(
    tmp_path: Path, run_worker: WorkerFactory, producer: Producer, names: dict[str, str]
) -> None:
    prefix = names["stream_prefix"]
    with local_cluster(tmp_path, masters=3, replicas=0) as cluster:
        client = cluster.client()
        await client.initialize()
        try:
            # 600 tokens at 30 ms last 18 s: longer than moving a third of the slots (up
            # to 10 s on a loaded 2-core machine; with 300 tokens a CI run once finished
            # the jobs first, at 9.6 s)
            async with run_worker(redis_url=cluster.url, echo_step_ms=30):
                jobs = await publish_jobs(producer, 24, RESHARD_TOKENS)
                source = master_of(cluster, prefix + next(iter(jobs)))
                target = next(p for p in cluster.ports if p != source)
                moving = [r for r in jobs if master_of(cluster, prefix + r) == source]
                await wait_for_entries(client, prefix + moving[0], 30)
                started = time.monotonic()
                await asyncio.to_thread(cluster.reshard, source, target, 5461)
                took = time.monotonic() - started
                assert all(master_of(cluster, prefix + r) == target for r in moving), (
                    "the slots did not move"
                )
                partial = int(await client.xlen(prefix + moving[0]))
                assert partial < RESHARD_TOKENS, (
                    f"the job finished before its slots moved ({took:.1f} s)"
                )
                await assert_complete(client, prefix, jobs, RESHARD_TOKENS)
        finally:
            await client.aclose()


def test_reshard_helper_moves_every_slot_asked(tmp_path: Path) -> None:
    """The fault the resharding test depends on: `reshard` moves the slots it is asked."""
    with local_cluster(tmp_path, masters=3, replicas=0) as cluster:
        source, target = cluster.ports[0], cluster.ports[1]
        before = cluster.slot_count(source)
        cluster.reshard(source, target, 100)
        assert cluster.slot_count(source) == before - 100
        result = subprocess.run(
            ["redis-cli", "--cluster", "check", f"127.0.0.1:{source}"],
            capture_output=True,
            text=True,
        )
        assert "[OK] All 16384 slots covered." in result.stdout
