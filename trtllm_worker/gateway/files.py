"""OpenAI's Files and Batches API over the SDK's batches: an uploaded input file is kept
in Redis (so any replica can read it), `POST /v1/batches` publishes its lines as the
batch command does, and a batch's output and error files are files of this API, written
from the batch's records when asked.

With API keys, a file or batch belongs to the tenant whose key made it: another tenant's
key finds nothing there (404, as for an id that does not exist). Without keys, everyone
is the same caller and sees everything.

Publishing a big file takes a while, so `POST /v1/batches` answers once the batch exists
(`validating`) and publishes in the background under a short lease in Redis. Should this
replica die first, the lease lapses and the next replica asked about the batch takes the
publishing over from where it stood (submit is resumable, line by line)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from trtllm_worker.client import (
    BatchConflict,
    BatchNotFound,
    BatchObject,
    Client,
    InvalidBatch,
    ServiceUnavailable,
)
from trtllm_worker.client.batch_files import DEFAULT_MAX_BYTES
from trtllm_worker.connect.redis import AnyRedis, connect_redis
from trtllm_worker.contract.batches import (
    BatchStatus,
    file_data_key,
    file_index_key,
    file_key,
    new_batch_id,
    new_file_id,
    result_file,
    submitter_key,
    valid_batch_id,
    valid_file_id,
)
from trtllm_worker.contract.openai import ENDPOINTS
from trtllm_worker.gateway.answers import read_json
from trtllm_worker.gateway.errors import APIError, bad_request, not_found, unavailable
from trtllm_worker.gateway.keys import Caller

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""An uploaded file is kept as a list of chunks this size (Redis strings stop at 512 MB)."""
LEASE_S = 6
MAX_FILES_LISTED = 10_000
"""`GET /v1/files`' largest page, and its page when no `limit` is given (as OpenAI's)."""
RENEW_S = 2


