"""The whole worker on the TensorRT-LLM adapters, with the tensorrt_llm double standing in
for the GPU: RabbitMQ in, Redis stream out, as on a GPU node."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.doubles import FakeGpu
from tests.engines.conftest import install_double
from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal, tokens
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.tokenizer import builtin_byte_tokenizer


def rid() -> str:
    return f"trt-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    return install_double(monkeypatch)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """An HF-style folder: its tokenizer (the built-in byte-level one) and EOS `</s>`."""
    builtin_byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}))
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    (engine_dir / "config.json").write_text(
        json.dumps({"pretrained_config": {"mapping": {"world_size": 1}}})
    )
    return tmp_path


def engine_settings(engine: str, model_dir: Path) -> dict[str, Any]:
    if engine == "trtllm":
        return {"engine": "trtllm", "model": model_dir}
    return {
        "engine": "trtllm-executor",
        "engine_dir": model_dir / "engine",
        "tokenizer": model_dir,
    }


@pytest.mark.parametrize("engine", ["trtllm", "trtllm-executor"])
async def test_jobs_stream_through_the_adapter(
    gpu: FakeGpu,
    model_dir: Path,
    engine: str,
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
) -> None:
    plain, eos, stopped = rid(), rid(), rid()
    async with run_worker(**engine_settings(engine, model_dir)) as service:
        await producer.publish(
            {"request_id": plain, "inputs": "abc", "parameters": {"max_new_tokens": 7}}
        )
        await producer.publish({"request_id": eos, "input_ids": [104, 105, 256]})
        await producer.publish(
            {
                "request_id": stopped,
                "inputs": "one two ",
                "parameters": {"max_new_tokens": 50, "stop": ["two"], "return_logprobs": True},
            }
        )
        results = [await subscriber.read_until_terminal(i) for i in (plain, eos, stopped)]
        status_ok = service.ready()
    assert status_ok
    assert terminal(results[0])["generated_text"] == "abcabca"
    assert terminal(results[1])["finish_reason"] == "eos_token"
    assert terminal(results[1])["generated_text"] == "hi"
    assert terminal(results[2])["finish_reason"] == "stop_sequence"
    assert terminal(results[2])["generated_text"] == "one "
    assert all("logprob" in e for e in tokens(results[2]))


@pytest.mark.parametrize("engine", ["trtllm", "trtllm-executor"])
async def test_cancel_and_deadline_through_the_adapter(
    gpu: FakeGpu,
    model_dir: Path,
    engine: str,
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
) -> None:
    gpu.step_s = 0.005
    cancelled, late = rid(), rid()
    soon = (datetime.now(UTC) + timedelta(seconds=0.5)).isoformat()
    async with run_worker(**engine_settings(engine, model_dir), max_new_tokens=5000):
        await producer.publish(
            {"request_id": cancelled, "inputs": "abc", "parameters": {"max_new_tokens": 5000}}
        )
        await producer.publish(
            {
                "request_id": late,
                "inputs": "xyz",
                "deadline": soon,
                "parameters": {"max_new_tokens": 5000},
            }
        )
        await subscriber.first_entry(cancelled)
        await producer.cancel(cancelled)
        first = await subscriber.read_until_terminal(cancelled)
        second = await subscriber.read_until_terminal(late)
    assert terminal(first)["finish_reason"] == "cancelled"
    assert terminal(second)["finish_reason"] == "deadline"
    for entries in (first, second):
        done = terminal(entries)
        assert "".join(e["text"] for e in tokens(entries)) == done["generated_text"]
        assert int(done["generated_tokens"]) == len(tokens(entries)) < 5000


async def test_a_dead_llm_api_engine_is_noticed_and_its_jobs_handed_back(
    gpu: FakeGpu,
    model_dir: Path,
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    names: dict[str, str],
) -> None:
    """TensorRT-LLM 1.2 leaves results pending when its worker process dies: the stall
    watchdog turns that silence into an engine death."""
    gpu.step_s = 0.005
    request_id = rid()
    async with run_worker(engine="trtllm", model=model_dir, engine_stall_timeout_s=0.5) as service:
        await producer.publish(
            {"request_id": request_id, "inputs": "abc", "parameters": {"max_new_tokens": 2000}}
        )
        await subscriber.first_entry(request_id)
        gpu.kill()
        await asyncio.wait_for(service.wait_stopped(), 10)
        assert service.engine_failed
        assert not service.ready()
    entries = await subscriber.entries(request_id)
    assert entries
    assert all(fields["event"] == "token" for fields in entries)
    queue = await producer.channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "quorum"}
    )
    assert queue.declaration_result.message_count == 1


@pytest.mark.parametrize("engine", ["trtllm", "trtllm-executor"])
async def test_a_cancelled_job_the_engine_holds_queued_ends_cancelled(
    gpu: FakeGpu,
    model_dir: Path,
    engine: str,
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
) -> None:
    """The engine runs one request at a time (its KV cache is full) while the worker
    holds two: cancelling the one TensorRT-LLM has queued ends its stream, and the
    freed slot takes the next job."""
    gpu.step_s = 0.005
    gpu.kv_cache_requests = 1
    running, queued, after = rid(), rid(), rid()
    settings = engine_settings(engine, model_dir)
    async with run_worker(**settings, max_batch=2, engine_cancel_timeout_s=0.5):
        for request_id in (running, queued):
            await producer.publish(
                {"request_id": request_id, "inputs": "abc", "parameters": {"max_new_tokens": 2000}}
            )
        await subscriber.first_entry(running)
        await producer.cancel(queued)
        ended = await subscriber.read_until_terminal(queued, wait_s=10)
        await producer.cancel(running)
        await subscriber.read_until_terminal(running, wait_s=10)
        await producer.publish({"request_id": after, "inputs": "xyz"})
        last = await subscriber.read_until_terminal(after, wait_s=10)
    assert terminal(ended)["finish_reason"] == "cancelled"
    assert tokens(ended) == []
    assert terminal(last)["event"] == "done"


async def test_an_extra_option_that_shrinks_the_batch_stops_the_worker(
    gpu: FakeGpu, model_dir: Path, run_worker: WorkerFactory, tmp_path: Path
) -> None:
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"max_batch_size": 2}))
    with pytest.raises(ConfigError, match="max_batch_size: 2, but WORKER_MAX_BATCH is 4"):
        async with run_worker(
            **engine_settings("trtllm", model_dir), max_batch=4, llm_extra_options=extra
        ):
            pass


async def test_a_job_over_the_engines_max_seq_len_is_refused_with_both_numbers(
    gpu: FakeGpu,
    model_dir: Path,
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
) -> None:
    request_id = rid()
    async with run_worker(**engine_settings("trtllm", model_dir), max_seq_len=64):
        await producer.publish(
            {"request_id": request_id, "inputs": "x" * 40, "parameters": {"max_new_tokens": 30}}
        )
        error = terminal(await subscriber.read_until_terminal(request_id))
    assert error["code"] == "input_too_long"
    assert (
        "40 tokens + max_new_tokens 30 = 70, over the engine's max_seq_len 64" in error["message"]
    )


async def published(subscriber: Subscriber, request_id: str, text: str) -> None:
    """What a worker that died mid-stream left behind: token entries, no terminal."""
    for index, char in enumerate(text):
        fields = {"event": "token", "index": index, "token_id": ord(char), "text": char}
        await subscriber.redis.xadd(subscriber.key(request_id), fields, id=f"0-{index + 1}")  # type: ignore[arg-type]


async def test_a_resumed_job_never_exceeds_the_engines_max_num_tokens(
    gpu: FakeGpu,
    model_dir: Path,
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
) -> None:
    """A resumed job submits its prompt with the tokens already published, which the LLM
    API refuses over max_num_tokens (without chunked prefill): so a job is accepted only
    if its longest resume (all but its last token published) fits. At the bound, a job
    resumed at that point completes; one token over, the job is refused at intake, first
    run or resumed, never failed by the engine after tokens were published."""
    fits, over, over_resumed = rid(), rid(), rid()
    prompt = "abcdefghij"  # 10 tokens: with max_new_tokens 7 the longest resume is 16
    await published(subscriber, fits, "abcdef")
    await published(subscriber, over_resumed, "abcdefg")
    async with run_worker(**engine_settings("trtllm", model_dir), max_num_tokens=16):
        await producer.publish(
            {"request_id": fits, "inputs": prompt, "parameters": {"max_new_tokens": 7}}
        )
        for request_id in (over, over_resumed):
            await producer.publish(
                {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": 8}}
            )
        done = await subscriber.read_until_terminal(fits)
        refused = [await subscriber.read_until_terminal(i) for i in (over, over_resumed)]
    assert (terminal(done)["event"], terminal(done)["finish_reason"]) == ("done", "length")
    assert [int(e["index"]) for e in tokens(done)] == list(range(7))
    for entries in refused:
        error = terminal(entries)
        assert (error["event"], error.get("code")) == ("error", "input_too_long"), error
        assert "max_num_tokens 16" in error["message"]


@pytest.mark.parametrize(
    ("engine", "sampler"),
    [("trtllm", "TorchSampler"), ("trtllm", "TRTLLMSampler"), ("trtllm-executor", "auto")],
)
async def test_top_logprobs_through_the_adapter_or_refused_where_it_cannot(
    gpu: FakeGpu,
    model_dir: Path,
    engine: str,
    sampler: str,
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
) -> None:
    """TorchSampler returns the top K (greedy: the chosen token first); TRTLLMSampler
    and the C++ Executor return only the sampled token's log probability, so a job that
    asks is dead-lettered `invalid_request` naming `top_logprobs` and what to use."""
    request_id = rid()
    params = {"max_new_tokens": 4, "return_logprobs": True, "top_logprobs": 3, "do_sample": False}
    async with run_worker(**engine_settings(engine, model_dir), sampler=sampler):
        await producer.publish({"request_id": request_id, "inputs": "abc", "parameters": params})
        entries = await subscriber.read_until_terminal(request_id)
        dead = None if sampler == "TorchSampler" else await producer.get_dead()
    if dead is None:
        assert terminal(entries)["generated_text"] == "abca"
        for entry in tokens(entries):
            top = json.loads(entry["top_logprobs"])
            assert len(top) == 3
            assert top[0] == [int(entry["token_id"]), float(entry["logprob"])]
        return
    assert dead.headers["x-error-code"] == "invalid_request"
    message = str(dead.headers["x-error-message"])
    assert message.startswith("parameters.top_logprobs: this engine cannot return top logprobs")
    assert "WORKER_SAMPLER=TorchSampler" in message
    assert entries == [{"event": "error", "code": "invalid_request", "message": message}]
