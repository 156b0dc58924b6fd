"""The wire contract end to end on the echo engine, as a producer and a subscriber see
it: publish with aio-pika, read with XREAD."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from datetime import UTC, datetime, timedelta

import aio_pika
import pytest

from tests.integration.conftest import (
    Producer,
    Subscriber,
    WorkerFactory,
    terminal,
    tokens,
)

# tokens per engine step: 1, and 4 as speculative decoding or MTP hand over (a stop
# sequence, an EOS or max_new_tokens then falls in the middle of a step)
PER_STEP = pytest.mark.parametrize("per_step", [1, 4], ids=["1-per-step", "4-per-step"])


def rid() -> str:
    return f"req-{uuid.uuid4().hex[:10]}"


async def test_prompt_becomes_token_stream(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker(stream_ttl_s=120):
        await producer.publish(
            {"request_id": request_id, "inputs": "abc", "parameters": {"max_new_tokens": 7}}
        )
        entries = await subscriber.read_until_terminal(request_id)
    token_entries = tokens(entries)
    assert [int(e["index"]) for e in token_entries] == list(range(7))
    assert "".join(e["text"] for e in token_entries) == "abcabca"
    assert [int(e["token_id"]) for e in token_entries] == [ord(c) for c in "abcabca"]
    assert all("logprob" not in e for e in token_entries)
    done = terminal(entries)
    assert done == {
        "event": "done",
        "finish_reason": "length",
        "generated_tokens": "7",
        "input_tokens": "3",
        "generated_text": "abcabca",
    }
    ttl = await subscriber.redis.ttl(subscriber.key(request_id))
    assert 0 < ttl <= 120


async def test_message_id_names_the_request_and_metadata_is_echoed(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    metadata = {"user": "ada", "tags": ["a", "ü"], "n": 1}
    async with run_worker():
        await producer.publish(
            {"input_ids": [120, 121], "parameters": {"max_new_tokens": 3}, "metadata": metadata},
            message_id=request_id,
        )
        entries = await subscriber.read_until_terminal(request_id)
    done = terminal(entries)
    assert done["generated_text"] == "xyx"
    assert json.loads(done["metadata"]) == metadata


@PER_STEP
async def test_default_max_new_tokens_applies(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber, per_step: int
) -> None:
    request_id = rid()
    async with run_worker(default_max_new_tokens=5, echo_tokens_per_step=per_step):
        await producer.publish({"request_id": request_id, "inputs": "xy"})
        entries = await subscriber.read_until_terminal(request_id)
    assert terminal(entries)["generated_tokens"] == "5"


@PER_STEP
async def test_stop_sequence_ends_generation_and_is_not_published(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber, per_step: int
) -> None:
    request_id = rid()
    async with run_worker(echo_tokens_per_step=per_step):
        await producer.publish(
            {
                "request_id": request_id,
                "inputs": "one two three ",
                "parameters": {"max_new_tokens": 100, "stop": ["three", "wo t"]},
            }
        )
        entries = await subscriber.read_until_terminal(request_id)
    done = terminal(entries)
    assert done["finish_reason"] == "stop_sequence"
    # "wo t" completes (at "one two t") before "three" does
    assert done["generated_text"] == "one t"
    assert "".join(e["text"] for e in tokens(entries)) == done["generated_text"]
    assert int(done["generated_tokens"]) == len(tokens(entries)) == len("one two t")


@PER_STEP
async def test_eos_ends_the_job_without_its_text(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber, per_step: int
) -> None:
    eos_job, min_job, ignore_job, keep_job = rid(), rid(), rid(), rid()
    prompt = [104, 105, 256]  # "hi</s>" with the built-in tokenizer
    async with run_worker(eos_token="</s>", echo_tokens_per_step=per_step):
        await producer.publish({"request_id": eos_job, "input_ids": prompt})
        await producer.publish(
            {"request_id": min_job, "input_ids": prompt, "parameters": {"min_new_tokens": 4}}
        )
        await producer.publish(
            {
                "request_id": ignore_job,
                "input_ids": prompt,
                "parameters": {"ignore_eos": True, "max_new_tokens": 4},
            }
        )
        await producer.publish(
            {
                "request_id": keep_job,
                "input_ids": prompt,
                "parameters": {
                    "ignore_eos": True,
                    "max_new_tokens": 4,
                    "skip_special_tokens": False,
                },
            }
        )
        eos = await subscriber.read_until_terminal(eos_job)
        min_entries = await subscriber.read_until_terminal(min_job)
        ignored = await subscriber.read_until_terminal(ignore_job)
        kept = await subscriber.read_until_terminal(keep_job)
    assert terminal(eos)["finish_reason"] == "eos_token"
    assert terminal(eos)["generated_text"] == "hi"
    assert [e["text"] for e in tokens(eos)] == ["h", "i", ""]
    assert tokens(eos)[-1]["token_id"] == "256"
    # an EOS before min_new_tokens does not end the job; the next one does
    assert terminal(min_entries)["finish_reason"] == "eos_token"
    assert terminal(min_entries)["generated_tokens"] == "6"
    assert terminal(min_entries)["generated_text"] == "hihi"
    # an ignored EOS is generated like any token: a special token, so its text is left
    # out unless the job keeps special tokens (still one entry per token)
    assert terminal(ignored)["finish_reason"] == "length"
    assert [e["text"] for e in tokens(ignored)] == ["h", "i", "", "h"]
    assert terminal(ignored)["generated_text"] == "hih"
    assert terminal(kept)["generated_text"] == "hi</s>h"


async def test_truncate_and_logprobs(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker(max_input_tokens=8):
        await producer.publish(
            {
                "request_id": request_id,
                "inputs": "0123456789abcdefXYZ",
                "parameters": {"truncate": 3, "max_new_tokens": 4, "return_logprobs": True},
            }
        )
        entries = await subscriber.read_until_terminal(request_id)
    done = terminal(entries)
    assert done["generated_text"] == "XYZX"
    assert done["input_tokens"] == "3"
    assert all(float(e["logprob"]) <= 0 for e in tokens(entries))


async def test_top_logprobs_on_every_token_entry(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """With `top_logprobs` 3 each token entry carries three `[token_id, logprob]` pairs
    as JSON, most likely first, the echo engine's chosen token among them; a job that
    does not ask gets no such field."""
    asked, plain = rid(), rid()
    async with run_worker():
        for request_id, extra in ((asked, {"top_logprobs": 3}), (plain, {})):
            params = {"max_new_tokens": 5, "return_logprobs": True, **extra}
            await producer.publish(
                {"request_id": request_id, "inputs": "abc", "parameters": params}
            )
        entries = await subscriber.read_until_terminal(asked)
        others = await subscriber.read_until_terminal(plain)
    assert len(tokens(entries)) == 5
    for entry in tokens(entries):
        top = json.loads(entry["top_logprobs"])
        assert len(top) == 3
        assert all(isinstance(token_id, int) for token_id, _ in top)
        values = [logprob for _, logprob in top]
        assert values == sorted(values, reverse=True)
        assert [int(entry["token_id"]), float(entry["logprob"])] in top
        assert "," + " " not in entry["top_logprobs"]  # compact JSON
    assert terminal(entries)["generated_text"] == "abcab"
    assert all("top_logprobs" not in e and "logprob" in e for e in tokens(others))


async def test_utf8_never_split_across_entries(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    prompt = "日本😀é"
    async with run_worker():
        await producer.publish(
            {"request_id": request_id, "inputs": prompt, "parameters": {"max_new_tokens": 40}}
        )
        entries = await subscriber.read_until_terminal(request_id)
    texts = [e["text"] for e in tokens(entries)]
    # 40 bytes end one byte into "本": only the final entry, flushed at the length
    # limit, may carry that incomplete character (as U+FFFD); no other entry holds a part
    assert "\ufffd" not in "".join(texts[:-1])
    assert "".join(texts) == terminal(entries)["generated_text"]
    expected = (prompt.encode() * 10)[:40].decode("utf-8", errors="replace")
    assert terminal(entries)["generated_text"] == expected
    assert sum(1 for t in texts if t) < len(texts), "multi-byte characters span tokens"


async def test_job_with_terminal_entry_is_not_run_again(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id, marker = rid(), rid()
    job = {"request_id": request_id, "inputs": "ab", "parameters": {"max_new_tokens": 3}}
    async with run_worker(max_batch=1) as service:
        await producer.publish(job)
        first = await subscriber.read_until_terminal(request_id)
        await producer.publish(job)
        await producer.publish(
            {"request_id": marker, "inputs": "z", "parameters": {"max_new_tokens": 1}}
        )
        await subscriber.read_until_terminal(marker)
        skipped = service.metrics.jobs.labels(outcome="skipped")._value.get()
    assert await subscriber.entries(request_id) == first
    assert skipped == 1


async def test_copies_of_one_job_in_hand_at_once_run_once(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Twelve copies of one request on one worker (a producer's retries): one runs, the
    others are acknowledged once its terminal entry is stored, none is retried or
    dead-lettered, and every message is settled before the worker stops."""
    caplog.set_level(logging.INFO, logger="trtllm_worker")
    request_id = rid()
    job = {"request_id": request_id, "inputs": "ab", "parameters": {"max_new_tokens": 20}}
    async with run_worker(echo_step_ms=5) as service:
        for _ in range(12):
            await producer.publish(job)
        marker = rid()  # delivered after the copies: they are in hand when it ends
        await producer.publish({"request_id": marker, "inputs": "z"})
        await subscriber.read_until_terminal(marker)
        entries = await subscriber.read_until_terminal(request_id)
        # the worker stops only once it has settled what it holds (or hands it back)
    jobs = service.metrics.jobs
    assert jobs.labels(outcome="skipped")._value.get() == 11
    assert jobs.labels(outcome="done:length")._value.get() == 2  # the copy and the marker
    assert await subscriber.entries(request_id) == entries
    assert [e["event"] for e in entries] == ["token"] * 20 + ["done"]
    for queue_name in (names["queue"], f"{names['queue']}.dead"):
        declared = await amqp_channel.declare_queue(queue_name, durable=True, passive=True)
        assert declared.declaration_result.message_count == 0, queue_name
    assert "KeyError" not in caplog.text
    assert "failed unexpectedly" not in caplog.text
    assert "handed back" not in caplog.text


