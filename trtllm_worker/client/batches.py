"""Batches on the services: submit a file (each valid line one job, published with
confirms), read a batch's status as OpenAI's Batch object, write its results, cancel it,
list them. Where batches live in Redis and how a line ends once: `contract/batches.py`.

- **Submit** reads the file twice, as a stream: once to check the limits and hash it
  (nothing is published when it is over them), once to publish. Per chunk of lines it
  stores the lines' pending markers and the refused lines' errors, publishes the jobs,
  waits for the broker's confirms, then records how far it got: run again with the same
  id, it goes on from there (a line published twice runs once: its stream and marker
  say it ended or is taken).
- **Status** is computed from the batch's hash and its counters. The first reader to
  find every line ended finalizes the batch (its final status, and every key's expiry
  set to `WORKER_BATCH_TTL_S` from then); after its completion window, the first reader
  ends the lines no worker has taken as expired.
- **Cancel** ends the lines no worker has started (a `done` entry with finish_reason
  `cancelled`, written only where the stream is still empty), marks the others
  cancelled and broadcasts their cancel: running jobs stop within one engine step,
  queued ones end as they are taken."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypedDict, cast

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from tokenizers import Tokenizer

from trtllm_worker.client.batch_files import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_LINES,
    FileScan,
    InvalidBatch,
    LineError,
    LineJob,
    dumps,
    error_line,
    lines_of,
    read_line,
    result_line,
    scan_file,
)
from trtllm_worker.client.completions import TokenText
from trtllm_worker.client.errors import ClientError, ServiceUnavailable
from trtllm_worker.client.jobs import job_message
from trtllm_worker.config import Settings
from trtllm_worker.connect.amqp import reason
from trtllm_worker.connect.redis import AnyRedis
from trtllm_worker.contract.batches import (
    ENDED,
    FINAL_STATUSES,
    PENDING,
    BatchStatus,
    batch_key,
    counts_key,
    index_key,
    invalid_key,
    line_key,
    line_request_id,
    new_batch_id,
    valid_batch_id,
)
from trtllm_worker.contract.errors import DEADLINE_EXCEEDED
from trtllm_worker.contract.openai import CHAT_COMPLETIONS
from trtllm_worker.contract.stream import (
    DONE,
    Fields,
    FinishReason,
    cancel_key,
    error_fields,
    stream_key,
)
from trtllm_worker.streams.store import LEASE_LOST_REASON, StreamStore
from trtllm_worker.streams.usage import slot_tags
from trtllm_worker.streams.wire import WriteBatch

if TYPE_CHECKING:
    from trtllm_worker.client.async_client import Client

log = logging.getLogger(__name__)

CHUNK: Final = 500
"""Lines per round trip: markers stored, jobs published and confirmed, progress saved."""
WINDOW_PATTERN: Final = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DEFAULT_WINDOW: Final = "24h"
FIRST_ENTRY: Final = "0-1"
"""A terminal entry written with this id lands only in an empty stream: a line some
worker started (its stream holds tokens) is left to that job to end."""

Progress = Callable[[int], object]
"""Called with how many more lines were handled."""


class BatchNotFound(ClientError, LookupError):
    """No batch with that id (never submitted, or its results expired)."""


class BatchConflict(ClientError):
    """`submit` with the id of a batch made from another file."""


def settings_token_text(settings: Settings | None) -> TokenText:
    """A token id's text by the workers' tokenizer (`WORKER_TOKENIZER`, else the built-in
    one), loaded at first use: only results with logprobs need it."""

    @cache
    def tokenizer() -> Tokenizer:
        from trtllm_worker.tokenizer import builtin_byte_tokenizer, tokenizer_for

        return builtin_byte_tokenizer() if settings is None else tokenizer_for(settings).tokenizer

    def text(token_id: int) -> str:
        return tokenizer().decode([token_id], skip_special_tokens=False)

    return text


def window_seconds(window: str) -> int:
    """`24h`, `90m`, `2d`, `3600s` in seconds; `InvalidBatch` naming the format."""
    match = WINDOW_PATTERN.match(window)
    if match is None:
        raise InvalidBatch(
            f"completion window {window!r}: a number and a unit, s, m, h or d (e.g. 24h)"
        )
    return int(match.group(1)) * _UNIT_S[match.group(2)]


class RequestCounts(TypedDict):
    total: int
    completed: int
    failed: int


class BatchObject(TypedDict):
    """OpenAI's Batch object, as `status` returns it (times: Unix seconds)."""

    id: str
    object: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    errors: dict[str, Any] | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None


