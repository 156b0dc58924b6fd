"""The grants of `trtllm-worker acl` on a real Redis Cluster: every node has the ACL
users, the worker finds the cluster, writes one call per node and ends every job as
its own user; a subscriber reads as its own, and may not write; the gateway answers,
runs a batch and serves its files as its own."""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError

from tests.cluster.conftest import LocalCluster, read_stream, redis_cli
from tests.integration.conftest import GatewayFactory, Producer, WorkerFactory
from tests.integration.test_grants import acl_json
from trtllm_worker.connect.redis import QUIET_HANDSHAKE

pytestmark = pytest.mark.cluster

MODEL = "tiny-echo"


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


async def test_the_gateway_under_its_grants_on_the_cluster(
    redis_cluster: LocalCluster,
    cluster_users: dict[str, str],
    run_worker: WorkerFactory,
    run_gateway: GatewayFactory,
    names: dict[str, str],
    tmp_path: Path,
) -> None:
    """A gateway as trtllm-gateway on every node (its keys in many slots): ready (its
    grants probe passed), a streamed answer, a batch uploaded, run and read back through
    the Files API, another cancelled with every line queued (the gateway ends them with
    the write script); no node refused anything on the way."""
    node = redis_cluster.ports[0]
    worker_url = f"redis://trtllm-worker:{cluster_users['trtllm-worker']}@127.0.0.1:{node}/0"
    gateway_url = f"redis://trtllm-gateway:{cluster_users['trtllm-gateway']}@127.0.0.1:{node}/0"
    refusals_before = noperm(redis_cluster)
    lines = "".join(
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": MODEL, "prompt": f"line {i} ", "max_tokens": 4}}) + "\n"
        for i in range(12)
    )  # fmt: skip
    source = tmp_path / "in.jsonl"
    source.write_text(lines)
    async with (
        run_gateway(redis_url=gateway_url, model_name=MODEL) as gateway,
        httpx.AsyncClient(base_url=gateway.url) as http,
        openai.AsyncOpenAI(base_url=gateway.base_url, api_key="none", max_retries=0) as client,
    ):
        ready = await http.get("/readyz")
        assert ready.text == "ready\n"
        with source.open("rb") as file:
            uploaded = await client.files.create(file=file, purpose="batch")
        async with run_worker(redis_url=worker_url, model_name=MODEL, echo_step_ms=0):
            chunks = await client.completions.create(
                model=MODEL, prompt="abcdef", max_tokens=6, stream=True
            )
            text = "".join([c.choices[0].text async for c in chunks if c.choices])
            assert text == "abcdef"
            batch = await until(client, "completed", await client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
            ))  # fmt: skip
        assert batch.output_file_id is not None
        output = (await client.files.content(batch.output_file_id)).text.splitlines()
        assert [json.loads(line)["custom_id"] for line in output] == [f"c{i}" for i in range(12)]
        # no worker now: the cancel ends every queued line itself (the write script)
        queued = await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        await client.batches.cancel(queued.id)
        cancelled = await until(client, "cancelled", queued)
        assert cancelled.request_counts is not None
        assert cancelled.request_counts.failed == 12
        assert (await client.files.delete(uploaded.id)).deleted
    assert noperm(redis_cluster) == refusals_before, [
        redis_cli(p, "ACL", "LOG") for p in redis_cluster.ports
    ]


async def until(
    client: openai.AsyncOpenAI, status: str, batch: openai.types.Batch
) -> openai.types.Batch:
    """The batch once it reaches `status` (each status read may move it on)."""
    async with asyncio.timeout(60):
        while batch.status != status:
            assert batch.status in ("validating", "in_progress", "finalizing", "cancelling"), batch
            await asyncio.sleep(0.1)
            batch = await client.batches.retrieve(batch.id)
    return batch
