"""`/v1/streams/{request_id}` in a real browser: headless Chromium (Debian's `chromium`),
driven over the DevTools protocol (tests/cdp.py), opens the documented page
(docs/examples/gateway_stream.html) from an origin of its own. Its `EventSource` reads a
job published with the SDK; the gateway process is killed mid-stream and started again
on its port; the browser reconnects by itself with `Last-Event-ID` and the page ends with
the whole answer, every entry once. A page from an origin the gateway does not list gets
no stream at all (CORS)."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlencode

import aio_pika
import pytest
import redis.asyncio as aioredis

from tests.cdp import Browser, Event, Page, chromium
from tests.integration.conftest import SpawnGateway, Subscriber, WorkerFactory
from trtllm_worker.client import Client
from trtllm_worker.config import Settings

EXAMPLES = Path(__file__).parents[2] / "docs" / "examples"
PAGE = "gateway_stream.html"
KEY = "sk-test-browser"
TOKENS = 60

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        chromium() is None,
        reason="Chromium is not installed (apt-get install chromium; .ci/run does so)",
    ),
]


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[str]:
    """`directory` over HTTP on a port of its own: an origin of its own."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, name="page-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def page_origin() -> Iterator[str]:
    """docs/examples served from another port than the gateway's: another origin."""
    with serve(EXAMPLES) as origin:
        yield origin


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[Browser]:
    async with Browser.launch(tmp_path / "chromium") as browser:
        yield browser


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY: {"tenant": "browser", "priority": 5}}))
    return keys


async def open_page(browser: Browser, origin: str, gateway: str, request_id: str) -> Page:
    page = await browser.new_page()
    await page.send("Network.enable")
    query = urlencode({"gateway": gateway, "request": request_id, "key": KEY})
    await page.navigate(f"{origin}/{PAGE}?{query}")
    return page


def entries(browser: Browser) -> list[Event]:
    """The stream's entries as the page's EventSource received them."""
    return browser.select("Network.eventSourceMessageReceived")


def is_stream_request(request_id: str) -> Callable[[Event], bool]:
    def matches(event: Event) -> bool:
        return event.method == "Network.requestWillBeSent" and (
            f"/v1/streams/{request_id}?" in event.params["request"]["url"]
        )

    return matches


async def sent_headers(browser: Browser, request_id: str) -> dict[str, str]:
    """The request's headers as sent on the wire (Last-Event-ID, Origin among them)."""
    event = await browser.wait_for(
        lambda e: (
            e.method == "Network.requestWillBeSentExtraInfo" and e.params["requestId"] == request_id
        ),
        what=f"the headers of request {request_id}",
    )
    return cast(dict[str, str], event.params["headers"])


def header(headers: dict[str, str], name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name.lower()), None)