async def test_cancel_running_request_keeps_what_was_generated(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker(echo_step_ms=10):
        await producer.publish(
            {"request_id": request_id, "inputs": "abc", "parameters": {"max_new_tokens": 2000}}
        )
        await subscriber.first_entry(request_id)
        await producer.cancel(request_id)
        entries = await subscriber.read_until_terminal(request_id)
    done = terminal(entries)
    assert done["finish_reason"] == "cancelled"
    assert 1 <= int(done["generated_tokens"]) < 2000
    assert int(done["generated_tokens"]) == len(tokens(entries))
    assert "".join(e["text"] for e in tokens(entries)) == done["generated_text"]


async def test_cancel_before_taken_ends_with_no_tokens(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    blocker, queued = rid(), rid()
    # one job at a time: `queued` waits in the queue behind `blocker`
    async with run_worker(max_batch=1, echo_step_ms=10):
        await producer.publish(
            {"request_id": blocker, "inputs": "b", "parameters": {"max_new_tokens": 2000}}
        )
        await subscriber.first_entry(blocker)
        await producer.publish(
            {"request_id": queued, "inputs": "abc", "parameters": {"max_new_tokens": 50}}
        )
        await producer.cancel(queued)
        await producer.cancel(blocker)
        assert terminal(await subscriber.read_until_terminal(blocker))["finish_reason"] == (
            "cancelled"
        )
        entries = await subscriber.read_until_terminal(queued)
    assert entries == [
        {
            "event": "done",
            "finish_reason": "cancelled",
            "generated_tokens": "0",
            "input_tokens": "3",
            "generated_text": "",
        }
    ]


async def test_deadline_passed_before_start_is_an_error(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    past = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    async with run_worker():
        await producer.publish({"request_id": request_id, "inputs": "abc", "deadline": past})
        entries = await subscriber.read_until_terminal(request_id)
    assert len(entries) == 1
    assert entries[0]["event"] == "error"
    assert entries[0]["code"] == "deadline_exceeded"


async def test_deadline_passing_while_running_ends_with_deadline(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    soon = (datetime.now(UTC) + timedelta(seconds=0.5)).isoformat()
    async with run_worker(echo_step_ms=10):
        await producer.publish(
            {
                "request_id": request_id,
                "inputs": "abc",
                "deadline": soon,
                "parameters": {"max_new_tokens": 2000},
            }
        )
        entries = await subscriber.read_until_terminal(request_id)
    done = terminal(entries)
    assert done["finish_reason"] == "deadline"
    assert 0 < int(done["generated_tokens"]) < 2000


async def test_classic_queue_type(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker(queue_type="classic"):
        await producer.publish(
            {"request_id": request_id, "inputs": "ok", "parameters": {"max_new_tokens": 2}}
        )
        entries = await subscriber.read_until_terminal(request_id)
    assert terminal(entries)["generated_text"] == "ok"


async def test_many_concurrent_jobs(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    ids = [rid() for _ in range(100)]
    async with run_worker(max_batch=16, echo_step_ms=1):
        for n, request_id in enumerate(ids):
            await producer.publish(
                {
                    "request_id": request_id,
                    "inputs": f"job {n}",
                    "parameters": {"max_new_tokens": 20},
                }
            )
        results = await asyncio.gather(*(subscriber.read_until_terminal(i, 60) for i in ids))
    for n, entries in enumerate(results):
        done = terminal(entries)
        assert done["generated_text"] == (f"job {n}" * 20)[:20]
        assert [int(e["index"]) for e in tokens(entries)] == list(range(20))
