"""The gateway on a real local Redis Cluster (three masters): ready (its grants probe runs
on keys in several slots), an answer read from a stream on whichever master holds it,
and an uploaded file whose record, chunks and index live in
different hash slots: uploaded, listed, read back and deleted."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from tests.cluster.conftest import LocalCluster
from tests.integration.conftest import GatewayFactory, WorkerFactory
from trtllm_worker.contract.batches import file_data_key, file_index_key, file_key

pytestmark = pytest.mark.cluster

MODEL = "tiny-echo"


async def test_the_gateway_answers_and_keeps_files_on_a_cluster(
    redis_cluster: LocalCluster,
    cluster_client: RedisCluster,
    run_worker: WorkerFactory,
    run_gateway: GatewayFactory,
    names: dict[str, str],
    tmp_path: Path,
) -> None:
    prefix = names["stream_prefix"]
    async with (
        run_worker(redis_url=redis_cluster.url, model_name=MODEL, echo_step_ms=0),
        run_gateway(redis_url=redis_cluster.url, model_name=MODEL) as gateway,
    ):
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            ready = await http.get("/readyz")
        assert ready.text == "ready\n"
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
        try:
            answer = await client.completions.create(model=MODEL, prompt="abcdef", max_tokens=4)
            assert answer.choices[0].finish_reason == "length"
            assert answer.usage is not None
            assert answer.usage.completion_tokens == 4

            source = tmp_path / "in.jsonl"
            source.write_bytes(b'{"custom_id": "c0"}\n' * 1000)
            with source.open("rb") as file:
                uploaded = await client.files.create(file=file, purpose="batch")
            keys = [
                file_key(prefix, uploaded.id),
                file_data_key(prefix, uploaded.id),
                file_index_key(prefix),
            ]
            assert len({key_slot(key.encode()) for key in keys}) == 3, "one slot: no test"
            assert [await cluster_client.exists(key) for key in keys] == [1, 1, 1]
            assert [f.id async for f in client.files.list()] == [uploaded.id]
            assert (await client.files.content(uploaded.id)).content == source.read_bytes()
            assert (await client.files.delete(uploaded.id)).deleted
            assert [f.id async for f in client.files.list()] == []
            assert [await cluster_client.exists(key) for key in keys[:2]] == [0, 0]
        finally:
            await client.close()
