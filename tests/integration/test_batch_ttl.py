"""A batch that runs longer than `WORKER_BATCH_TTL_S`: the lines that ended early keep
their records and their counts until the batch ends (the TTL counts from the batch's
end, not from each line's)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from tests.integration.conftest import WorkerFactory
from trtllm_worker.client import Client
from trtllm_worker.config import Settings


def completion_line(custom_id: str, max_tokens: int) -> str:
    body = {"model": "echo", "prompt": f"{custom_id} ", "max_tokens": max_tokens}
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    return json.dumps(line) + "\n"


async def test_early_lines_outlive_a_batch_ttl_shorter_than_the_batch(
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    cleanup_keys: None,
) -> None:
    ttl_s = 2
    source = tmp_path / "in.jsonl"
    # line 0 ends at once; line 1 runs about 5 s, longer than the batch TTL
    source.write_text(completion_line("quick", 2) + completion_line("slow", 250))
    async with (
        run_worker(echo_step_ms=20),
        Client(make_settings(batch_ttl_s=ttl_s)) as client,
    ):
        batch_id = await client.submit_batch(source)
        async with asyncio.timeout(30):
            final = await client.wait_batch(batch_id, poll_s=0.2)
        out = tmp_path / "out.jsonl"
        assert await client.write_batch_results(batch_id, out) == (2, 0)
    assert final["status"] == "completed", final
    assert final["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["quick", "slow"]
