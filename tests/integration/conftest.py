"""Integration fixtures: a worker running in this test's event loop against the real
RabbitMQ and Redis, a producer (aio-pika) and a subscriber (XREAD), as users have them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aio_pika
import pytest
import redis.asyncio as aioredis

from tests.services import ServiceUrls
from trtllm_worker.app.service import Service
from trtllm_worker.config import Settings

Entry = dict[str, str]
TERMINAL = ("done", "error")


class Producer:
    """Publishes jobs and cancels as a producer would."""

    def __init__(self, channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
        self.channel = channel
        self.queue = queue

    async def publish(self, body: dict[str, Any] | bytes, **properties: Any) -> None:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        properties.setdefault("content_type", "application/json")
        message = aio_pika.Message(
            payload, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, **properties
        )
        await self.channel.default_exchange.publish(message, routing_key=self.queue)

    async def cancel(self, request_id: str) -> None:
        exchange = await self.channel.get_exchange(f"{self.queue}.cancel")
        await exchange.publish(
            aio_pika.Message(json.dumps({"request_id": request_id}).encode()), routing_key=""
        )

    async def get_dead(self, wait_s: float = 10.0) -> aio_pika.abc.AbstractIncomingMessage:
        """The next message of `<queue>.dead` (acknowledged)."""
        queue = await self.channel.get_queue(f"{self.queue}.dead")
        async with asyncio.timeout(wait_s):
            async with queue.iterator() as messages:
                async for message in messages:
                    await message.ack()
                    return message
        raise AssertionError("unreachable")


class Subscriber:
    """Reads streams with XREAD from id 0, as the README tells users to."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.redis = client
        self.prefix = prefix

    def key(self, request_id: str) -> str:
        return self.prefix + request_id

    async def read_until_terminal(self, request_id: str, wait_s: float = 15.0) -> list[Entry]:
        key = self.key(request_id)
        entries: list[Entry] = []
        last_id = "0"
        async with asyncio.timeout(wait_s):
            while True:
                for _, items in await xread(self.redis, {key: last_id}, count=1000):
                    for entry_id, fields in items:
                        last_id = entry_id
                        entries.append(fields)
                        if fields["event"] in TERMINAL:
                            return entries

    async def read_many(
        self, request_ids: list[str], wait_s: float = 60.0
    ) -> dict[str, list[Entry]]:
        """Every stream to its terminal entry, with one XREAD over all that are open."""
        entries: dict[str, list[Entry]] = {i: [] for i in request_ids}
        last: dict[str, str] = {self.key(i): "0" for i in request_ids}
        by_key = {self.key(i): i for i in request_ids}
        async with asyncio.timeout(wait_s):
            while last:
                for key, items in await xread(self.redis, dict(last), count=1000):
                    for entry_id, fields in items:
                        entries[by_key[key]].append(fields)
                        last[key] = entry_id
                        if fields["event"] in TERMINAL:
                            del last[key]
                            break
        return entries

    async def first_entry(self, request_id: str, wait_s: float = 15.0) -> Entry:
        async with asyncio.timeout(wait_s):
            while True:
                reply = await xread(self.redis, {self.key(request_id): "0"}, count=1)
                if reply:
                    return reply[0][1][0][1]

    async def entries(self, request_id: str) -> list[Entry]:
        """Everything the stream holds now."""
        reply = await self.redis.xrange(self.key(request_id))
        return [fields for _, fields in cast(list[tuple[str, Entry]], reply)]


XreadReply = list[tuple[str, list[tuple[str, Entry]]]]


async def xread(client: aioredis.Redis, streams: dict[str, str], count: int) -> XreadReply:
    """XREAD BLOCK 1000 with the reply typed (redis-py's annotation is a union)."""
    reply = await client.xread(streams, block=1000, count=count)  # type: ignore[arg-type]
    return cast(XreadReply, reply)


def tokens(entries: list[Entry]) -> list[Entry]:
    return [e for e in entries if e["event"] == "token"]