async def test_an_event_source_resumes_after_the_gateway_dies(
    browser: Browser,
    page_origin: str,
    keys_file: Path,
    run_worker: WorkerFactory,
    spawn_gateway: SpawnGateway,
    make_settings: Callable[..., Settings],
    subscriber: Subscriber,
    redis_client: aioredis.Redis,
    amqp_channel: aio_pika.abc.AbstractChannel,  # deletes the test's queues afterwards
    unused_tcp_port: int,
) -> None:
    env = {
        "WORKER_GATEWAY_PORT": str(unused_tcp_port),
        "WORKER_GATEWAY_KEYS_FILE": str(keys_file),
        "WORKER_GATEWAY_CORS_ORIGINS": page_origin,
    }
    gateway_url = f"http://127.0.0.1:{unused_tcp_port}"
    async with run_worker(echo_step_ms=50):
        gateway = await spawn_gateway(**env)
        async with Client(make_settings()) as client:
            request_id = await client.submit("a browser reads me " * 4, {"max_new_tokens": TOKENS})
        page = await open_page(browser, page_origin, gateway_url, request_id)

        # a few entries in, the gateway dies (kill -9: no goodbye on the connection)
        await browser.wait_for(lambda e: len(entries(browser)) >= 5, what="5 entries")
        gateway.process.send_signal(signal.SIGKILL)
        await gateway.process.wait()
        before = [json.loads(e.params["data"]) for e in entries(browser)]
        assert all(entry["event"] == "token" for entry in before), "killed mid-stream"
        # and comes back on its port; the page's EventSource reconnects by itself
        again = await spawn_gateway(**env)
        title = await page.wait_until("document.title", within_s=60)
        done = await subscriber.read_until_terminal(request_id)
        for process in (gateway, again):
            assert KEY not in process.log(), "the gateway logs no query strings"

    assert title == "done"
    assert done[-1]["event"] == "done"
    text = await page.evaluate("document.getElementById('answer').textContent")
    assert text == done[-1]["generated_text"]
    assert int(done[-1]["generated_tokens"]) == TOKENS

    # every entry of the stream reached the page once, in order: none lost, none twice
    stored = cast(
        list[tuple[str, dict[str, str]]], await redis_client.xrange(subscriber.key(request_id))
    )
    messages = entries(browser)
    assert [m.params["eventId"] for m in messages] == [entry_id for entry_id, _ in stored]
    assert [json.loads(m.params["data"]) for m in messages] == [f for _, f in stored]

    # over two connections: the second one sent Last-Event-ID, the last id of the first,
    # and the gateway went on from the entry after it
    requests = [e for e in browser.events if is_stream_request(request_id)(e)]
    answered = [
        r for r in requests
        if browser.select("Network.responseReceived", requestId=r.params["requestId"])
    ]  # fmt: skip
    assert len(answered) == 2, [r.params["request"]["url"] for r in requests]
    first, second = (r.params["requestId"] for r in answered)
    on_first = [m.params["eventId"] for m in messages if m.params["requestId"] == first]
    on_second = [m.params["eventId"] for m in messages if m.params["requestId"] == second]
    assert on_first
    assert on_second
    assert header(await sent_headers(browser, first), "Last-Event-ID") is None
    assert header(await sent_headers(browser, second), "Last-Event-ID") == on_first[-1]
    ids = [entry_id for entry_id, _ in stored]
    assert ids.index(on_second[0]) == ids.index(on_first[-1]) + 1
    assert browser.select("Network.loadingFailed", requestId=first), "the first one broke"

    # CORS: each answer names the page's origin
    for request in answered:
        (response,) = browser.select("Network.responseReceived",
                                     requestId=request.params["requestId"])  # fmt: skip
        headers = response.params["response"]["headers"]
        assert response.params["response"]["status"] == 200
        assert header(headers, "Access-Control-Allow-Origin") == page_origin
        assert header(
            headers,
            "Content-Type",
        ).startswith("text/event-stream")  # type: ignore[union-attr]

    # ?api_key= is taken on /v1/streams only; elsewhere the key goes as a bearer header
    status = await page.evaluate(
        f"fetch({json.dumps(gateway_url + '/v1/models?api_key=' + KEY)}).then(r => r.status)"
    )
    assert status == 401
    status = await page.evaluate(
        f"fetch({json.dumps(gateway_url + '/v1/models')}, "
        f"{{headers: {{Authorization: 'Bearer {KEY}'}}}}).then(r => r.status)"
    )
    assert status == 200


