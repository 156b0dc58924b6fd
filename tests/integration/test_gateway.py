"""The gateway driven by the official `openai` package, as users drive it: answers,
streamed chunks and usage as the SDK parses them, OpenAI's errors, keys and tenants,
back-pressure, a client that leaves, the stream route, files and batches."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import aio_pika
import httpx
import openai
import pytest
import redis.asyncio as aioredis

from tests.integration.conftest import GatewayFactory, GatewayServer, Subscriber, WorkerFactory
from trtllm_worker.client import Client
from trtllm_worker.config import Settings

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen2.5.jinja"
MODEL = "tiny-echo"
KEY = "sk-test-interactive"


Sdk = Callable[..., openai.AsyncOpenAI]


@pytest.fixture
async def sdk() -> AsyncIterator[Sdk]:
    """`sdk(gateway, key=KEY)`: the official client on the gateway (no retries: a test
    sees each answer as it is), closed after the test."""
    made: list[openai.AsyncOpenAI] = []

    def make(gateway: GatewayServer, key: str = KEY) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()


async def done_entry(subscriber: Subscriber, request_id: str) -> dict[str, str]:
    entries = await subscriber.read_until_terminal(request_id)
    assert entries[-1]["event"] == "done", entries[-1]
    return entries[-1]


def request_id_of(completion_id: str) -> str:
    return completion_id.split("-", 1)[1]


@pytest.fixture
async def served(
    run_worker: WorkerFactory, run_gateway: GatewayFactory, subscriber: Subscriber
) -> AsyncIterator[GatewayServer]:
    """A worker (echo engine, a chat template) and an open gateway on this test's queue."""
    async with (
        run_worker(chat_template=TEMPLATE, model_name=MODEL, echo_step_ms=2),
        run_gateway(chat_template=TEMPLATE, model_name=MODEL) as gateway,
    ):
        yield gateway


async def test_a_chat_completion_is_the_jobs_answer(
    sdk: Sdk, served: GatewayServer, subscriber: Subscriber
) -> None:
    raw = await sdk(served).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "héllo, wörld"}], max_tokens=12
    )
    answer = raw.parse()
    request_id = raw.headers["x-request-id"]
    done = await done_entry(subscriber, request_id)
    assert answer.id == f"chatcmpl-{request_id}"
    assert answer.object == "chat.completion"
    assert answer.model == MODEL
    (choice,) = answer.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == done["generated_text"]
    assert choice.finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == int(done["input_tokens"])
    assert answer.usage.completion_tokens == int(done["generated_tokens"]) == 12
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12


async def test_a_streamed_chat_completion_relays_every_token_then_usage(
    sdk: Sdk, served: GatewayServer, subscriber: Subscriber
) -> None:
    stream = await sdk(served).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream me 😀"}],
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    request_id = request_id_of(chunks[0].id)
    done = await done_entry(subscriber, request_id)
    assert {c.id for c in chunks} == {f"chatcmpl-{request_id}"}
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done["generated_text"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])
    *before, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 20
    assert last.usage.prompt_tokens == int(done["input_tokens"])
    assert all(c.usage is None for c in before)


async def test_a_streamed_completion_without_usage_has_no_usage_chunk(
    sdk: Sdk, served: GatewayServer, subscriber: Subscriber
) -> None:
    stream = await sdk(served).completions.create(
        model=MODEL, prompt="abc", max_tokens=3, stream=True
    )
    chunks = [chunk async for chunk in stream]
    done = await done_entry(subscriber, request_id_of(chunks[0].id))
    assert all(c.object == "text_completion" for c in chunks)
    assert all(c.choices for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == done["generated_text"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(getattr(c, "usage", None) is None for c in chunks)


async def test_a_completion_with_logprobs(
    sdk: Sdk, served: GatewayServer, subscriber: Subscriber
) -> None:
    raw = await sdk(served).completions.with_raw_response.create(
        model=MODEL, prompt="xyz", max_tokens=3, logprobs=2
    )
    answer = raw.parse()
    done = await done_entry(subscriber, raw.headers["x-request-id"])
    (choice,) = answer.choices
    assert choice.text == done["generated_text"]
    assert choice.logprobs is not None
    assert choice.logprobs.tokens is not None
    assert len(choice.logprobs.tokens) == 3
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset == [0, 1, 2]
    assert choice.logprobs.top_logprobs is not None
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)


async def test_models_lists_the_served_model(sdk: Sdk, served: GatewayServer) -> None:
    client = sdk(served)
    models = [m.id async for m in client.models.list()]
    assert models == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("another")


async def test_openai_errors_for_what_cannot_be_served(sdk: Sdk, served: GatewayServer) -> None:
    client = sdk(served)
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}]
        )
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as n:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=2
        )
    assert n.value.param == "n"
    with pytest.raises(openai.BadRequestError) as empty:
        await client.chat.completions.create(model=MODEL, messages=[])
    assert empty.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as too_many:  # the job's own limit
        await client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert too_many.value.code == "invalid_request"
    async with httpx.AsyncClient(base_url=served.url) as http:
        bad_json = await http.post("/v1/chat/completions", content=b"{not json")
        unknown_url = await http.get("/v1/nothing")
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["type"] == "invalid_request_error"
    assert unknown_url.status_code == 404
    assert unknown_url.json()["error"]["message"] == "Invalid URL (GET /v1/nothing)"


