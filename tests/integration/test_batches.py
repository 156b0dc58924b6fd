"""Batches in OpenAI's Batch format against the real services and an echo worker: a file
in, OpenAI's output and error files out, each line exactly once, the Batch object valid
for the `openai` package's own model."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from openai.types import Batch
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from tests.integration.conftest import WorkerFactory
from trtllm_worker.client import BatchConflict, BatchNotFound, Client, InvalidBatch
from trtllm_worker.config import Settings

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen2.5.jinja"


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "echo", "messages": [{"role": "user", "content": content}], **body},
    }


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_chat_batch_ends_with_an_output_and_an_errors_file(
    run_worker: WorkerFactory, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    lines = [chat_line(f"req-{i}", f"hello {i}", max_tokens=4) for i in range(5)]
    lines.insert(2, chat_line("bad-n", "x", n=2))
    lines.append({**chat_line("wrong-url", "x"), "url": "/v1/completions"})
    source = write_lines(tmp_path / "in.jsonl", lines)
    async with run_worker(chat_template=TEMPLATE), Client(make_settings()) as client:
        batch_id = await client.submit_batch(source)
        final = await client.wait_batch(batch_id, poll_s=0.05)
        out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
        assert await client.write_batch_results(batch_id, out, err) == (5, 2)
    batch = Batch.model_validate(final)
    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (7, 5, 2)  # fmt: skip
    output = read_jsonl(out)
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(5)]
    for line in output:
        completion = ChatCompletion.model_validate(line["response"]["body"])
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 4
    errors = read_jsonl(err)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("bad-n", "invalid_request"), ("wrong-url", "invalid_request")
    ]  # fmt: skip


def completion_line(custom_id: str, prompt: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "echo", "prompt": prompt, **body},
    }


async def run_to_end(
    client: Client, source: Path, tmp_path: Path, **options: Any
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    batch_id = await client.submit_batch(source, **options)
    final = await client.wait_batch(batch_id, poll_s=0.05)
    out, err = tmp_path / f"{batch_id}.out", tmp_path / f"{batch_id}.err"
    await client.write_batch_results(batch_id, out, err)
    return dict(final), read_jsonl(out), read_jsonl(err)


async def test_completions_with_logprobs_name_the_worker_model_and_its_tokens(
    run_worker: WorkerFactory, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    lines = [completion_line("a", "abc", max_tokens=5, logprobs=2),
             completion_line("b", "hello", max_tokens=3)]  # fmt: skip
    source = write_lines(tmp_path / "in.jsonl", lines)
    settings = make_settings(model_name="tiny-echo")
    async with run_worker(model_name="tiny-echo"), Client(settings) as client:
        final, output, errors = await run_to_end(client, source, tmp_path)
    assert final["status"] == "completed"
    assert errors == []
    first = Completion.model_validate(output[0]["response"]["body"])
    assert (first.model, first.choices[0].text) == ("tiny-echo", "abcab")
    logprobs = first.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == list("abcab")
    assert logprobs.top_logprobs is not None
    assert all(len(t) == 2 for t in logprobs.top_logprobs)
    second = Completion.model_validate(output[1]["response"]["body"])
    assert second.choices[0].text == "hel"
    assert second.choices[0].logprobs is None


class Interrupted(Exception):
    pass


async def test_a_submit_run_again_with_its_id_publishes_only_the_missing_lines(
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("trtllm_worker.client.batches.CHUNK", 4)
    lines = [completion_line(f"l{i}", f"p{i}", max_tokens=2) for i in range(10)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    async with run_worker():
        pass  # declares the queue; no worker takes the jobs while they are counted
    handled: list[int] = []

    def cut_after_one_chunk(count: int) -> None:
        handled.append(count)
        raise Interrupted

    async with Client(make_settings()) as client:
        with pytest.raises(Interrupted):
            await client.submit_batch(source, batch_id="batch-resume", progress=cut_after_one_chunk)
        queue = await amqp_channel.declare_queue(names["queue"], passive=True)
        assert handled == [4]
        assert queue.declaration_result.message_count == 4
        assert (await client.batch("batch-resume"))["status"] == "validating"
        assert await client.submit_batch(source, batch_id="batch-resume") == "batch-resume"
        queue = await amqp_channel.declare_queue(names["queue"], passive=True)
        assert queue.declaration_result.message_count == 10
        other = write_lines(tmp_path / "other.jsonl", lines[:3])
        with pytest.raises(BatchConflict, match="another file"):
            await client.submit_batch(other, batch_id="batch-resume")
        async with run_worker():
            final = await client.wait_batch("batch-resume", poll_s=0.05)
        out = tmp_path / "out.jsonl"
        assert await client.write_batch_results("batch-resume", out) == (10, 0)
    assert final["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
    assert [line["custom_id"] for line in read_jsonl(out)] == [f"l{i}" for i in range(10)]


async def test_a_file_over_the_limits_publishes_nothing(
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: dict[str, str],
    tmp_path: Path,
) -> None:
    source = write_lines(tmp_path / "in.jsonl", [completion_line(f"{i}", "x") for i in range(5)])
    async with run_worker():
        pass
    async with Client(make_settings()) as client:
        with pytest.raises(InvalidBatch, match="more than 4 lines"):
            await client.submit_batch(source, batch_id="batch-big", max_lines=4)
        with pytest.raises(BatchNotFound):
            await client.batch("batch-big")
    queue = await amqp_channel.declare_queue(names["queue"], passive=True)
    assert queue.declaration_result.message_count == 0


async def test_results_while_running_are_what_has_ended_and_the_same_bytes_each_time(
    run_worker: WorkerFactory, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    lines = [completion_line(f"l{i}", "abc", max_tokens=3) for i in range(6)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    async with Client(make_settings()) as client:
        async with run_worker():
            pass
        batch_id = await client.submit_batch(source)
        first, again = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
        assert await client.write_batch_results(batch_id, first) == (0, 0)  # nothing ran yet
        assert (await client.batch(batch_id))["status"] == "in_progress"
        async with run_worker():
            await client.wait_batch(batch_id, poll_s=0.05)
        assert await client.write_batch_results(batch_id, first) == (6, 0)
        assert await client.write_batch_results(batch_id, again) == (6, 0)
    assert first.read_bytes() == again.read_bytes()


async def test_cancel_ends_running_and_queued_lines_as_batch_cancelled(
    run_worker: WorkerFactory, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    lines = [completion_line(f"l{i}", "abc", max_tokens=200) for i in range(8)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    async with run_worker(max_batch=2, echo_step_ms=20), Client(make_settings()) as client:
        batch_id = await client.submit_batch(source)
        # wait until two lines are running (their streams hold tokens), then cancel
        redis = await client._redis()
        prefix = make_settings().stream_prefix
        keys = [f"{prefix}{batch_id}:{i}" for i in range(8)]
        async with asyncio.timeout(10):
            for _ in iter(int, 1):  # polls Redis: no event tells a test a job has started
                if await redis.exists(*keys) >= 2:
                    break
                await asyncio.sleep(0.01)
        cancelling = await client.cancel_batch(batch_id)
        assert cancelling["status"] in ("cancelling", "cancelled")
        final = await client.wait_batch(batch_id, poll_s=0.05)
        out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
        await client.write_batch_results(batch_id, out, err)
    assert Batch.model_validate(final).status == "cancelled"
    errors = read_jsonl(err)
    assert sorted(e["custom_id"] for e in errors + read_jsonl(out)) == sorted(
        f"l{i}" for i in range(8)
    )
    assert len(errors) >= 6
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert final["cancelled_at"] is not None


async def test_lines_not_taken_within_the_completion_window_expire(
    run_worker: WorkerFactory, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    lines = [completion_line(f"l{i}", "abc", max_tokens=2) for i in range(4)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    async with Client(make_settings()) as client:
        async with run_worker():
            pass  # the queue exists; no worker takes the lines before the window ends
        batch_id = await client.submit_batch(source, completion_window="1s")
        meta = await client.batch(batch_id)
        expires_at = meta["expires_at"]
        assert expires_at is not None
        await asyncio.sleep(max(expires_at + 0.05 - time.time(), 0))  # the window's end
        final = await client.batch(batch_id)  # the first reader after the window ends them
        err = tmp_path / "err.jsonl"
        assert await client.write_batch_results(batch_id, tmp_path / "out.jsonl", err) == (0, 4)
        async with run_worker():  # the queued jobs end as they are taken: nothing changes
            pass
        again = tmp_path / "again.jsonl"
        assert await client.write_batch_results(batch_id, tmp_path / "o2", again) == (0, 4)
    assert final["status"] == "expired"
    assert final["expired_at"] is not None
    assert {e["error"]["code"] for e in read_jsonl(err)} == {"batch_expired"}
    assert err.read_bytes() == again.read_bytes()


async def test_a_batch_without_a_valid_line_fails_and_results_outlive_the_streams(
    run_worker: WorkerFactory, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    bad = write_lines(tmp_path / "bad.jsonl", [completion_line("a", "x", n=2), {"x": 1}])
    good = write_lines(tmp_path / "good.jsonl", [completion_line("a", "abc", max_tokens=2)])
    async with run_worker(stream_ttl_s=1), Client(make_settings(batch_ttl_s=777)) as client:
        failed = await client.batch(await client.submit_batch(bad))
        assert failed["status"] == "failed"
        assert failed["errors"] is not None
        final, output, _ = await run_to_end(client, good, tmp_path)
        redis = await client._redis()
        prefix = make_settings().stream_prefix
        ttl = await redis.ttl(f"{prefix}_batch:{final['id']}")
        line_ttl = await redis.ttl("{" + f"{prefix}{final['id']}:0" + "}:batch")
        stream_ttl = await redis.ttl(f"{prefix}{final['id']}:0")
        listed = [b["id"] for b in await client.list_batches()]
    assert 700 < ttl <= 777
    assert 700 < line_ttl <= 777
    assert stream_ttl <= 1
    assert output[0]["response"]["body"]["choices"][0]["text"] == "ab"
    assert listed[:2] == [final["id"], failed["id"]]