class FilesAndBatches:
    """The routes' state: the SDK client, this replica's name, its publishing tasks."""

    def __init__(self, client: Client, max_batch_priority: int) -> None:
        self.client = client
        self.replica = uuid.uuid4().hex
        self.max_batch_priority = max_batch_priority
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._raw: AnyRedis | None = None
        self._raw_lock = asyncio.Lock()

    @property
    def _prefix(self) -> str:
        return self.client.stream_prefix

    async def _redis(self) -> AnyRedis:
        try:
            return await self.client._redis()
        except (ConnectionError, OSError) as exc:
            raise unavailable(f"Redis does not answer: {exc}") from None

    async def _bytes_redis(self) -> AnyRedis:
        """A connection that leaves values as bytes: a file's chunks are cut anywhere,
        also inside a UTF-8 character."""
        async with self._raw_lock:
            if self._raw is None:
                try:
                    self._raw = await connect_redis(
                        self.client.redis_url,
                        settings=self.client.settings,
                        client_name="trtllm-worker-gateway-files",
                    )
                except (ConnectionError, OSError) as exc:
                    raise unavailable(f"Redis does not answer: {exc}") from None
            return self._raw

    @property
    def _ttl_s(self) -> int:
        return self.client.batch_ttl_s

    # -- files ----------------------------------------------------------------------------

    async def upload(self, request: Request, caller: Caller) -> Response:
        form = await request.form(max_part_size=DEFAULT_MAX_BYTES)
        try:
            purpose = form.get("purpose")
            upload = form.get("file")
            if purpose != "batch":
                raise bad_request(
                    f'purpose {purpose!r}: this API keeps batch input files only (purpose "batch")',
                    param="purpose",
                )
            if not isinstance(upload, UploadFile):
                raise bad_request("file: required, a file part", param="file")
            file_id = new_file_id()
            size = await self._store(file_id, upload)
            now = int(time.time())
            meta = {
                "id": file_id,
                "bytes": str(size),
                "created_at": str(now),
                "filename": upload.filename or "upload.jsonl",
                "purpose": "batch",
            }
            if caller.tenant is not None:
                meta["tenant"] = caller.tenant
            redis = await self._redis()
            await redis.hset(file_key(self._prefix, file_id), mapping=cast(Any, meta))
            await redis.expire(file_key(self._prefix, file_id), self._ttl_s)
            index = file_index_key(self._prefix)
            await redis.zadd(index, {file_id: time.time_ns() // 1000})  # in upload order
            await redis.expire(index, self._ttl_s)
        finally:
            await form.close()
        return JSONResponse(_file_object(meta, self._ttl_s))

    async def _store(self, file_id: str, upload: UploadFile) -> int:
        redis = await self._bytes_redis()
        data = file_data_key(self._prefix, file_id)
        size = 0
        while chunk := await upload.read(CHUNK_BYTES):
            size += len(chunk)
            if size > DEFAULT_MAX_BYTES:
                await redis.delete(data)
                raise bad_request(
                    f"the file is over {DEFAULT_MAX_BYTES} bytes, the limit of a batch file",
                    param="file",
                )
            await redis.rpush(data, chunk)
        if size == 0:
            raise bad_request("the file is empty", param="file")
        await redis.expire(data, self._ttl_s)
        return size

    async def file(self, file_id: str, caller: Caller) -> Response:
        result = result_file(file_id)
        if result is not None:
            batch_id, output = result
            obj = await self._batch(batch_id, caller)
            size = 0
            async for chunk in self._results(batch_id, output):
                size += len(chunk)
            meta = {
                "id": file_id,
                "bytes": str(size),
                "created_at": str(obj.get("completed_at") or obj["created_at"]),
                "filename": f"{batch_id}_{'output' if output else 'error'}.jsonl",
                "purpose": "batch_output",
            }
            return JSONResponse(_file_object(meta, None))
        return JSONResponse(_file_object(await self._file_meta(file_id, caller), self._ttl_s))

    async def _file_meta(self, file_id: str, caller: Caller) -> dict[str, str]:
        """The uploaded file's record, if it exists and is the caller's (else 404)."""
        if valid_file_id(file_id) is None:
            raise not_found(f"No such File object: {file_id}", param="id")
        meta = cast(
            dict[str, str], await (await self._redis()).hgetall(file_key(self._prefix, file_id))
        )
        if not meta or not _visible(meta.get("tenant"), caller):
            raise not_found(f"No such File object: {file_id}", param="id")
        return meta

    async def content(self, file_id: str, caller: Caller) -> Response:
        result = result_file(file_id)
        if result is not None:
            batch_id, output = result
            await self._batch(batch_id, caller)  # 404 before the response begins
            return StreamingResponse(
                self._results(batch_id, output), media_type="application/jsonl"
            )
        await self._file_meta(file_id, caller)
        return StreamingResponse(self._chunks(file_id), media_type="application/jsonl")

    async def _chunks(self, file_id: str) -> AsyncIterator[bytes]:
        redis = await self._bytes_redis()
        key = file_data_key(self._prefix, file_id)
        length = int(await redis.llen(key))
        for start in range(0, length, 16):
            for chunk in cast(list[bytes], await redis.lrange(key, start, start + 15)):
                yield chunk

    async def _results(self, batch_id: str, output: bool) -> AsyncIterator[bytes]:
        async for ok, line in self.client.batch_results(batch_id):
            if ok == output:
                yield line

    async def list_files(self, request: Request, caller: Caller) -> Response:
        """The caller's uploaded files, newest first (or `order=asc`), `limit` a page from
        after `after`, only of `purpose` when given. A batch's output and error files are
        not listed: they are its `output_file_id` and `error_file_id`."""
        query = request.query_params
        try:
            limit = int(query.get("limit", str(MAX_FILES_LISTED)))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_FILES_LISTED:
            raise bad_request(f"limit: an integer from 1 to {MAX_FILES_LISTED}", param="limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request('order: "asc" or "desc"', param="order")
        purpose, after = query.get("purpose"), query.get("after")
        redis = await self._redis()
        index = file_index_key(self._prefix)
        ids = cast(list[str], await redis.zrevrange(index, 0, -1))  # the grants' command
        if order == "asc":
            ids.reverse()
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page: list[dict[str, Any]] = []
        for start in range(0, len(ids), 100):
            chunk = ids[start : start + 100]
            async with redis.pipeline(transaction=False) as pipe:
                for file_id in chunk:
                    pipe.hgetall(file_key(self._prefix, file_id))
                metas = cast(list[dict[str, str]], await pipe.execute())
            gone = [file_id for file_id, meta in zip(chunk, metas, strict=True) if not meta]
            if gone:
                await redis.zrem(index, *gone)
            page += [
                _file_object(meta, self._ttl_s)
                for meta in metas
                if meta
                and _visible(meta.get("tenant"), caller)
                and (purpose is None or meta["purpose"] == purpose)
            ]
            if len(page) > limit:
                break
        data = page[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(page) > limit,
            }
        )

    async def delete(self, file_id: str, caller: Caller) -> Response:
        if result_file(file_id) is not None:
            raise bad_request("a batch's output and error files go with the batch", param="id")
        await self._file_meta(file_id, caller)
        redis = await self._redis()
        await redis.delete(file_key(self._prefix, file_id))
        await redis.delete(file_data_key(self._prefix, file_id))
        await redis.zrem(file_index_key(self._prefix), file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    # -- batches --------------------------------------------------------------------------

    async def create_batch(self, request: Request, caller: Caller) -> Response:
        body = await read_json(request)
        file_id = body.get("input_file_id")
        endpoint = body.get("endpoint")
        window = body.get("completion_window")
        if not isinstance(file_id, str) or not file_id:
            raise bad_request("input_file_id: required, a string", param="input_file_id")
        if endpoint not in ENDPOINTS:
            raise bad_request(
                f"endpoint {endpoint!r}: must be one of {', '.join(ENDPOINTS)}",
                param="endpoint",
            )
        if not isinstance(window, str):
            raise bad_request('completion_window: required, e.g. "24h"', param="completion_window")
        for name in body:
            if name not in ("input_file_id", "endpoint", "completion_window", "metadata"):
                raise bad_request(f"{name}: not supported", param=name)
        await self._file_meta(file_id, caller)
        batch_id = new_batch_id()
        created = asyncio.Event()
        task = self._start(batch_id, file_id, window, caller, created.set)
        waiting = asyncio.ensure_future(created.wait())
        try:
            await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise _api_error(cast(BaseException, task.exception()))
        return JSONResponse(await self._batch(batch_id, caller))

    def _priority(self, caller: Caller) -> int:
        """A batch's lines run below the interactive tier, whatever the key's priority."""
        return min(caller.priority, self.max_batch_priority)

    def _start(
        self,
        batch_id: str,
        file_id: str,
        window: str,
        caller: Caller,
        on_created: Any = None,
    ) -> asyncio.Task[None]:
        task = asyncio.create_task(
            self._publish(batch_id, file_id, window, caller, on_created),
            name=f"batch {batch_id}",
        )
        self.tasks[batch_id] = task

        def ended(task: asyncio.Task[None]) -> None:
            self.tasks.pop(batch_id, None)
            if not task.cancelled():
                task.exception()  # logged by _publish; retrieved here, not warned about

        task.add_done_callback(ended)
        return task

    async def _publish(
        self, batch_id: str, file_id: str, window: str, caller: Caller, on_created: Any
    ) -> None:
        """Copy the file out of Redis and submit it, holding the publishing lease."""
        redis = await self._redis()
        lease = submitter_key(self._prefix, batch_id)
        await redis.set(lease, self.replica, ex=LEASE_S)
        renew = asyncio.create_task(self._renew(redis, lease))
        fd, name = tempfile.mkstemp(prefix=f"{batch_id}-", suffix=".jsonl")
        path = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in self._chunks(file_id):
                    out.write(chunk)
            await self.client.submit_batch(
                path,
                batch_id=batch_id,
                priority=self._priority(caller),
                completion_window=window,
                tenant=caller.tenant,
                input_file_id=file_id,
                on_created=on_created,
            )
        except Exception as exc:
            log.warning("batch %s: publishing stopped: %s", batch_id, exc)
            raise
        finally:
            renew.cancel()
            await asyncio.to_thread(path.unlink, missing_ok=True)
            with contextlib.suppress(Exception):
                await redis.delete(lease)

    async def _renew(self, redis: AnyRedis, lease: str) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            with contextlib.suppress(Exception):
                await redis.set(lease, self.replica, ex=LEASE_S)

    async def _batch(self, batch_id: str, caller: Caller) -> BatchObject:
        """The batch, if it exists and is the caller's (else 404)."""
        missing = not_found(f"No such Batch object: {batch_id}", param="batch_id")
        if valid_batch_id(batch_id) is None:
            raise missing
        try:
            obj = await self.client.batch(batch_id)
        except BatchNotFound:
            raise missing from None
        except ServiceUnavailable as exc:
            raise unavailable(str(exc)) from None
        if not _visible(_batch_tenant(obj), caller):
            raise missing
        return obj

    async def retrieve_batch(self, batch_id: str, caller: Caller) -> Response:
        obj = await self._batch(batch_id, caller)
        if obj["status"] == BatchStatus.VALIDATING and batch_id not in self.tasks:
            await self._take_over(obj)
        return JSONResponse(obj)

    async def _take_over(self, obj: BatchObject) -> None:
        """Publish the rest of a batch whose publisher's lease lapsed (it died)."""
        redis = await self._redis()
        batch_id = obj["id"]
        if not await redis.set(
            submitter_key(self._prefix, batch_id), self.replica, nx=True, ex=LEASE_S
        ):
            return  # a live replica publishes it
        meta = cast(dict[str, str], await redis.hgetall(f"{self._prefix}_batch:{batch_id}"))
        caller = Caller(meta.get("tenant"), int(meta.get("priority", 0)))
        log.warning("batch %s: its publisher is gone; publishing the rest here", batch_id)
        self._start(batch_id, obj["input_file_id"], obj["completion_window"], caller)

    async def list_batches(self, request: Request, caller: Caller) -> Response:
        try:
            limit = int(request.query_params.get("limit", "20"))
        except ValueError:
            raise bad_request("limit: an integer from 1 to 100", param="limit") from None
        if not 1 <= limit <= 100:
            raise bad_request("limit: an integer from 1 to 100", param="limit")
        after = request.query_params.get("after")
        scoped = caller.tenant is not None
        batches = await self.client.list_batches(limit=1000 if after or scoped else limit + 1)
        batches = [b for b in batches if _visible(_batch_tenant(b), caller)]
        if after:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1 :] if after in ids else []
        page = batches[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(batches) > limit,
            }
        )

    async def cancel_batch(self, batch_id: str, caller: Caller) -> Response:
        await self._batch(batch_id, caller)
        return JSONResponse(await self.client.cancel_batch(batch_id))

    async def close(self) -> None:
        """Stop publishing here (another replica takes it over once the lease lapses)."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._raw is not None:
            await self._raw.aclose()


def _visible(owner: str | None, caller: Caller) -> bool:
    """Whether `caller` may see what `owner` made: any caller without keys (no tenants),
    a keyed caller only its own tenant's."""
    return caller.tenant is None or owner == caller.tenant


def _batch_tenant(obj: BatchObject) -> str | None:
    metadata = obj.get("metadata") or {}
    tenant = metadata.get("tenant")
    return tenant if isinstance(tenant, str) else None


def _file_object(meta: dict[str, str], ttl_s: int | None) -> dict[str, Any]:
    created = int(meta["created_at"])
    return {
        "id": meta["id"],
        "object": "file",
        "bytes": int(meta["bytes"]),
        "created_at": created,
        "expires_at": created + ttl_s if ttl_s is not None else None,
        "filename": meta["filename"],
        "purpose": meta["purpose"],
        "status": "processed",
        "status_details": None,
    }


def _api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidBatch | BatchConflict):
        return bad_request(str(exc))
    if isinstance(exc, ServiceUnavailable):
        return unavailable(str(exc))
    return APIError(500, f"the batch could not be created: {exc}", kind="server_error")