async def test_a_refusal_by_the_worker_is_an_http_error_not_a_broken_stream(
    sdk: Sdk,
    served: GatewayServer,
) -> None:
    """The worker refuses the job (no chat template on its side would do; here a prompt
    over its input limit): the streamed request gets the 400 itself, before any chunk."""
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk(served).completions.create(
            model=MODEL, prompt=[1] * 5000, max_tokens=1, stream=True
        )
    assert refused.value.code in ("input_too_long", "invalid_request")


# -- keys and tenants ---------------------------------------------------------------------


def write_keys(path: Path, keys: dict[str, dict[str, Any]]) -> None:
    """Replace the file as Kubernetes replaces a Secret's: a new file renamed over it."""
    fresh = path.with_suffix(".new")
    fresh.write_text(json.dumps(keys))
    os.replace(fresh, path)


async def test_keys_give_tenant_and_priority_and_reload_on_change(
    sdk: Sdk,
    run_gateway: GatewayFactory,
    run_worker: WorkerFactory,
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: dict[str, str],
    tmp_path: Path,
    cleanup_keys: None,
) -> None:
    keys = tmp_path / "keys.json"
    write_keys(keys, {KEY: {"tenant": "acme", "priority": 7}})
    async with run_worker():  # declares the queue, then stops: the job stays queued
        pass
    async with run_gateway(gateway_keys_file=keys, model_name=MODEL) as gateway:
        with pytest.raises(openai.AuthenticationError) as wrong:
            await sdk(gateway, "sk-wrong").models.list()
        assert wrong.value.code == "invalid_api_key"
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            missing = await http.get("/v1/models")
        assert missing.status_code == 401
        assert "didn't provide an API key" in missing.json()["error"]["message"]
        waiting = sdk(gateway)
        answer = asyncio.create_task(
            waiting.completions.create(model=MODEL, prompt="abc", max_tokens=2)
        )
        queue = await amqp_channel.get_queue(names["queue"])
        message = await _next_message(queue)
        job = json.loads(message.body)
        assert job["tenant"] == "acme"
        assert message.priority == 7
        answer.cancel()
        await asyncio.gather(answer, return_exceptions=True)
        await waiting.close()  # its connection: the gateway sees the client leave

        write_keys(keys, {"sk-rotated": {"tenant": "beta", "priority": 1}})
        ring = gateway.app.state.gateway.keys
        ring.force_check()
        with pytest.raises(openai.AuthenticationError):
            await sdk(gateway).models.list()
        assert [m.id async for m in sdk(gateway, "sk-rotated").models.list()] == [MODEL]
        write_keys(keys, {"sk-rotated": {"tenant": "beta", "priority": 42}})  # invalid
        ring.force_check()
        assert [m.id async for m in sdk(gateway, "sk-rotated").models.list()] == [MODEL]
        assert ring.reloads == 1, "the bad file was not taken; the keys in force stand"


async def _next_message(
    queue: aio_pika.abc.AbstractQueue,
) -> aio_pika.abc.AbstractIncomingMessage:
    async with queue.iterator() as messages:
        async for message in messages:
            await message.ack()
            return message
    raise AssertionError("unreachable")


def test_a_keys_file_that_cannot_be_used_stops_the_gateway_with_one_line(
    tmp_path: Path, make_settings: Callable[..., Settings], capsys: pytest.CaptureFixture[str]
) -> None:
    from trtllm_worker.gateway.server import serve

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-secret-value": {"tenant": "a", "priority": 12}}))
    settings = make_settings(gateway_keys_file=keys, gateway_port=0)
    assert serve(settings) == 2
    err = capsys.readouterr().err
    assert "keys.json" in err
    assert "priority" in err
    assert "sk-secret-value" not in err, "a key is never printed"


