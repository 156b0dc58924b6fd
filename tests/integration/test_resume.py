"""A job delivered again after its worker died continues its stream (the reliability
issue adds leases and fault injection; this is the resume path itself)."""

from __future__ import annotations

import json
import uuid

from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal, tokens


def rid() -> str:
    return f"rs-{uuid.uuid4().hex[:10]}"


async def store_tokens(
    subscriber: Subscriber, request_id: str, texts: list[str], ids: list[int]
) -> None:
    """What a worker that died mid-stream left behind: token entries, no terminal."""
    key = subscriber.key(request_id)
    for index, (text, token_id) in enumerate(zip(texts, ids, strict=True)):
        fields = {"event": "token", "index": index, "token_id": token_id, "text": text}
        await subscriber.redis.xadd(key, fields, id=f"0-{index + 1}")  # type: ignore[arg-type]


async def test_redelivered_job_continues_its_stream(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    await store_tokens(subscriber, request_id, list("abca"), [ord(c) for c in "abca"])
    async with run_worker() as service:
        await producer.publish(
            {"request_id": request_id, "inputs": "abc", "parameters": {"max_new_tokens": 10}}
        )
        entries = await subscriber.read_until_terminal(request_id)
        resumed = service.metrics.resumed._value.get()
    assert [int(e["index"]) for e in tokens(entries)] == list(range(10))
    done = terminal(entries)
    assert done["generated_text"] == "abcabcabca"
    assert done["generated_tokens"] == "10"
    assert "".join(e["text"] for e in tokens(entries)) == done["generated_text"]
    assert resumed == 1


async def test_resume_after_the_last_token_only_stores_the_terminal_entry(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """The worker died after storing the final token (which released the held-back
    'ST' of a stop that never completed) but before the terminal entry."""
    request_id = rid()
    texts, ids = [" ", "o", "k", "", "ST"], [ord(c) for c in " okST"]
    await store_tokens(subscriber, request_id, texts, ids)
    async with run_worker():
        await producer.publish(
            {
                "request_id": request_id,
                "inputs": " okST",
                "parameters": {"max_new_tokens": 5, "stop": ["STOP"]},
            }
        )
        entries = await subscriber.read_until_terminal(request_id)
    assert [e["text"] for e in tokens(entries)] == texts
    done = terminal(entries)
    assert done["finish_reason"] == "length"
    assert done["generated_text"] == " okST"


async def test_resumed_stop_sequence_spanning_the_break_is_found(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """The held-back start of a stop sequence is rebuilt from the stored tokens."""
    request_id = rid()
    prompt = "xyEND"
    # the first attempt published "x", "y" and held back "E" (a possible "END")
    await store_tokens(subscriber, request_id, ["x", "y", ""], [ord(c) for c in "xyE"])
    async with run_worker():
        await producer.publish(
            {
                "request_id": request_id,
                "inputs": prompt,
                "parameters": {"max_new_tokens": 50, "stop": ["END"]},
            }
        )
        entries = await subscriber.read_until_terminal(request_id)
    done = terminal(entries)
    assert done["finish_reason"] == "stop_sequence"
    assert done["generated_text"] == "xy"
    assert [int(e["index"]) for e in tokens(entries)] == list(range(5))


async def test_a_resume_after_an_early_stop_id_still_honours_min_new_tokens(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """The first attempt published 'a' and the stop id 'b', which did not end the job
    (min_new_tokens 10 not reached): the resumed job goes on to its tenth token."""
    request_id = rid()
    await store_tokens(subscriber, request_id, ["a", ""], [97, 98])
    async with run_worker():
        await producer.publish(
            {
                "request_id": request_id,
                "inputs": "ab",
                "parameters": {"max_new_tokens": 12, "min_new_tokens": 10, "stop_token_ids": [98]},
            }
        )
        entries = await subscriber.read_until_terminal(request_id)
    assert [int(e["index"]) for e in tokens(entries)] == list(range(10))
    assert [int(e["token_id"]) for e in tokens(entries)] == [97, 98] * 5
    done = terminal(entries)
    assert (done["finish_reason"], done["generated_tokens"]) == ("stop_sequence", "10")
    assert done["generated_text"] == "aaaaa"


async def test_a_resumed_job_gives_its_new_tokens_their_top_logprobs(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """The entries stored before the break stay as they were; each new one carries the
    top logprobs of the token it publishes (the echo engine lists it first)."""
    request_id = rid()
    await store_tokens(subscriber, request_id, list("ab"), [ord(c) for c in "ab"])
    params = {"max_new_tokens": 5, "return_logprobs": True, "top_logprobs": 2}
    async with run_worker():
        await producer.publish({"request_id": request_id, "inputs": "abc", "parameters": params})
        entries = await subscriber.read_until_terminal(request_id)
    stored = tokens(entries)
    assert [int(e["index"]) for e in stored] == list(range(5))
    assert all("top_logprobs" not in e for e in stored[:2])
    for entry in stored[2:]:
        top = json.loads(entry["top_logprobs"])
        assert len(top) == 2
        assert top[0] == [int(entry["token_id"]), float(entry["logprob"])]
    assert terminal(entries)["generated_text"] == "abcab"