async def test_a_page_from_an_origin_not_listed_gets_no_stream(
    browser: Browser,
    page_origin: str,
    keys_file: Path,
    run_worker: WorkerFactory,
    spawn_gateway: SpawnGateway,
    make_settings: Callable[..., Settings],
    subscriber: Subscriber,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    async with run_worker():
        gateway = await spawn_gateway(
            WORKER_GATEWAY_KEYS_FILE=str(keys_file),
            WORKER_GATEWAY_CORS_ORIGINS="http://127.0.0.1:1,https://app.example",
        )
        async with Client(make_settings()) as client:
            request_id = await client.submit("not for you", {"max_new_tokens": 8})
        await subscriber.read_until_terminal(request_id)
        page = await open_page(browser, page_origin, gateway.base_url[: -len("/v1")], request_id)
        request = await browser.wait_for(is_stream_request(request_id), what="the request")
        failed = await browser.wait_for(
            lambda e: (
                e.method == "Network.loadingFailed"
                and e.params["requestId"] == request.params["requestId"]
            ),
            what="the stream's request failing",
        )
        # the EventSource fails for good: closed, no reconnecting, nothing on the page
        state = await page.wait_until("source.readyState === EventSource.CLOSED && 'closed'")
    assert state == "closed"
    assert failed.params.get("corsErrorStatus", {}).get("corsError") == (
        "MissingAllowOriginHeader"
    ), failed.params
    assert not entries(browser)
    assert await page.evaluate("document.getElementById('answer').textContent") == ""


async def test_an_event_source_opened_before_its_job_stops_at_the_end(
    browser: Browser,
    page_origin: str,
    keys_file: Path,
    run_worker: WorkerFactory,
    spawn_gateway: SpawnGateway,
    make_settings: Callable[..., Settings],
    subscriber: Subscriber,
    redis_client: aioredis.Redis,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    """A page that opens the stream before the job is published gets it from its first
    entry; one that never closes its EventSource reconnects once after the terminal
    entry, gets 204, and stops for good (no reconnecting forever)."""
    async with run_worker(echo_step_ms=5):
        gateway = await spawn_gateway(
            WORKER_GATEWAY_KEYS_FILE=str(keys_file), WORKER_GATEWAY_CORS_ORIGINS="*"
        )
        gateway_url = gateway.base_url[: -len("/v1")]
        async with Client(make_settings()) as client:
            request_id = uuid.uuid4().hex
            page = await browser.new_page()
            await page.send("Network.enable")
            await page.navigate(f"{page_origin}/")  # any page of that origin
            url = f"{gateway_url}/v1/streams/{request_id}?api_key={KEY}"
            await page.evaluate(
                f"window.source = new EventSource({json.dumps(url)}); window.got = [];"
                "source.onmessage = (m) => got.push([m.lastEventId, JSON.parse(m.data)]);"
                "true"
            )
            await browser.wait_for(is_stream_request(request_id), what="the request")
            assert await client.submit("early bird", {"max_new_tokens": 9},
                                       request_id=request_id) == request_id  # fmt: skip
            await page.wait_until("source.readyState === EventSource.CLOSED")
        await subscriber.read_until_terminal(request_id)
        assert KEY not in gateway.log(), "the gateway logs no query strings"
    stored = cast(
        list[tuple[str, dict[str, str]]], await redis_client.xrange(subscriber.key(request_id))
    )
    assert await page.evaluate("got") == [[i, f] for i, f in stored]
    assert stored[-1][1]["event"] == "done"
    requests = [e for e in browser.events if is_stream_request(request_id)(e)]
    assert len(requests) == 2
    first, last = (r.params["requestId"] for r in requests)
    assert header(await sent_headers(browser, first), "Last-Event-ID") is None
    assert header(await sent_headers(browser, last), "Last-Event-ID") == stored[-1][0]
    (ended,) = browser.select("Network.responseReceived", requestId=last)
    assert ended.params["response"]["status"] == 204
    assert header(ended.params["response"]["headers"], "Access-Control-Allow-Origin") == "*"


@pytest.fixture
def sdk_origin(tmp_path: Path) -> Iterator[str]:
    """A page of its own origin with the official `openai` package (tests/node's, as npm
    installed it: ES modules a browser imports as they are)."""
    from tests.node_deps import node_modules

    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the browser SDK test takes its openai package")
    site = tmp_path / "site"
    site.mkdir()
    (site / "openai").symlink_to(node_modules() / "openai", target_is_directory=True)
    (site / "sdk.html").write_text(SDK_PAGE)
    with serve(site) as origin:
        yield origin


SDK_PAGE = """<!doctype html>
<meta charset="utf-8">
<script type="module">
  import OpenAI from "./openai/index.mjs";
  window.OpenAI = OpenAI;
  document.title = "loaded";
</script>
"""


TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen2.5.jinja"
MODEL = "tiny-echo"

SDK_CALLS = """(async () => {
  const client = new OpenAI({ baseURL: %(base)s, apiKey: %(key)s, maxRetries: 0,
                              dangerouslyAllowBrowser: true });
  const messages = [{ role: "user", content: "hello from a browser" }];
  const { data, response } = await client.chat.completions
    .create({ model: %(model)s, messages, max_tokens: 7 }).withResponse();
  const stream = await client.chat.completions.create({
    model: %(model)s, messages, max_tokens: 9, stream: true,
    stream_options: { include_usage: true } });
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  const models = [];
  for await (const m of client.models.list()) models.push(m.id);
  return {
    request_id: response.headers.get("x-request-id"),
    content: data.choices[0].message.content,
    usage: data.usage,
    stream_id: chunks[0].id,
    text: chunks.filter((c) => c.choices.length).map((c) => c.choices[0].delta.content ?? "")
      .join(""),
    stream_usage: chunks[chunks.length - 1].usage,
    models,
  };
})()"""


async def test_the_official_sdk_in_a_browser_page(
    browser: Browser,
    sdk_origin: str,
    keys_file: Path,
    run_worker: WorkerFactory,
    spawn_gateway: SpawnGateway,
    subscriber: Subscriber,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    """The `openai` package in a page of a listed origin (`dangerouslyAllowBrowser`):
    its POSTs carry its own headers (X-Stainless-*), which the preflight must allow, and
    the answer's X-Request-Id is readable by the page."""
    async with run_worker(chat_template=TEMPLATE, model_name=MODEL, echo_step_ms=2):
        gateway = await spawn_gateway(
            WORKER_GATEWAY_KEYS_FILE=str(keys_file),
            WORKER_GATEWAY_CORS_ORIGINS=sdk_origin,
            WORKER_CHAT_TEMPLATE=str(TEMPLATE),
            WORKER_MODEL_NAME=MODEL,
        )
        page = await browser.new_page()
        await page.send("Network.enable")
        await page.navigate(f"{sdk_origin}/sdk.html")
        await page.wait_until("document.title === 'loaded'")
        got = await page.evaluate(
            SDK_CALLS
            % {"base": json.dumps(gateway.base_url), "key": json.dumps(KEY),
               "model": json.dumps(MODEL)}
        )  # fmt: skip
        assert got["request_id"], "X-Request-Id is exposed to the page"
        whole = await subscriber.read_until_terminal(got["request_id"])
        streamed = await subscriber.read_until_terminal(got["stream_id"].split("-", 1)[1])
    assert got["content"] == whole[-1]["generated_text"]
    assert got["usage"]["completion_tokens"] == 7
    assert got["text"] == streamed[-1]["generated_text"]
    assert got["stream_usage"]["completion_tokens"] == 9
    assert got["models"] == [MODEL]
