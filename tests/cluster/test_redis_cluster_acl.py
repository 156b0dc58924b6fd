"""The grants of `trtllm-worker acl` on a real Redis Cluster: every node has the ACL
users, the worker finds the cluster, writes one call per node and ends every job as
its own user; a subscriber reads as its own, and may not write."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError

from tests.cluster.conftest import LocalCluster, read_stream, redis_cli
from tests.integration.conftest import Producer, WorkerFactory
from tests.integration.test_grants import acl_json
from trtllm_worker.connect.redis import QUIET_HANDSHAKE

pytestmark = pytest.mark.cluster


@pytest.fixture
def cluster_users(redis_cluster: LocalCluster, names: dict[str, str]) -> Iterator[dict[str, str]]:
    """The `--json` users on every node of the shared cluster (removed after); their
    passwords."""
    grants = acl_json(names)
    passwords = {role: secrets.token_hex(12) for role in grants["redis"]}
    for port in redis_cluster.ports:
        for role, rules in grants["redis"].items():
            rules = [f">{passwords[role]}" if r == ">PASSWORD" else r for r in rules]
            assert redis_cli(port, "ACL", "SETUSER", role, *rules).strip() == "OK"
    try:
        yield passwords
    finally:
        for port in redis_cluster.ports:
            redis_cli(port, "ACL", "DELUSER", *grants["redis"])


async def test_worker_and_subscriber_under_their_grants_on_the_cluster(
    redis_cluster: LocalCluster,
    cluster_users: dict[str, str],
    cluster_client: RedisCluster,
    run_worker: WorkerFactory,
    producer: Producer,
    names: dict[str, str],
) -> None:
    prefix = names["stream_prefix"]
    node = redis_cluster.ports[0]
    worker_url = f"redis://trtllm-worker:{cluster_users['trtllm-worker']}@127.0.0.1:{node}/0"
    reader_url = (
        f"redis://trtllm-subscriber:{cluster_users['trtllm-subscriber']}@127.0.0.1:{node}/0"
    )
    jobs = [f"acl-{uuid.uuid4().hex[:10]}" for _ in range(30)]
    masters = {getattr(cluster_client.get_node_from_key(prefix + r), "port", None) for r in jobs}
    assert len(masters) == 3, "test data: the streams must spread over every master"
    refusals_before = noperm(redis_cluster)
    reader = RedisCluster.from_url(reader_url, decode_responses=True, **QUIET_HANDSHAKE)
    try:
        await reader.initialize()
        async with run_worker(redis_url=worker_url, echo_step_ms=2) as worker:
            assert worker._store is not None
            assert worker._store.cluster
            for request_id in jobs:
                await producer.publish(
                    {"request_id": request_id, "inputs": "acl ", "parameters": {
                        "max_new_tokens": 20}}
                )  # fmt: skip
            results = [await read_stream(reader, prefix + r) for r in jobs]
        for entries in results:
            assert entries[-1]["event"] == "done", entries[-1]
            assert entries[-1]["generated_text"] == ("acl " * 5)
        # nothing was refused on the way (a refused per-node call would have been
        # retried per slot, silently)
        assert noperm(redis_cluster) == refusals_before, [
            redis_cli(p, "ACL", "LOG") for p in redis_cluster.ports
        ]
        with pytest.raises(NoPermissionError):
            await reader.xadd(prefix + jobs[0], {"event": "token"})
    finally:
        await reader.aclose()


def noperm(cluster: LocalCluster) -> int:
    """ACL refusals all nodes have answered so far (`INFO errorstats`)."""
    total = 0
    for port in cluster.ports:
        for line in redis_cli(port, "INFO", "errorstats").splitlines():
            if line.startswith("errorstat_NOPERM:count="):
                total += int(line.split("=")[1].split(",")[0])
    return total
