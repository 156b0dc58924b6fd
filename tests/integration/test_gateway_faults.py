"""The gateway's durability with real processes: a worker killed mid-answer is invisible
to the client, a gateway replica killed mid-answer loses only its own connections (the
answer goes on and is read from another replica's `/v1/streams`), and a batch whose
publishing replica died is published to its end by the next replica asked about it."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from tests.integration.conftest import (
    GatewayFactory,
    Spawn,
    SpawnGateway,
    Subscriber,
    WorkerFactory,
)
from tests.integration.test_batch_faults import assert_each_line_once, batch_file, finish
from tests.integration.test_faults import wait_until
from tests.integration.test_gateway import done_entry, first_running
from tests.services import ServiceUrls
from tests.tcp_proxy import proxied
from trtllm_worker.client import Client
from trtllm_worker.client.async_client import SOCKET_TIMEOUT_S
from trtllm_worker.config import Settings
from trtllm_worker.contract.batches import batch_key

MODEL = "echo"


async def last_event(redis: aioredis.Redis, key: str) -> str | None:
    last = cast(list[tuple[str, dict[str, str]]], await redis.xrevrange(key, count=1))
    return last[0][1]["event"] if last else None


@pytest.mark.timeout(90)
async def test_a_worker_killed_mid_answer_is_invisible_to_the_client(
    spawn: Spawn, run_gateway: GatewayFactory, subscriber: Subscriber
) -> None:
    """The streamed answer goes on, exact, from the worker that takes the job over: the
    client reads one answer, its text the job's whole `generated_text`."""
    env = {"WORKER_ECHO_STEP_MS": "20"}
    doomed = await spawn(**env)
    async with (
        run_gateway() as gateway,
        openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=0) as client,
    ):
        stream = await client.completions.create(
            model=MODEL, prompt="a steady answer ", max_tokens=120, stream=True
        )
        texts: list[str] = []
        request_id = ""
        survivor = None
        async for chunk in stream:
            request_id = chunk.id.removeprefix("cmpl-")
            texts.append(chunk.choices[0].text)
            if len(texts) == 10:
                survivor = await spawn(**env)
                doomed.signal(signal.SIGKILL)
                assert await doomed.wait() == -signal.SIGKILL
                key = subscriber.key(request_id)
                assert await last_event(subscriber.redis, key) == "token", "killed mid-answer"
        done = (await subscriber.read_until_terminal(request_id))[-1]
    assert survivor is not None
    assert "".join(texts) == done["generated_text"]
    assert int(done["generated_tokens"]) == 120
    assert done["finish_reason"] == "length"
    assert "resuming after" in survivor.log(), "the survivor resumed the killed worker's job"


@pytest.mark.timeout(90)
async def test_a_gateway_killed_mid_answer_loses_only_its_connection(
    run_worker: WorkerFactory,
    spawn_gateway: SpawnGateway,
    run_gateway: GatewayFactory,
    subscriber: Subscriber,
) -> None:
    """The job is not cancelled by its gateway's death: the client reads the rest of the
    answer from another replica's `/v1/streams/{id}`, after what it already has."""
    async with run_worker(echo_step_ms=20):
        doomed = await spawn_gateway()
        got: list[str] = []
        body = {"model": MODEL, "prompt": "survive the gateway ", "max_tokens": 100,
                "stream": True}  # fmt: skip
        ids: list[str] = []

        async def read_until_killed(http: httpx.AsyncClient) -> None:
            async with http.stream("POST", "/completions", json=body) as response:
                ids.append(response.headers["x-request-id"])
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        got.append(json.loads(line[5:])["choices"][0]["text"])
                    if len(got) == 5:
                        doomed.process.send_signal(signal.SIGKILL)

        async with httpx.AsyncClient(base_url=doomed.base_url, timeout=30) as http:
            with pytest.raises(httpx.HTTPError):  # the connection dies with the gateway
                await read_until_killed(http)
        (request_id,) = ids
        assert await doomed.process.wait() == -signal.SIGKILL
        assert await last_event(subscriber.redis, subscriber.key(request_id)) == "token"
        async with (
            run_gateway() as other,
            httpx.AsyncClient(base_url=other.url, timeout=30) as http,
        ):
            entries = await sse_entries(http, f"/v1/streams/{request_id}")
    tokens = [e for e in entries if e["event"] == "token"]
    done = entries[-1]
    assert done["event"] == "done"
    assert done["finish_reason"] == "length", "the job ran on; nobody cancelled it"
    assert [int(e["index"]) for e in tokens] == list(range(100))
    text = "".join(e["text"] for e in tokens)
    assert text == done["generated_text"]
    assert text.startswith("".join(got))