# -- back-pressure and outages ------------------------------------------------------------


async def test_over_the_queue_depth_new_requests_get_429_with_retry_after(
    sdk: Sdk,
    run_gateway: GatewayFactory,
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    cleanup_keys: None,
) -> None:
    async with run_worker():
        pass  # the queue exists; no worker takes from it now
    async with Client(make_settings()) as client:
        for _ in range(3):
            await client.submit("queued", {"max_new_tokens": 1})
    async with run_gateway(gateway_max_queued=2, model_name=MODEL) as gateway:
        with pytest.raises(openai.RateLimitError) as limited:
            await sdk(gateway).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert limited.value.response.headers["retry-after"] == "1"
        assert limited.value.code == "rate_limit_exceeded"
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            page = (await http.get("/metrics")).text
    assert 'trtllm_gateway_requests_total{route="completions",status="429"} 1.0' in page


async def test_rabbitmq_unreachable_is_503(
    sdk: Sdk, run_gateway: GatewayFactory, unused_tcp_port: int
) -> None:
    async with run_gateway(
        amqp_url=f"amqp://guest:guest@127.0.0.1:{unused_tcp_port}/", model_name=MODEL
    ) as gateway:
        with pytest.raises(openai.InternalServerError) as down:
            await sdk(gateway).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert down.value.status_code == 503
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            assert (await http.get("/readyz")).status_code == 503
            assert (await http.get("/healthz")).status_code == 200


# -- a client that leaves -----------------------------------------------------------------


async def test_a_client_that_leaves_a_stream_cancels_its_job(
    run_worker: WorkerFactory, run_gateway: GatewayFactory, subscriber: Subscriber
) -> None:
    async with (
        run_worker(echo_step_ms=20),
        run_gateway(model_name=MODEL) as gateway,
        httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http,
    ):
        body = {"model": MODEL, "prompt": "a long answer " * 20, "max_tokens": 200,
                "stream": True}  # fmt: skip
        async with http.stream("POST", "/completions", json=body) as response:
            request_id = response.headers["x-request-id"]
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data:"):
                    break  # the first chunk: the job runs; now leave
        done = await done_entry(subscriber, request_id)
    assert done["finish_reason"] == "cancelled"
    assert int(done["generated_tokens"]) < 200


async def test_a_client_that_leaves_before_a_whole_answer_cancels_its_job(
    run_worker: WorkerFactory, run_gateway: GatewayFactory, subscriber: Subscriber
) -> None:
    async with (
        run_worker(echo_step_ms=20),
        run_gateway(model_name=MODEL) as gateway,
        httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http,
    ):
        body = {"model": MODEL, "prompt": "a long answer " * 20, "max_tokens": 200}
        post = asyncio.create_task(http.post("/completions", json=body))
        # the job is running once its stream has a token entry
        request_id = await first_running(subscriber)
        post.cancel()  # closes the connection
        await asyncio.gather(post, return_exceptions=True)
        done = await done_entry(subscriber, request_id)
    assert done["finish_reason"] == "cancelled"


async def first_running(subscriber: Subscriber) -> str:
    """The request id of the first stream under the test's prefix that has a token."""
    redis = subscriber.redis
    async with asyncio.timeout(15):
        while True:
            async for key in redis.scan_iter(match=subscriber.prefix + "*", _type="stream"):
                if await redis.xlen(key):
                    return cast(str, key)[len(subscriber.prefix) :]
            await asyncio.sleep(0.02)


# -- /v1/streams --------------------------------------------------------------------------


async def test_the_stream_route_sends_each_entry_with_its_id_and_resumes_after_one(
    sdk: Sdk, served: GatewayServer, subscriber: Subscriber, redis_client: aioredis.Redis
) -> None:
    answer = await sdk(served).completions.with_raw_response.create(
        model=MODEL, prompt="resume me", max_tokens=6
    )
    request_id = answer.headers["x-request-id"]
    stored = cast(
        list[tuple[str, dict[str, str]]], await redis_client.xrange(subscriber.key(request_id))
    )
    async with httpx.AsyncClient(base_url=served.url) as http:
        whole = await _events(http, request_id)
        middle = stored[2][0]
        rest = await _events(http, request_id, {"Last-Event-ID": middle})
        after_end = await http.get(
            f"/v1/streams/{request_id}", headers={"Last-Event-ID": stored[-1][0]}
        )
        bad = await http.get(f"/v1/streams/{request_id}", headers={"Last-Event-ID": "x"})
    assert whole == stored
    assert rest == stored[3:]
    assert after_end.status_code == 204, "an ended stream tells EventSource not to reconnect"
    assert bad.status_code == 400