def terminal(entries: list[Entry]) -> Entry:
    assert entries[-1]["event"] in TERMINAL
    assert all(e["event"] not in TERMINAL for e in entries[:-1]), "one terminal entry, last"
    return entries[-1]


@pytest.fixture
async def redis_client(services: ServiceUrls) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(services.redis, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def amqp_channel(services: ServiceUrls) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    connection = await aio_pika.connect(services.amqp)
    channel = await connection.channel()
    yield channel
    # the queues themselves go in tests/conftest.py's delete_test_queues, for every test
    await connection.close()


@pytest.fixture
async def cleanup_keys(redis_client: aioredis.Redis, names: dict[str, str]) -> AsyncIterator[None]:
    yield
    keys = [k async for k in redis_client.scan_iter(match=names["stream_prefix"] + "*")]
    keys += [k async for k in redis_client.scan_iter(match="{" + names["stream_prefix"] + "*")]
    if keys:
        await redis_client.delete(*keys)


@pytest.fixture
def producer(amqp_channel: aio_pika.abc.AbstractChannel, names: dict[str, str]) -> Producer:
    return Producer(amqp_channel, names["queue"])


@pytest.fixture
def subscriber(
    redis_client: aioredis.Redis, names: dict[str, str], cleanup_keys: None
) -> Subscriber:
    return Subscriber(redis_client, names["stream_prefix"])


WorkerFactory = Callable[..., AbstractAsyncContextManager[Service]]


@pytest.fixture
def run_worker(make_settings: Callable[..., Settings]) -> WorkerFactory:
    """`async with run_worker(**settings) as service:` runs a worker in this event loop."""

    @contextlib.asynccontextmanager
    async def run(**overrides: Any) -> AsyncIterator[Service]:
        async with Service(make_settings(**overrides)) as service:
            yield service

    return run


# -- worker processes (fault injection) ---------------------------------------------------

READY = re.compile(r"ready: engine \S+, HTTP on port (\d+)")


@dataclass
class WorkerProcess:
    """A worker process whose stderr is read continuously (a full pipe would block it)."""

    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    http_port: int = 0
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        assert self.process.stderr is not None
        while line := (await self.process.stderr.readline()).decode(errors="replace"):
            self.lines.append(line)
            match = READY.search(line)
            if match:
                self.http_port = int(match.group(1))
                self._ready.set()

    async def wait_ready(self, within_s: float = 30) -> None:
        try:
            await asyncio.wait_for(self._ready.wait(), within_s)
        except TimeoutError:
            raise AssertionError("worker not ready:\n" + "".join(self.lines)) from None

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def wait(self, within_s: float = 30) -> int:
        code = await asyncio.wait_for(self.process.wait(), within_s)
        if self._reader is not None:
            await self._reader
        return code

    def log(self) -> str:
        return "".join(self.lines)


Spawn = Callable[..., Awaitable[WorkerProcess]]


def worker_env(services: ServiceUrls, names: dict[str, str], **extra: str) -> dict[str, str]:
    """The environment of a worker process on this test's services, queue and prefix
    (nothing inherited from the caller's own WORKER_* variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        WORKER_AMQP_URL=services.amqp,
        WORKER_REDIS_URL=services.redis,
        WORKER_QUEUE=names["queue"],
        WORKER_STREAM_PREFIX=names["stream_prefix"],
        WORKER_HTTP_PORT="0",
    )
    env.update(extra)
    return env


@pytest.fixture
async def spawn(
    services: ServiceUrls, names: dict[str, str], tmp_path: Path
) -> AsyncIterator[Spawn]:
    """`await spawn(WORKER_ECHO_STEP_MS="5", ...)` starts a worker on this test's queue
    and prefix and waits until it is ready (`ready=False`: do not wait)."""
    started: list[WorkerProcess] = []

    async def start(ready: bool = True, **env: str) -> WorkerProcess:
        environment = worker_env(
            services, names, WORKER_HTTP_HOST="127.0.0.1", WORKER_LEASE_TTL_S="2", **env
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "trtllm_worker",
            "serve",
            env=environment,
            cwd=tmp_path,
            stderr=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
        )
        worker = WorkerProcess(process)
        worker._reader = asyncio.create_task(worker._read())
        started.append(worker)
        if ready:
            await worker.wait_ready()
        return worker

    yield start
    for worker in started:
        if worker.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGKILL)
            await worker.process.wait()
        if worker._reader is not None:
            worker._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker._reader


# -- the gateway ---------------------------------------------------------------------------

GATEWAY_READY = re.compile(r"gateway ready: model \S+, http://\S+:(\d+)/v1")


@dataclass
class GatewayServer:
    """A gateway serving in this test's event loop (uvicorn on a socket bound here)."""

    app: Any
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """What the OpenAI SDKs take as `base_url`."""
        return f"{self.url}/v1"


GatewayFactory = Callable[..., AbstractAsyncContextManager[GatewayServer]]


@pytest.fixture
def run_gateway(make_settings: Callable[..., Settings]) -> GatewayFactory:
    """`async with run_gateway(**settings) as gateway:` serves the gateway on a free port
    of 127.0.0.1 in this event loop, on this test's queue and prefix."""
    import uvicorn

    from trtllm_worker.gateway.app import create_app
    from trtllm_worker.gateway.server import bind

    @contextlib.asynccontextmanager
    async def run(**overrides: Any) -> AsyncIterator[GatewayServer]:
        settings = make_settings(**overrides)
        app = create_app(settings)
        sock = bind("127.0.0.1", 0)
        config = uvicorn.Config(
            app,
            lifespan="on",
            log_config=None,
            access_log=False,
            http="httptools",
            timeout_graceful_shutdown=5,
        )
        server = uvicorn.Server(config)
        # the socket listens already: a client may connect at once, uvicorn accepts once
        # the app's startup has run
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            yield GatewayServer(app, int(sock.getsockname()[1]))
        finally:
            server.should_exit = True
            await serving
            sock.close()

    return run


@dataclass
class GatewayProcess:
    """A `trtllm-worker gateway` process, its stderr read continuously."""

    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    port: int = 0
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        assert self.process.stderr is not None
        while line := (await self.process.stderr.readline()).decode(errors="replace"):
            self.lines.append(line)
            match = GATEWAY_READY.search(line)
            if match:
                self.port = int(match.group(1))
                self._ready.set()

    async def wait_ready(self, within_s: float = 30) -> None:
        try:
            await asyncio.wait_for(self._ready.wait(), within_s)
        except TimeoutError:
            raise AssertionError("gateway not ready:\n" + self.log()) from None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self) -> str:
        return "".join(self.lines)


SpawnGateway = Callable[..., Awaitable[GatewayProcess]]


@pytest.fixture
async def spawn_gateway(
    services: ServiceUrls, names: dict[str, str], tmp_path: Path
) -> AsyncIterator[SpawnGateway]:
    """`await spawn_gateway(WORKER_GATEWAY_KEYS_FILE=...)` starts a gateway process on
    this test's queue and prefix, on a free port, and waits until it serves."""
    started: list[GatewayProcess] = []

    async def start(ready: bool = True, **env: str) -> GatewayProcess:
        # a port of the test's choosing stands (a gateway restarted where it was)
        env = {"WORKER_GATEWAY_HOST": "127.0.0.1", "WORKER_GATEWAY_PORT": "0", **env}
        environment = worker_env(services, names, **env)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trtllm_worker", "gateway",
            env=environment, cwd=tmp_path,
            stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        gateway = GatewayProcess(process)
        gateway._reader = asyncio.create_task(gateway._read())
        started.append(gateway)
        if ready:
            await gateway.wait_ready()
        return gateway

    yield start
    for gateway in started:
        if gateway.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                gateway.process.send_signal(signal.SIGKILL)
            await gateway.process.wait()
        if gateway._reader is not None:
            gateway._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gateway._reader
