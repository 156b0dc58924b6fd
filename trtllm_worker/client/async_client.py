"""The async client: one deployment's producer, subscriber and operator calls over one
AMQP connection (opened on first use: a pure subscriber never touches the broker) and
one Redis client. The rest of the SDK (errors, events, the job body, trace headers, the
cancel broadcast) sits in modules of its own; this one owns the connections.

```python
async with Client(load_settings()) as client:
    request_id = await client.submit("Once upon a time", {"max_new_tokens": 64})
    async for event in client.stream(request_id):
        ...  # TokenEvent, then one DoneEvent or ErrorEvent
```"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Mapping,
)
from collections.abc import Sequence as Seq
from datetime import date
from pathlib import Path
from types import TracebackType
from typing import Any, TypedDict, TypeVar, Unpack, cast

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from trtllm_worker.client.admin import (
    DROPPED_HEADERS,
    RESET_FOR_REQUEUE,
    DeadLetter,
    read_dead_letter,
)
from trtllm_worker.client.batch_files import DEFAULT_MAX_BYTES, DEFAULT_MAX_LINES
from trtllm_worker.client.batches import (
    DEFAULT_WINDOW,
    Batches,
    BatchObject,
    Progress,
)
from trtllm_worker.client.cancel import broadcast_cancel, cancel_body
from trtllm_worker.client.completions import TokenText
from trtllm_worker.client.errors import (
    InvalidJobError,
    JobFailed,
    QueueFull,
    QueueMissing,
    ServiceUnavailable,
    StreamFormatError,
)
from trtllm_worker.client.events import DoneEvent, ErrorEvent, Event, parse_entry
from trtllm_worker.client.jobs import JobOptions, job_body, job_message, validate_job
from trtllm_worker.client.migrate import Migration, Report, migrate_queue
from trtllm_worker.client.tracecontext import trace_headers
from trtllm_worker.client.usage import Usage, read_usage
from trtllm_worker.config import Settings, redact_url
from trtllm_worker.connect.amqp import connect, reason
from trtllm_worker.connect.messages import persistent_copy
from trtllm_worker.connect.redis import AnyRedis, connect_redis
from trtllm_worker.contract.job import (
    REQUEST_ID_PATTERN,
    JobLimits,
    Parameters,
    valid_request_id,
)
from trtllm_worker.contract.priority import MAX_PRIORITY
from trtllm_worker.contract.queues import (
    cancel_exchange_name,
    dead_queue_name,
)
from trtllm_worker.contract.stream import (
    TERMINAL_EVENTS,
    deliveries_key,
    entry_order,
    stream_key,
)
from trtllm_worker.streams.store import mark_cancelled

XREAD_BLOCK_MS = 2000
SOCKET_TIMEOUT_S = 10.0  # above XREAD_BLOCK_MS: a blocked XREAD must not time out
XREAD_COUNT = 512
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 2.0
DEFAULT_CLIENT_NAME = "trtllm-worker-client"

_T = TypeVar("_T")


class ClientOptions(TypedDict, total=False):
    """`Client`'s keyword arguments besides `settings`, for wrappers that pass them on
    (`SyncClient`); each overrides the settings, as `Client` documents."""

    amqp_url: str | None
    redis_url: str | None
    queue: str | None
    stream_prefix: str | None
    client_name: str
    reconnect_timeout_s: float
    confirm_timeout_s: float
    xread_block_ms: int


async def _ended_by(client: AnyRedis, key: str, from_id: str) -> bool:
    """Whether the stream's last entry is its terminal entry, at or before `from_id`:
    nothing will ever follow `from_id` (the terminal entry is always the last). A
    malformed `from_id` is left to XREAD to refuse."""
    after = entry_order(from_id)
    if after is None:
        return False
    last = cast(list[tuple[str, dict[str, str]]], await client.xrevrange(key, count=1))
    if not last:
        return False
    last_id, fields = last[0]
    ended = entry_order(last_id)
    return fields.get("event") in TERMINAL_EVENTS and ended is not None and ended <= after


async def ping_fresh(client: AnyRedis) -> None:
    """PING; once more when the connection fails. A pooled connection the server closed
    just as it was taken (an idle timeout, a failover) fails its first command, and this
    client does not retry by itself (`retry=False`): the second PING goes over a fresh
    connection and tells a lost connection from a lost Redis. Raises the error of the
    second."""
    try:
        await client.ping()
    except (RedisConnectionError, OSError):
        await client.ping()


class Client:
    """Producer, subscriber and operator calls against one worker deployment.

    Built from the worker's `Settings` (queue, stream prefix, URLs, TLS files, job limits)
    or from URLs: `Client(amqp_url=..., redis_url=..., queue="generate",
    stream_prefix="gen:")`; explicit arguments override the settings. Use it as an async
    context manager (or call `aclose()`)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        amqp_url: str | None = None,
        redis_url: str | None = None,
        queue: str | None = None,
        stream_prefix: str | None = None,
        client_name: str = DEFAULT_CLIENT_NAME,
        reconnect_timeout_s: float = 60.0,
        confirm_timeout_s: float = 30.0,
        xread_block_ms: int = XREAD_BLOCK_MS,
    ) -> None:
        defaults = settings if settings is not None else Settings.model_construct()
        self.amqp_url = amqp_url or defaults.amqp_url
        self.redis_url = redis_url or defaults.redis_url
        self.queue = queue or defaults.queue
        self.stream_prefix = stream_prefix or defaults.stream_prefix
        self.stream_ttl_s = defaults.stream_ttl_s
        self.batch_ttl_s = defaults.batch_ttl_s
        self.limits = (
            JobLimits(settings.max_new_tokens, settings.default_max_new_tokens)
            if settings is not None
            else None
        )
        self.reconnect_timeout_s = reconnect_timeout_s
        self.confirm_timeout_s = confirm_timeout_s
        self.xread_block_ms = xread_block_ms
        self.reconnects = 0
        """How many times a stream reader lost Redis and carried on."""
        self._settings = settings
        self._redis_client: AnyRedis | None = None  # connected on first use
        self._redis_lock = asyncio.Lock()
        self._client_name = client_name
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._cancel_exchange: aio_pika.abc.AbstractExchange | None = None
        self._lock = asyncio.Lock()
        self._batches = Batches(self)

    @property
    def settings(self) -> Settings | None:
        return self._settings

    @property
    def dead_queue(self) -> str:
        return dead_queue_name(self.queue)

    @property
    def cancel_exchange(self) -> str:
        return cancel_exchange_name(self.queue)

    def stream_key(self, request_id: str) -> str:
        if valid_request_id(request_id) is None:
            raise InvalidJobError(f"request_id {request_id!r}: must match {REQUEST_ID_PATTERN}")
        return stream_key(self.stream_prefix, request_id)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = self._cancel_exchange = None
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):
                await connection.close()
        client, self._redis_client = self._redis_client, None
        if client is not None:
            await client.aclose()

    async def _redis(self) -> AnyRedis:
        """The Redis client, connected on first use: a single node, or redis-py's
        cluster client when the URL names a node of a Redis Cluster. Raises the
        connection error when Redis does not answer."""
        async with self._redis_lock:
            if self._redis_client is None:
                try:
                    self._redis_client = await self._connect_redis()
                except (RedisConnectionError, OSError):
                    # once more, as `ping_fresh`: a connection dropped as it was made is
                    # not a lost Redis
                    self._redis_client = await self._connect_redis()
            return self._redis_client

    async def _connect_redis(self) -> AnyRedis:
        return await connect_redis(
            self.redis_url,
            client_name=self._client_name,
            settings=self._settings,
            decode_responses=True,
            socket_timeout_s=max(SOCKET_TIMEOUT_S, self.xread_block_ms / 1000 + 5),
            retry=False,  # the stream reader retries itself, from the last entry id
        )

    async def answering_redis(self) -> AnyRedis:
        """The Redis client after it answered a PING (`ping_fresh`: a connection dropped
        as it was taken is not reported). `ServiceUnavailable` when Redis does not
        answer."""
        try:
            client = await self._redis()
            await ping_fresh(client)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise ServiceUnavailable(
                f"cannot connect to Redis at {redact_url(self.redis_url)}: {reason(exc)}"
            ) from None
        return client

    # -- AMQP plumbing ------------------------------------------------------------------

    async def _amqp(self) -> AbstractConnection:
        async with self._lock:
            if self._connection is None or self._connection.is_closed:
                try:
                    self._connection = await connect(
                        self.amqp_url, settings=self._settings, name=self._client_name
                    )
                except ConnectionError as exc:
                    raise ServiceUnavailable(str(exc)) from None
                self._channel = self._cancel_exchange = None
            return self._connection

    async def _publisher(self) -> AbstractChannel:
        """The channel every publish goes through: publisher confirms, and an unroutable
        mandatory message raises instead of vanishing."""
        connection = await self._amqp()
        async with self._lock:
            if self._channel is None or self._channel.is_closed:
                self._channel = await connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
                self._cancel_exchange = None
            return self._channel

    async def _confirmed(self, publish: Awaitable[_T], what: str) -> _T:
        try:
            async with asyncio.timeout(self.confirm_timeout_s):
                return await publish
        except aio_pika.exceptions.PublishError:
            raise QueueMissing(
                f"{what}: no queue named {self.queue!r} on the broker at "
                f"{redact_url(self.amqp_url)} (start a worker first: it declares the queue)"
            ) from None
        except aio_pika.exceptions.DeliveryError as exc:
            raise QueueFull(f"{what}: the broker refused the message ({exc})") from None
        except TimeoutError:
            raise ServiceUnavailable(
                f"{what}: no publisher confirm within {self.confirm_timeout_s:.0f}s"
            ) from None
        except (aiormq.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
            raise ServiceUnavailable(
                f"{what}: the broker connection failed: {reason(exc)}"
            ) from None

    # -- producing ----------------------------------------------------------------------

    async def submit(
        self,
        inputs: str | Seq[int] | None = None,
        parameters: Mapping[str, Any] | Parameters | None = None,
        *,
        trace_context: Mapping[str, str] | None = None,
        priority: int | None = None,
        **options: Unpack[JobOptions],
    ) -> str:
        """Validate the job as the worker will (`InvalidJobError`, nothing published),
        publish it persistent with publisher confirms, and return its request id once
        the broker has it. `inputs` is the prompt, or a list of token ids; or give
        `messages` (a conversation) instead. The other fields: `JobOptions`.

        The job's trace continues the current OpenTelemetry span, or `trace_context`
        (W3C `traceparent` and `tracestate` headers; `ValueError` if malformed).
        `priority` (0-9, the message's AMQP priority; `ValueError` outside): at least
        the workers' `WORKER_PREEMPT_PRIORITY` (5) makes it interactive, pausing batch
        work for it."""
        if priority is not None and not 0 <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be 0 to {MAX_PRIORITY}, not {priority}")
        headers = trace_headers(trace_context)
        body = job_body(inputs, parameters, **options)
        encoded = validate_job(body, self.limits)
        request_id = str(body["request_id"])
        message = job_message(encoded, request_id, priority, time.time(), headers)
        channel = await self._publisher()
        await self._confirmed(
            channel.default_exchange.publish(message, routing_key=self.queue, mandatory=True),
            f"submitting {request_id}",
        )
        return request_id

    async def queue_depth(self) -> int:
        """How many jobs wait in the queue, ready to be taken (RabbitMQ's count: not
        those a worker holds unacknowledged). `QueueMissing` if there is no queue."""
        connection = await self._amqp()
        channel = await connection.channel()  # a 404 closes its channel: not the publisher's
        try:
            queue = await channel.declare_queue(self.queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise QueueMissing(f"no queue named {self.queue!r} on the broker") from None
        except (aiormq.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
            raise ServiceUnavailable(f"the broker connection failed: {reason(exc)}") from None
        finally:
            if not channel.is_closed:
                with contextlib.suppress(Exception):
                    await channel.close()
        return int(queue.declaration_result.message_count or 0)

    async def cancel(self, request_id: str) -> None:
        """Cancel a request: a running one stops within one engine step and ends `done`
        with `finish_reason` `cancelled`; one no worker has taken yet ends so when taken
        (the cancel mark is also stored in Redis, so no running worker is needed)."""
        key = self.stream_key(request_id)
        with contextlib.suppress(RedisError, OSError):  # the broadcast below still goes out
            await mark_cancelled(await self._redis(), key, self.stream_ttl_s)
        channel = await self._publisher()
        async with self._lock:
            if self._cancel_exchange is None:
                # not declared here: a producer needs no configure permission (the
                # workers declare it; `trtllm-worker acl`)
                self._cancel_exchange = await channel.get_exchange(
                    self.cancel_exchange, ensure=False
                )
            exchange = self._cancel_exchange
        await self._confirmed(
            broadcast_cancel(exchange, cancel_body(request_id)), f"cancelling {request_id}"
        )

    # -- subscribing --------------------------------------------------------------------

    async def stream(self, request_id: str, from_id: str = "0") -> AsyncGenerator[Event, None]:
        """The request's events after entry `from_id` (`0`: from the start), until its
        terminal entry (`DoneEvent` or `ErrorEvent`, then the iterator ends). Entries of
        unknown event types are skipped. Waits for a stream that does not exist yet.
        A stream that has already ended at or before `from_id` (its terminal entry is
        `from_id` or before it: e.g. `from_id` is the `entry_id` of the `DoneEvent`)
        has nothing more to give: the iterator ends at once, yielding nothing.
        Redis unreachable at the start: `ServiceUnavailable` at once. A connection lost
        later is retried with backoff for up to `reconnect_timeout_s`, resuming after the
        last entry seen: no entry is lost or repeated."""
        async for entry_id, fields in self.entries(request_id, from_id):
            event = parse_entry(entry_id, fields)
            if event is not None:
                yield event

    async def ended_by(self, request_id: str, entry_id: str) -> bool:
        """Whether the request's stream holds its terminal entry at or before `entry_id`
        (a reader resuming after `entry_id` would get nothing more).
        `ServiceUnavailable` when Redis does not answer."""
        key = self.stream_key(request_id)
        try:
            client = await self._redis()
            try:
                return await _ended_by(client, key, entry_id)
            except (RedisConnectionError, OSError):  # a read: once more, as `ping_fresh`
                return await _ended_by(client, key, entry_id)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise ServiceUnavailable(
                f"cannot connect to Redis at {redact_url(self.redis_url)}: {reason(exc)}"
            ) from None

    async def entries(
        self, request_id: str, from_id: str = "0"
    ) -> AsyncGenerator[tuple[str, dict[str, str]], None]:
        """As `stream`, but each entry as Redis holds it: `(entry id, fields)`, entries of
        unknown event types included; the iterator ends after the terminal entry."""
        key = self.stream_key(request_id)
        client = await self.answering_redis()
        try:
            if from_id != "0" and await _ended_by(client, key, from_id):
                return
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise ServiceUnavailable(
                f"cannot connect to Redis at {redact_url(self.redis_url)}: {reason(exc)}"
            ) from None
        last_id = from_id
        loop = asyncio.get_running_loop()
        failing_since: float | None = None
        delay = BACKOFF_INITIAL_S
        while True:
            try:
                reply = await client.xread(
                    {key: last_id}, block=self.xread_block_ms, count=XREAD_COUNT
                )
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                now = loop.time()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since >= self.reconnect_timeout_s:
                    raise ServiceUnavailable(
                        f"lost Redis at {redact_url(self.redis_url)} for "
                        f"{self.reconnect_timeout_s:.0f}s while reading {key}: {reason(exc)}"
                    ) from None
                self.reconnects += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            failing_since, delay = None, BACKOFF_INITIAL_S
            for _, items in cast(list[tuple[str, list[tuple[str, dict[str, str]]]]], reply):
                for entry_id, fields in items:
                    last_id = entry_id
                    yield entry_id, fields
                    if fields.get("event") in TERMINAL_EVENTS:
                        return

    async def result(self, request_id: str) -> DoneEvent:
        """Wait for the request's end: its `DoneEvent`, or `JobFailed` on an error."""
        async for event in self.stream(request_id):
            if isinstance(event, DoneEvent):
                return event
            if isinstance(event, ErrorEvent):
                raise JobFailed(request_id, event.code, event.message)
        raise StreamFormatError(f"stream of {request_id} ended without a terminal entry")

    async def generate(
        self,
        inputs: str | Seq[int] | None = None,
        parameters: Mapping[str, Any] | Parameters | None = None,
        **options: Unpack[JobOptions],
    ) -> DoneEvent:
        """Submit a job (as `submit`) and wait for its result: the `DoneEvent` (its
        `generated_text`), or `JobFailed` with the error's code and message."""
        request_id = await self.submit(inputs, parameters, **options)
        return await self.result(request_id)

    # -- batches ------------------------------------------------------------------------

    async def submit_batch(
        self,
        path: str | Path,
        *,
        batch_id: str | None = None,
        priority: int = 0,
        completion_window: str = DEFAULT_WINDOW,
        tenant: str | None = None,
        max_lines: int = DEFAULT_MAX_LINES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        progress: Progress | None = None,
        on_total: Callable[[int], None] | None = None,
        on_created: Callable[[], None] | None = None,
        input_file_id: str | None = None,
    ) -> str:
        """Run an OpenAI Batch input file: each valid line becomes one job (request id
        `<batch id>:<line>`) at `priority`; returns the batch id. A file over `max_lines`
        or `max_bytes` raises `InvalidBatch` before anything is published. Run again
        with the same `batch_id` after an interruption, it publishes only the lines not
        yet published (`BatchConflict` if the id belongs to another file). `on_total`
        gets the file's line count once it is known, `progress` the lines handled,
        `on_created` a call once the batch exists (`batch(id)` answers; before any line
        is published). `input_file_id`: the Batch object's, if the file has an id (the
        gateway's Files API); else `file-<batch id>`."""
        return await self._batches.submit(
            Path(path),
            batch_id=batch_id,
            priority=priority,
            completion_window=completion_window,
            tenant=tenant,
            max_lines=max_lines,
            max_bytes=max_bytes,
            progress=progress,
            on_total=on_total,
            on_created=on_created,
            input_file_id=input_file_id,
        )

    async def batch(self, batch_id: str) -> BatchObject:
        """The batch as OpenAI's Batch object (`BatchNotFound` if there is none)."""
        return await self._batches.status(batch_id)

    def batch_results(
        self, batch_id: str, token_text: TokenText | None = None
    ) -> AsyncIterator[tuple[bool, bytes]]:
        """The lines of the batch that have ended, in input order: `(True, line)` for
        OpenAI's output file, `(False, line)` for its error file (JSON lines, bytes).
        `token_text` names tokens in logprobs (default: the settings' tokenizer, as the
        workers have it)."""
        return self._batches.results(batch_id, token_text)

    async def write_batch_results(
        self,
        batch_id: str,
        output: str | Path,
        errors: str | Path | None = None,
        token_text: TokenText | None = None,
    ) -> tuple[int, int]:
        """Write the output file (and the error file, when `errors` is given); returns
        how many lines each got. Each file is written whole, then moved into place."""
        targets = [Path(output)] + ([Path(errors)] if errors is not None else [])
        temps = [t.with_name(t.name + ".part") for t in targets]
        counts = [0, 0]
        files = [t.open("wb") for t in temps]
        try:
            async for ok, line in self.batch_results(batch_id, token_text):
                counts[0 if ok else 1] += 1
                if ok:
                    files[0].write(line)
                elif len(files) > 1:
                    files[1].write(line)
        finally:
            for file in files:
                file.close()
        for temp, target in zip(temps, targets, strict=True):
            temp.replace(target)
        return counts[0], counts[1]

    async def cancel_batch(self, batch_id: str) -> BatchObject:
        """Cancel the batch: lines not yet ended end as errors `batch_cancelled` (running
        jobs stop within an engine step, queued ones end as they are taken)."""
        return await self._batches.cancel(batch_id)

    async def list_batches(self, limit: int = 100) -> list[BatchObject]:
        """The newest batches of this deployment first, as Batch objects."""
        return await self._batches.list_batches(limit)

    async def wait_batch(
        self, batch_id: str, *, poll_s: float = 1.0, progress: Progress | None = None
    ) -> BatchObject:
        """Wait until the batch ends (completed, failed, expired or cancelled). Redis
        lost after the first poll is polled on for up to `reconnect_timeout_s`, then
        `ServiceUnavailable`."""
        return await self._batches.wait(batch_id, poll_s=poll_s, progress=progress)

    # -- operating ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _dead_messages(
        self, limit: int | None
    ) -> AsyncIterator[list[tuple[AbstractIncomingMessage, DeadLetter]]]:
        """Take the dead letters off `<queue>.dead` without acknowledging them, in queue
        order; whatever the caller did not acknowledge goes back, in the same order, when
        the block ends (and the broker returns them anyway if this process dies)."""
        connection = await self._amqp()
        channel = await connection.channel()
        held: list[tuple[AbstractIncomingMessage, DeadLetter]] = []
        try:
            try:
                queue = await channel.get_queue(self.dead_queue, ensure=True)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                yield held  # no dead-letter queue yet: nothing was ever dead-lettered
                return
            while limit is None or len(held) < limit:
                message = await queue.get(no_ack=False, fail=False, timeout=self.confirm_timeout_s)
                if message is None:
                    break
                held.append((message, read_dead_letter(message)))
            yield held
        finally:
            for message, _ in held:
                if not message.processed and not channel.is_closed:
                    await message.nack(requeue=True)
            if not channel.is_closed:
                await channel.close()

    async def usage(self, tenant: str | None = None, since: date | None = None) -> list[Usage]:
        """Jobs, input tokens and generated tokens per tenant and UTC day, as the workers
        of this deployment (its stream prefix) counted them with each terminal entry,
        sorted by day then tenant; only `tenant`'s, only from `since` on, when given."""
        return await read_usage(await self._redis(), self.stream_prefix, tenant=tenant, since=since)

    async def dead_letters(self, limit: int | None = None) -> list[DeadLetter]:
        """The messages of `<queue>.dead` with their reasons, oldest first. They stay in
        the queue, in their order (each is taken unacknowledged and returned)."""
        try:
            async with self._dead_messages(limit) as held:
                return [letter for _, letter in held]
        except aiormq.exceptions.AMQPError as exc:
            raise ServiceUnavailable(f"reading {self.dead_queue}: {reason(exc)}") from None

    async def migrate_queue(
        self, queue_type: str | None = None, report: Report | None = None
    ) -> Migration:
        """Declare the job queue again as the worker declares it (`queue_type`, default
        the settings' WORKER_QUEUE_TYPE), keeping its jobs (`client.migrate`). Refuses
        with `MigrationRefused` while workers consume the queue."""
        kind = queue_type or (self._settings.queue_type if self._settings else "quorum")
        connection = await self._amqp()
        return await migrate_queue(connection, self.queue, kind, report or (lambda _: None))

    async def requeue_dead_letters(
        self, request_ids: Collection[str] | None = None
    ) -> list[DeadLetter]:
        """Publish dead letters back to `<queue>` (all, or those of `request_ids`),
        without their `x-error-*` headers, and remove each dead copy only once the broker
        confirmed its republished job. A request whose stream ends with the `error` entry
        written when it was dead-lettered gets its stream removed first, so the job runs
        again from the start. Returns the requeued letters; the others stay, in order."""
        wanted = None if request_ids is None else set(request_ids)
        requeued: list[DeadLetter] = []
        channel = await self._publisher()
        async with self._dead_messages(None) as held:
            for message, letter in held:
                if wanted is not None and letter.request_id not in wanted:
                    continue
                if letter.request_id is not None:
                    key = self.stream_prefix + letter.request_id
                    client = await self._redis()
                    await client.eval(RESET_FOR_REQUEUE, 2, key, deliveries_key(key))
                headers = {k: v for k, v in (message.headers or {}).items()}
                for name in DROPPED_HEADERS:
                    headers.pop(name, None)
                job = persistent_copy(message, headers)
                await self._confirmed(
                    channel.default_exchange.publish(job, routing_key=self.queue, mandatory=True),
                    f"requeueing {letter.request_id or 'a dead letter'}",
                )
                await message.ack()
                requeued.append(letter)
        return requeued