async def _events(
    http: httpx.AsyncClient, request_id: str, headers: dict[str, str] | None = None
) -> list[tuple[str, dict[str, str]]]:
    """The stream route's events as (id, data) until the response ends."""
    events: list[tuple[str, dict[str, str]]] = []
    entry_id = ""
    async with http.stream("GET", f"/v1/streams/{request_id}", headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("id:"):
                entry_id = line[3:].strip()
            elif line.startswith("data:"):
                events.append((entry_id, json.loads(line[5:])))
    return events


# -- files and batches --------------------------------------------------------------------


async def test_a_batch_through_the_files_and_batches_api(
    sdk: Sdk, served: GatewayServer, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL, "messages": [{"role": "user", "content": f"line {i} é"}],
                  "max_tokens": 4}}
        for i in range(5)
    ]  # fmt: skip
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": MODEL, "messages": []}})  # fmt: skip
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    client = sdk(served)
    with source.open("rb") as file:
        uploaded = await client.files.create(file=file, purpose="batch")
    assert uploaded.bytes == source.stat().st_size
    assert (await client.files.content(uploaded.id)).content == source.read_bytes()
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.input_file_id == uploaded.id
    async with Client(make_settings()) as sdk_client:
        final = await sdk_client.wait_batch(batch.id)
    assert final["status"] == "completed"
    got = await client.batches.retrieve(batch.id)
    assert got.status == "completed"
    assert got.request_counts is not None
    assert got.request_counts.completed == 5
    assert got.output_file_id is not None
    assert got.error_file_id is not None
    output = (await client.files.content(got.output_file_id)).text.splitlines()
    errors = (await client.files.content(got.error_file_id)).text.splitlines()
    assert [json.loads(line)["custom_id"] for line in output] == [f"c{i}" for i in range(5)]
    assert [json.loads(line)["custom_id"] for line in errors] == ["bad"]
    async with Client(make_settings()) as sdk_client:
        direct = [line async for ok, line in sdk_client.batch_results(batch.id) if ok]
    assert [line.decode().rstrip("\n") for line in direct] == output
    assert (await client.files.retrieve(got.output_file_id)).purpose == "batch_output"
    listed = await client.batches.list(limit=5)
    assert batch.id in [b.id for b in listed.data]
    assert uploaded.id in [f.id async for f in client.files.list(purpose="batch")]
    assert [f.id async for f in client.files.list(purpose="batch_output")] == []
    deleted = await client.files.delete(uploaded.id)
    assert deleted.deleted
    assert uploaded.id not in [f.id async for f in client.files.list()]
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        await client.batches.retrieve("batch-nothere")


async def test_files_are_listed_newest_first_a_page_at_a_time(
    sdk: Sdk, served: GatewayServer, tmp_path: Path, cleanup_keys: None
) -> None:
    client = sdk(served)
    uploaded = []
    for number in range(3):
        source = tmp_path / f"in{number}.jsonl"
        source.write_text(json.dumps({"custom_id": f"c{number}"}) + "\n")
        with source.open("rb") as file:
            uploaded.append((await client.files.create(file=file, purpose="batch")).id)
    first = await client.files.list(limit=2)
    assert [f.id for f in first.data] == uploaded[:0:-1]
    assert first.has_more
    rest = await client.files.list(limit=2, after=first.data[-1].id)
    assert [f.id for f in rest.data] == uploaded[:1]
    assert not rest.has_more
    assert [f.id async for f in client.files.list(order="asc")] == uploaded
    with pytest.raises(openai.BadRequestError) as refused:
        await client.files.list(limit=0)
    assert refused.value.param == "limit"