async def sse_entries(http: httpx.AsyncClient, path: str) -> list[dict[str, str]]:
    entries: list[dict[str, str]] = []
    async with http.stream("GET", path) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                entries.append(json.loads(line[5:]))
    return entries


@pytest.mark.timeout(150)
async def test_a_batch_whose_gateway_died_while_publishing_is_taken_over(
    spawn_gateway: SpawnGateway,
    run_worker: WorkerFactory,
    make_settings: Callable[..., Settings],
    redis_client: aioredis.Redis,
    names: dict[str, str],
    cleanup_keys: None,
    tmp_path: Path,
) -> None:
    """The replica publishing a batch's lines is killed while the batch is `validating`;
    once its lease lapses, the next replica asked for the batch publishes the rest, and
    every line ends once."""
    async with run_worker():
        pass  # the queue exists; lines wait in it while they are published
    source, lines = batch_file(tmp_path / "in.jsonl", 6000, 1, "takeover")
    doomed = await spawn_gateway()
    key = batch_key(names["stream_prefix"], "")
    async with openai.AsyncOpenAI(base_url=doomed.base_url, api_key="x", max_retries=0) as sdk:
        with source.open("rb") as file:
            uploaded = await sdk.files.create(file=file, purpose="batch")
        batch = await sdk.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
    meta_key = key + batch.id

    async def published() -> int:
        return int(await redis_client.hget(meta_key, "published") or 0)

    await wait_until(lambda: _positive(published()))
    doomed.process.send_signal(signal.SIGKILL)
    assert await doomed.process.wait() == -signal.SIGKILL
    at_kill = await published()
    assert at_kill < len(lines), "killed mid-publishing"
    assert "in_progress_at" not in await redis_client.hgetall(meta_key)
    other = await spawn_gateway()
    async with (
        openai.AsyncOpenAI(base_url=other.base_url, api_key="x", max_retries=0) as sdk,
        run_worker(max_batch=256),
        Client(make_settings()) as client,
    ):
        assert (await sdk.batches.retrieve(batch.id)).status == "validating"

        async def taken_over() -> bool:
            return "publishing the rest here" in other.log()

        async def asked() -> bool:  # the lease lapses a few seconds after the kill
            await sdk.batches.retrieve(batch.id)
            return await taken_over()

        await wait_until(asked, within_s=30)
        final, output, errors = await finish(client, batch.id, tmp_path)
    assert_each_line_once(lines, final, output, errors)


async def _positive(value: Any) -> bool:
    return bool(await value)


async def test_redis_lost_before_a_whole_answer_is_503_and_cancels_the_job(
    run_worker: WorkerFactory,
    run_gateway: GatewayFactory,
    subscriber: Subscriber,
    services: ServiceUrls,
) -> None:
    """The gateway reads Redis through a proxy that is cut while a whole answer is being
    collected: past the reconnect timeout the client gets 503, which names no request
    id, so nobody could follow the job; the gateway cancels it instead of letting it
    run on for nobody."""
    async with (
        proxied(services.redis) as (redis_url, proxy),
        run_worker(echo_step_ms=20),
        run_gateway(model_name=MODEL, redis_url=redis_url) as gateway,
        httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http,
    ):
        gateway.app.state.gateway.client.reconnect_timeout_s = 1.0
        body = {"model": MODEL, "prompt": "a long answer " * 20, "max_tokens": 400}
        post = asyncio.create_task(http.post("/completions", json=body))
        request_id = await first_running(subscriber)
        hub = gateway.app.state.gateway.reader

        async def reading() -> bool:  # cut under the XREAD, not under the first PING
            return bool(hub.reading)

        await wait_until(reading)
        await proxy.cut()
        response = await post
        assert response.status_code == 503, response.text
        client = gateway.app.state.gateway.client
        assert proxy.refused >= 1, (
            f"the gateway never tried Redis again (reconnects {client.reconnects}, "
            f"connections {proxy.connections}): {response.text}"
        )
        done = await done_entry(subscriber, request_id)
    assert done["finish_reason"] == "cancelled"
    assert int(done["generated_tokens"]) < 400