@dataclass(frozen=True, slots=True)
class Counts:
    """A batch's ended lines as its counters hold them."""

    ok: int = 0
    err: int = 0
    expired: int = 0
    cancelled: int = 0


class Batches:
    """The batch calls of one `Client` (its connections, prefix, queue and limits)."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._tags: dict[str, list[str]] = {}
        self._token_text = settings_token_text(client.settings)
        """Per batch id on Redis Cluster, the slot tags of its counters."""

    @property
    def _prefix(self) -> str:
        return self._client.stream_prefix

    async def _redis(self) -> AnyRedis:
        return await self._client._redis()

    # -- submit ---------------------------------------------------------------------------

    async def submit(
        self,
        path: Path,
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
        """Publish every valid line of the file at `path` as a job; returns the batch
        id. See the module docstring; `InvalidBatch` (nothing published) for a file
        over the limits, `BatchConflict` for an id taken by another file."""
        if batch_id is not None and valid_batch_id(batch_id) is None:
            raise InvalidBatch(
                f"batch id {batch_id!r}: must match [A-Za-z0-9][A-Za-z0-9.-]{{0,63}}"
            )
        if not 0 <= priority <= 9:
            raise InvalidBatch(f"priority must be 0 to 9, not {priority}")
        window_seconds(completion_window)  # InvalidBatch before the file is read
        limits = self._client.limits
        scan = await asyncio.to_thread(
            scan_file, path, max_lines=max_lines, max_bytes=max_bytes, limits=limits
        )
        if scan.lines == 0:
            raise InvalidBatch(f"{path}: no lines")
        if on_total is not None:
            on_total(scan.lines)
        batch_id = batch_id or new_batch_id()
        meta, start = await self._created(
            batch_id, scan, completion_window, priority, tenant, input_file_id
        )
        if on_created is not None:
            on_created()
        if "in_progress_at" in meta or "failed_at" in meta:
            if progress is not None:
                progress(scan.lines)
            return batch_id
        if progress is not None and start:
            progress(start)
        await self._publish_lines(path, batch_id, meta, start, progress)
        redis = await self._redis()
        invalid = int(await redis.hlen(invalid_key(self._prefix, batch_id)))
        done = {"in_progress_at": str(int(time.time())), "invalid": str(invalid)}
        if invalid >= scan.lines:
            done["failed_at"] = done.pop("in_progress_at")
        await redis.hset(batch_key(self._prefix, batch_id), mapping=cast(Any, done))
        return batch_id

    async def _created(
        self,
        batch_id: str,
        scan: FileScan,
        completion_window: str,
        priority: int,
        tenant: str | None,
        input_file_id: str | None,
    ) -> tuple[dict[str, str], int]:
        """The batch's hash, made now or found from an earlier submit of the same file
        (`BatchConflict` for another file's), and the first line not yet published."""
        window_s = window_seconds(completion_window)
        redis = await self._redis()
        key = batch_key(self._prefix, batch_id)
        meta = cast(dict[str, str], await redis.hgetall(key))
        ttl_s = self._client.batch_ttl_s
        if meta:
            if meta.get("sha256") != scan.sha256:
                raise BatchConflict(
                    f"batch {batch_id} was submitted from another file; give another --id"
                )
            return meta, int(meta.get("published", 0))
        now = int(time.time())
        meta = {
            "id": batch_id,
            "endpoint": scan.endpoint or CHAT_COMPLETIONS,
            "input_file_id": input_file_id or f"file-{batch_id}",
            "completion_window": completion_window,
            "created_at": str(now),
            "expires_at": str(now + window_s),
            "total": str(scan.lines),
            "sha256": scan.sha256,
            "priority": str(priority),
            "ttl_s": str(ttl_s),
            "published": "0",
        }
        if tenant is not None:
            meta["tenant"] = tenant
        pipe = redis.pipeline(transaction=False)
        pipe.hset(key, mapping=cast(Any, meta))
        pipe.expire(key, window_s + ttl_s)
        pipe.zadd(index_key(self._prefix), {batch_id: time.time()})  # newest first
        await pipe.execute()
        return meta, 0

    async def _publish_lines(
        self,
        path: Path,
        batch_id: str,
        meta: Mapping[str, str],
        start: int,
        progress: Progress | None,
    ) -> None:
        endpoint = meta["endpoint"]
        expires_at = int(meta["expires_at"])
        extra: dict[str, Any] = {"deadline": datetime.fromtimestamp(expires_at, UTC).isoformat()}
        if "tenant" in meta:
            extra["tenant"] = meta["tenant"]
        seen: set[str] = set()
        chunk: list[tuple[int, LineJob | LineError]] = []
        for index, raw in enumerate(lines_of(path)):
            line = read_line(batch_id, index, raw, endpoint, self._client.limits, extra)
            if isinstance(line, LineJob):
                custom_id = line.custom_id
                if custom_id in seen:
                    line = LineError(
                        custom_id, "invalid_request", "custom_id: not unique in the file"
                    )
                seen.add(custom_id)
            if index < start:
                continue  # published by an earlier run
            chunk.append((index, line))
            if len(chunk) == CHUNK:
                await self._publish_chunk(batch_id, meta, chunk)
                if progress is not None:
                    progress(len(chunk))
                chunk = []
        if chunk:
            await self._publish_chunk(batch_id, meta, chunk)
            if progress is not None:
                progress(len(chunk))

    async def _publish_chunk(
        self, batch_id: str, meta: Mapping[str, str], chunk: list[tuple[int, LineJob | LineError]]
    ) -> None:
        """Markers and refused lines first, then the jobs with confirms, then the progress:
        a run cut short anywhere repeats at most this chunk."""
        redis = await self._redis()
        cluster = isinstance(redis, RedisCluster)
        now = int(time.time())
        ttl_s = int(meta["ttl_s"])
        life = max(int(meta["expires_at"]) - now, 0) + ttl_s
        pipe = redis.pipeline(transaction=False)
        jobs: list[tuple[str, bytes]] = []
        for index, line in chunk:
            if isinstance(line, LineError):
                pipe.hset(
                    invalid_key(self._prefix, batch_id),
                    str(index),
                    json.dumps({"custom_id": line.custom_id, "code": line.code,
                                "message": line.message}),
                )  # fmt: skip
                continue
            request_id = line_request_id(batch_id, index)
            stream = stream_key(self._prefix, request_id)
            tag = slot_tags()[key_slot(stream.encode())] if cluster else None
            marker = {
                "state": PENDING,
                "custom_id": line.custom_id,
                "counts": counts_key(self._prefix, batch_id, tag),
                "ttl": ttl_s,
                # the record and the counters live at least this long (Unix s): a line
                # ending early must outlast the batch, which may run longer than ttl_s
                "keep_until": int(meta["expires_at"]) + ttl_s,
            }
            if line.logprobs:
                marker["logprobs"] = True  # the record keeps the tokens' logprobs
            # NX: a line that ended keeps its record when a run repeats this chunk
            pipe.set(line_key(stream), json.dumps(marker), ex=life, nx=True)
            jobs.append((request_id, line.body))
        pipe.expire(invalid_key(self._prefix, batch_id), life)
        await pipe.execute()
        if jobs:
            await self._publish(jobs, int(meta["priority"]))
        await redis.hset(batch_key(self._prefix, batch_id), "published", str(chunk[-1][0] + 1))

    async def _publish(self, jobs: list[tuple[str, bytes]], priority: int) -> None:
        client = self._client
        channel = await client._publisher()
        now = time.time()
        exchange = channel.default_exchange

        async def one(request_id: str, body: bytes) -> None:
            message = job_message(body, request_id, priority, now)
            await client._confirmed(
                exchange.publish(message, routing_key=client.queue, mandatory=True),
                f"submitting {request_id}",
            )

        await asyncio.gather(*(one(request_id, body) for request_id, body in jobs))

    # -- reading ----------------------------------------------------------------------

    async def _meta(self, batch_id: str) -> dict[str, str]:
        if valid_batch_id(batch_id) is None:
            raise BatchNotFound(f"no batch {batch_id!r}: not a batch id")
        meta = cast(
            dict[str, str], await (await self._redis()).hgetall(batch_key(self._prefix, batch_id))
        )
        if not meta:
            raise BatchNotFound(f"no batch {batch_id} (never submitted, or its results expired)")
        return meta

    def _count_keys(self, redis: AnyRedis, batch_id: str, total: int) -> list[str]:
        if not isinstance(redis, RedisCluster):
            return [counts_key(self._prefix, batch_id)]
        tags = self._tags.get(batch_id)
        if tags is None:
            table = slot_tags()
            found = {
                table[key_slot(stream_key(self._prefix, line_request_id(batch_id, i)).encode())]
                for i in range(total)
            }
            tags = self._tags[batch_id] = sorted(found)
        return [counts_key(self._prefix, batch_id, tag) for tag in tags]

    async def _counts(self, batch_id: str, total: int) -> Counts:
        redis = await self._redis()
        pipe = redis.pipeline(transaction=False)
        for key in self._count_keys(redis, batch_id, total):
            pipe.hmget(key, ["ok", "err", "expired", "cancelled"])
        sums = [0, 0, 0, 0]
        for values in await pipe.execute():
            for i, value in enumerate(values):
                sums[i] += int(value or 0)
        return Counts(*sums)

    async def status(self, batch_id: str) -> BatchObject:
        """The batch as OpenAI's Batch object. The first reader after the last line
        ended (or after the completion window) moves the batch on: see the module
        docstring."""
        meta = await self._meta(batch_id)
        total = int(meta["total"])
        counts = await self._counts(batch_id, total)
        if (
            meta.get("status") not in FINAL_STATUSES
            and ("in_progress_at" in meta or "failed_at" in meta)
            and await self._advance(batch_id, meta, counts)
        ):
            meta = await self._meta(batch_id)
            counts = await self._counts(batch_id, total)
        return batch_object(meta, counts)

    async def _advance(self, batch_id: str, meta: dict[str, str], counts: Counts) -> bool:
        """Expire or finalize the batch when its time has come; True if it changed."""
        total = int(meta["total"])
        invalid = int(meta.get("invalid", 0))
        ended = counts.ok + counts.err + invalid
        now = int(time.time())
        changed = False
        if ended < total and now >= int(meta["expires_at"]) and "expired_swept_at" not in meta:
            message = "the batch's completion window ended before a worker took this line"
            await self._end_untaken(batch_id, meta, error_fields(DEADLINE_EXCEEDED, message))
            await (await self._redis()).hset(
                batch_key(self._prefix, batch_id), "expired_swept_at", str(now)
            )
            counts = await self._counts(batch_id, total)
            ended = counts.ok + counts.err + invalid
            changed = True
        if ended >= total:
            await self._finalize(batch_id, meta, counts, now)
            changed = True
        return changed

    async def _finalize(
        self, batch_id: str, meta: Mapping[str, str], counts: Counts, now: int
    ) -> None:
        """The final status, and every key of the batch kept `ttl_s` from now."""
        redis = await self._redis()
        key = batch_key(self._prefix, batch_id)
        await redis.hsetnx(key, "finalizing_at", str(now))
        if "failed_at" in meta:
            final = BatchStatus.FAILED
        elif "cancelling_at" in meta:
            final = BatchStatus.CANCELLED
        elif counts.expired:
            final = BatchStatus.EXPIRED
        else:
            final = BatchStatus.COMPLETED
        ttl_s = int(meta["ttl_s"])
        total = int(meta["total"])
        keys = [invalid_key(self._prefix, batch_id), *self._count_keys(redis, batch_id, total)]
        keys += [
            line_key(stream_key(self._prefix, line_request_id(batch_id, i))) for i in range(total)
        ]
        for start in range(0, len(keys), CHUNK * 4):
            pipe = redis.pipeline(transaction=False)
            for one in keys[start : start + CHUNK * 4]:
                pipe.expire(one, ttl_s)
            await pipe.execute()
        stamp = {
            BatchStatus.FAILED: "failed_at",
            BatchStatus.CANCELLED: "cancelled_at",
            BatchStatus.EXPIRED: "expired_at",
            BatchStatus.COMPLETED: "completed_at",
        }
        pipe = redis.pipeline(transaction=False)
        pipe.hsetnx(key, stamp[final], str(now))
        pipe.hsetnx(key, "status", final.value)
        pipe.expire(key, ttl_s)
        await pipe.execute()

    async def _records(
        self, batch_id: str, total: int, invalid: Mapping[str, str]
    ) -> AsyncIterator[tuple[int, Any]]:
        """(line, its record, or its refusal as `{"invalid": ...}`, or None: not ended),
        in input order."""
        redis = await self._redis()
        for start in range(0, total, CHUNK):
            lines = range(start, min(start + CHUNK, total))
            asked = [i for i in lines if str(i) not in invalid]
            pipe = redis.pipeline(transaction=False)
            for i in asked:
                pipe.get(line_key(stream_key(self._prefix, line_request_id(batch_id, i))))
            got = dict(zip(asked, await pipe.execute(), strict=True))
            for i in lines:
                if str(i) in invalid:
                    yield i, {"invalid": json.loads(invalid[str(i)])}
                    continue
                raw = got[i]
                yield i, None if raw is None else json.loads(raw)

    async def results(
        self, batch_id: str, token_text: TokenText | None = None
    ) -> AsyncIterator[tuple[bool, bytes]]:
        """The ended lines, in input order: (True, an output line) or (False, an error
        line), each one JSON line as bytes."""
        meta = await self._meta(batch_id)
        total = int(meta["total"])
        endpoint = meta["endpoint"]
        invalid = cast(
            dict[str, str], await (await self._redis()).hgetall(invalid_key(self._prefix, batch_id))
        )
        async for line, record in self._records(batch_id, total, invalid):
            if record is None:
                continue
            if "invalid" in record:
                refusal = record["invalid"]
                yield False, dumps(
                    error_line(batch_id, line, refusal["custom_id"], refusal["code"],
                               refusal["message"])
                )  # fmt: skip
                continue
            if record.get("state") != ENDED:
                continue
            ok, value = result_line(
                batch_id, line, endpoint, record, token_text or self._token_text
            )
            yield ok, dumps(value)

    # -- cancel -----------------------------------------------------------------------

    async def cancel(self, batch_id: str) -> BatchObject:
        """Cancel the batch; returns its Batch object (`cancelling`, or `cancelled` once
        every line has ended)."""
        meta = await self._meta(batch_id)
        if meta.get("status") in FINAL_STATUSES:
            return await self.status(batch_id)
        redis = await self._redis()
        await redis.hsetnx(
            batch_key(self._prefix, batch_id), "cancelling_at", str(int(time.time()))
        )
        meta = await self._meta(batch_id)
        cancelled: Fields = {
            "event": DONE, "finish_reason": FinishReason.CANCELLED.value, "generated_tokens": 0,
            "input_tokens": 0, "generated_text": "",
        }  # fmt: skip
        running = await self._end_untaken(batch_id, meta, cancelled, mark_cancelled=True)
        for request_id in running:
            await self._client.cancel(request_id)
        return await self.status(batch_id)

    async def _end_untaken(
        self,
        batch_id: str,
        meta: Mapping[str, str],
        fields: Fields,
        *,
        mark_cancelled: bool = False,
    ) -> list[str]:
        """End with `fields` every pending line whose stream is empty and whose lease
        nobody holds; returns the request ids of the pending lines left (started: they
        end themselves, as cancelled when `mark_cancelled`)."""
        redis = await self._redis()
        store = StreamStore(redis, ttl_s=self._client.stream_ttl_s, model_name="")
        total = int(meta["total"])
        invalid = cast(dict[str, str], await redis.hgetall(invalid_key(self._prefix, batch_id)))
        pending: list[str] = []
        async for line, record in self._records(batch_id, total, invalid):
            if record is not None and record.get("state") == PENDING:
                pending.append(stream_key(self._prefix, line_request_id(batch_id, line)))
        left: list[str] = []
        for start in range(0, len(pending), CHUNK):
            streams = pending[start : start + CHUNK]
            if mark_cancelled:
                pipe = redis.pipeline(transaction=False)
                for stream in streams:
                    pipe.set(cancel_key(stream), b"1", ex=self._client.stream_ttl_s)
                await pipe.execute()
            batch = WriteBatch.of_entries(
                [(stream, FIRST_ENTRY, dict(fields)) for stream in streams],
                {},
                cluster=store.cluster,
            )
            refused = await store.write(batch)
            pipe = redis.pipeline(transaction=False)
            for stream in streams:
                pipe.get(line_key(stream))
            for stream, raw in zip(streams, await pipe.execute(), strict=True):
                if raw is not None and json.loads(raw).get("state") == PENDING:
                    left.append(stream.removeprefix(self._prefix))
                elif stream in refused and refused[stream] != LEASE_LOST_REASON:
                    log.warning("batch line %s: %s", stream, refused[stream])
        return left

    # -- listing ----------------------------------------------------------------------

    async def list_batches(self, limit: int = 100) -> list[BatchObject]:
        """The newest batches first (those whose records expired are dropped from the
        index as they are met)."""
        redis = await self._redis()
        ids = cast(list[str], await redis.zrevrange(index_key(self._prefix), 0, limit - 1))
        found = []
        for batch_id in ids:
            try:
                found.append(await self.status(batch_id))
            except BatchNotFound:
                await redis.zrem(index_key(self._prefix), batch_id)
        return found

    async def wait(
        self, batch_id: str, *, poll_s: float = 1.0, progress: Progress | None = None
    ) -> BatchObject:
        """Poll the status until the batch ends; `progress` gets the lines ended since the
        last poll. Returns the final Batch object. Redis lost after the first poll (a
        restart, a failover) is polled on for up to the client's `reconnect_timeout_s`,
        then `ServiceUnavailable`, as the stream reader does."""
        reported = 0
        loop = asyncio.get_running_loop()
        failing_since: float | None = None
        batch = await self.status(batch_id)  # unreachable at the start: raised at once
        while True:
            counts = batch["request_counts"]
            ended = counts["completed"] + counts["failed"]
            if progress is not None and ended > reported:
                progress(ended - reported)
                reported = ended
            if batch["status"] in FINAL_STATUSES:
                return batch
            await asyncio.sleep(poll_s)
            try:
                batch = await self.status(batch_id)
                failing_since = None
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                now = loop.time()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since >= self._client.reconnect_timeout_s:
                    raise ServiceUnavailable(
                        f"lost Redis for {self._client.reconnect_timeout_s:.0f}s while "
                        f"waiting for batch {batch_id}: {reason(exc)}"
                    ) from None
                self._client.reconnects += 1


def batch_object(meta: Mapping[str, str], counts: Counts) -> BatchObject:
    """OpenAI's Batch object from the batch's hash and counters."""
    invalid = int(meta.get("invalid", 0))
    status = meta.get("status")
    if status is None:
        if "in_progress_at" not in meta and "failed_at" not in meta:
            status = BatchStatus.VALIDATING.value
        elif "cancelling_at" in meta:
            status = BatchStatus.CANCELLING.value
        elif "finalizing_at" in meta:
            status = BatchStatus.FINALIZING.value
        else:
            status = BatchStatus.IN_PROGRESS.value
    failed = counts.err + invalid
    final = status in FINAL_STATUSES
    batch_id = meta["id"]
    obj: dict[str, Any] = {
        "id": batch_id,
        "object": "batch",
        "endpoint": meta["endpoint"],
        "input_file_id": meta["input_file_id"],
        "completion_window": meta["completion_window"],
        "status": status,
        "output_file_id": f"file-{batch_id}-output" if final and counts.ok else None,
        "error_file_id": f"file-{batch_id}-errors" if final and failed else None,
        "errors": None,
        "request_counts": {"total": int(meta["total"]), "completed": counts.ok, "failed": failed},
        "metadata": {"tenant": meta["tenant"]} if "tenant" in meta else None,
    }
    for name in ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                 "failed_at", "expired_at", "cancelling_at", "cancelled_at"):  # fmt: skip
        obj[name] = int(meta[name]) if name in meta else None
    if status == BatchStatus.FAILED:
        obj["errors"] = {
            "object": "list",
            "data": [{"code": "invalid_request", "line": None, "param": None,
                      "message": "no line of the file is valid: see the errors file"}],
        }  # fmt: skip
    return cast(BatchObject, obj)