async def test_a_tenant_sees_only_its_own_files_and_batches(
    sdk: Sdk,
    run_worker: WorkerFactory,
    run_gateway: GatewayFactory,
    tmp_path: Path,
    cleanup_keys: None,
) -> None:
    keys = tmp_path / "keys.json"
    write_keys(
        keys,
        {
            "sk-acme": {"tenant": "acme", "priority": 0},
            "sk-beta": {"tenant": "beta", "priority": 0},
        },
    )
    line = {"custom_id": "c0", "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "abc", "max_tokens": 2}}  # fmt: skip
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(line) + "\n")
    async with (
        run_worker(model_name=MODEL),
        run_gateway(gateway_keys_file=keys, model_name=MODEL) as gateway,
    ):
        acme, beta = sdk(gateway, "sk-acme"), sdk(gateway, "sk-beta")
        with source.open("rb") as file:
            uploaded = await acme.files.create(file=file, purpose="batch")
        with pytest.raises(openai.NotFoundError):
            await beta.files.retrieve(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            await beta.files.content(uploaded.id)
        assert [f.id async for f in beta.files.list()] == []
        assert [f.id async for f in acme.files.list()] == [uploaded.id]
        with pytest.raises(openai.NotFoundError):
            await beta.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
            )
        batch = await acme.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        with pytest.raises(openai.NotFoundError):
            await beta.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            await beta.batches.cancel(batch.id)
        assert batch.id not in [b.id for b in (await beta.batches.list()).data]
        assert batch.id in [b.id for b in (await acme.batches.list()).data]
        async with Client(gateway.app.state.gateway.settings) as direct:
            final = await direct.wait_batch(batch.id)
        assert final["status"] == "completed"
        assert final["output_file_id"] is not None
        with pytest.raises(openai.NotFoundError):
            await beta.files.content(final["output_file_id"])
        output = (await acme.files.content(final["output_file_id"])).text
        assert json.loads(output)["custom_id"] == "c0"
        with pytest.raises(openai.NotFoundError):
            await beta.files.delete(uploaded.id)
        assert (await acme.files.retrieve(uploaded.id)).id == uploaded.id


# -- one stream reader per gateway --------------------------------------------------------


async def gateway_connections(redis_client: aioredis.Redis) -> int:
    clients = await redis_client.client_list()
    return sum(1 for c in clients if c.get("name", "").startswith("trtllm-worker-gateway"))


async def test_hundreds_of_answers_at_once_share_a_few_redis_connections(
    sdk: Sdk,
    run_worker: WorkerFactory,
    run_gateway: GatewayFactory,
    redis_client: aioredis.Redis,
    subscriber: Subscriber,
) -> None:
    """150 streamed answers open at once, each whole and exact, while the gateway holds a
    handful of Redis connections (with a blocked XREAD per answer it held one each: past
    redis-py's pool of 100, the next answer got a 503; with a PING per answer arriving
    before the shared reader ran, 9 to 13)."""
    answers = 150
    async with (
        run_worker(model_name=MODEL, echo_step_ms=20, max_batch=answers),
        run_gateway(model_name=MODEL) as gateway,
    ):
        await _answer_many(sdk(gateway), answers, redis_client, subscriber)


async def _answer_many(
    client: openai.AsyncOpenAI, answers: int, redis_client: aioredis.Redis, subscriber: Subscriber
) -> None:
    most = 0
    ended = asyncio.Event()

    async def one(number: int) -> tuple[str, str]:
        chunks = await client.completions.create(
            model=MODEL, prompt=f"answer {number:03d} ", max_tokens=20, stream=True
        )
        got = [c async for c in chunks]
        return request_id_of(got[0].id), "".join(c.choices[0].text for c in got if c.choices)

    async def watch() -> None:
        nonlocal most
        while not ended.is_set():
            most = max(most, await gateway_connections(redis_client))
            await asyncio.sleep(0.05)

    watching = asyncio.create_task(watch())
    try:
        texts = await asyncio.gather(*(one(n) for n in range(answers)))
    finally:
        ended.set()
        await watching
    for request_id, text in texts:
        assert text == (await done_entry(subscriber, request_id))["generated_text"]
    assert len({request_id for request_id, _ in texts}) == answers
    assert 1 <= most <= 5, f"{most} Redis connections for {answers} answers"


async def test_an_answer_joining_an_idle_reader_does_not_wait_out_its_block(
    sdk: Sdk, served: GatewayServer
) -> None:
    """The reader blocks on a stream nothing writes to, for a minute; an answer that
    joins then wakes it: it comes in well within that minute."""
    gateway = served.app.state.gateway
    gateway.client.xread_block_ms = 60_000
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
        idle = await http.send(
            http.build_request("GET", "/streams/nothing-writes-here"), stream=True
        )
        assert idle.status_code == 200
        xreads = gateway.reader.xreads
        async with asyncio.timeout(20):
            answer = await sdk(served).completions.create(model=MODEL, prompt="abc", max_tokens=3)
        await idle.aclose()
    assert answer.choices[0].finish_reason == "length"
    assert gateway.reader.xreads > xreads, "the answer was not read by the shared reader"