@pytest.mark.parametrize("reader", ["idle", "blocked"])
async def test_a_redis_connection_dropped_as_it_is_taken_does_not_fail_an_answer(
    reader: str, run_worker: WorkerFactory, run_gateway: GatewayFactory, services: ServiceUrls
) -> None:
    """Redis (or a proxy before it) closes the gateway's pooled connections just as the
    next answer takes one: the gateway tries a fresh connection before it gives up. The
    next answer either finds the shared reader idle (it asks Redis first: that once
    answered 503 at once) or blocked on other streams for a minute (it wakes the reader:
    that once failed silently, and the answer came only when the blocked XREAD's socket
    timed out)."""
    async with (
        proxied(services.redis) as (redis_url, proxy),
        run_worker(),
        run_gateway(model_name=MODEL, redis_url=redis_url) as gateway,
        openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=0) as client,
    ):
        hub = gateway.app.state.gateway.reader
        if reader == "blocked":
            hub.client.xread_block_ms = 60_000
        body: dict[str, Any] = {"model": MODEL, "prompt": "again", "max_tokens": 8}
        first = await client.completions.create(**body)
        if reader == "idle":

            async def idle() -> bool:
                return not hub.reading

            await wait_until(idle)
        else:
            assert hub.reading, "the reader blocks on the first answer's ended stream"
            await hub.client.answering_redis()  # a connection left idle in the pool
        proxy.drop_at_next_command()
        # an unwoken reader would read the new stream only after its socket timeout
        async with asyncio.timeout(SOCKET_TIMEOUT_S * 0.8):
            second = await client.completions.create(**body)
    # idle: the PING's connection; blocked: the wake's, and the blocked XREAD's own
    assert proxy.dropped >= (1 if reader == "idle" else 2), "no connection was dropped"
    assert second.choices[0].text == first.choices[0].text
    assert second.choices[0].finish_reason == "length"


async def test_a_stream_resumed_over_a_dropped_redis_connection_goes_on(
    run_worker: WorkerFactory,
    run_gateway: GatewayFactory,
    services: ServiceUrls,
    redis_client: aioredis.Redis,
    subscriber: Subscriber,
) -> None:
    """A browser resumes `/v1/streams/{id}` with `Last-Event-ID` just as Redis drops the
    gateway's idle connections: the rest of the stream comes (the route's check whether
    the stream ended reads once more on a fresh connection). It once answered 503, on
    which a browser's EventSource gives up for good."""
    async with (
        proxied(services.redis) as (redis_url, proxy),
        run_worker(),
        run_gateway(model_name=MODEL, redis_url=redis_url) as gateway,
        httpx.AsyncClient(base_url=gateway.url, timeout=30) as http,
    ):
        body = {"model": MODEL, "prompt": "resume me", "max_tokens": 6}
        request_id = (await http.post("/v1/completions", json=body)).headers["x-request-id"]
        stored = cast(
            list[tuple[str, dict[str, str]]], await redis_client.xrange(subscriber.key(request_id))
        )
        await gateway.app.state.gateway.client.answering_redis()  # one connection idle
        proxy.drop_at_next_command()
        rest: list[tuple[str, dict[str, str]]] = []
        headers = {"Last-Event-ID": stored[2][0]}
        async with http.stream("GET", f"/v1/streams/{request_id}", headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            entry_id = ""
            async for line in response.aiter_lines():
                if line.startswith("id:"):
                    entry_id = line[3:].strip()
                elif line.startswith("data:"):
                    rest.append((entry_id, json.loads(line[5:])))
    assert proxy.dropped >= 1, "the resume's first command went over a dropped connection"
    assert rest == stored[3:]


async def test_files_and_batches_answer_503_while_redis_is_lost(
    run_gateway: GatewayFactory, services: ServiceUrls
) -> None:
    """Redis lost under the Files and Batches routes: 503 `service_unavailable` (which
    the SDKs retry), as the other routes answer; they once answered a bare 500."""
    async with (
        proxied(services.redis) as (redis_url, proxy),
        run_gateway(model_name=MODEL, redis_url=redis_url) as gateway,
        openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=0) as client,
    ):
        assert [f.id async for f in client.files.list()] == []
        await proxy.cut()
        for call in (client.files.list, client.batches.list):
            with pytest.raises(openai.InternalServerError) as caught:
                await call()
            assert caught.value.status_code == 503
            assert caught.value.code == "service_unavailable"
    assert proxy.refused >= 1, "the gateway never met the lost Redis"
