"""`/v1/chat/completions` and `/v1/completions`: the request becomes a job, the answer
is read from the job's stream. The reply waits for the job's first entry before it
begins, so a job refused by the worker is an HTTP error, not a broken stream; after
that every entry the stream holds is relayed, whichever worker wrote it. A client that
goes away cancels its job."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from trtllm_worker.client import (
    Client,
    DoneEvent,
    ErrorEvent,
    Event,
    InvalidJobError,
    QueueFull,
    ServiceUnavailable,
    TokenEvent,
)
from trtllm_worker.client.completions import (
    Logprob,
    TokenText,
    answer_body,
    chunk,
    completion_id,
    finish_reason,
    usage_chunk,
)
from trtllm_worker.contract.openai import UnsupportedRequest, job_fields
from trtllm_worker.gateway.admission import Admission
from trtllm_worker.gateway.errors import (
    APIError,
    bad_request,
    job_error,
    not_found,
    too_many,
    unavailable,
)
from trtllm_worker.gateway.keys import Caller
from trtllm_worker.gateway.metrics import GatewayMetrics
from trtllm_worker.gateway.reader import StreamHub

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
"""The job's request id on every answer: `/v1/streams/{id}` reads the rest of an answer
whose connection was lost."""

_T = TypeVar("_T")


@dataclass
class Answering:
    """What the completion routes share: the SDK client and the gateway's parts."""

    client: Client
    reader: StreamHub
    admission: Admission
    metrics: GatewayMetrics
    model: str
    token_text: TokenText | None
    background: set[asyncio.Task[Any]]

    def cancel_later(self, request_id: str) -> None:
        """Cancel the job in a task of its own: the request's task is being torn down."""
        self.metrics.cancelled.inc()
        task = asyncio.create_task(self._cancel(request_id))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _cancel(self, request_id: str) -> None:
        try:
            await self.client.cancel(request_id)
        except Exception as exc:  # the job then runs to its end: say so, lose nothing else
            log.warning("could not cancel %s after its client left: %s", request_id, exc)


async def read_json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise bad_request(
            "We could not parse the JSON body of your request. (HINT: This likely means "
            "you aren't using your HTTP library correctly.)"
        ) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _job_options(fields: dict[str, Any]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(inputs, parameters, other job options) of `job_fields`' result."""
    inputs = fields.pop("inputs", None)
    if inputs is None:
        inputs = fields.pop("input_ids", None)
    parameters = fields.pop("parameters", {})
    return inputs, parameters, fields


def _read_request(
    served: str, endpoint: str, body: dict[str, Any]
) -> tuple[dict[str, Any], bool, bool]:
    """(the job's fields, whether to stream, whether to add the usage chunk), or the 400
    or 404 OpenAI answers for the body."""
    model = body.get("model")
    if isinstance(model, str) and model and model != served:
        raise not_found(
            f"The model `{model}` does not exist or you do not have access to it.",
            code="model_not_found",
            param="model",
        )
    try:
        fields = job_fields(endpoint, body, stream=True)
    except UnsupportedRequest as exc:
        raise bad_request(str(exc), param=exc.param) from None
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return fields, stream, include_usage


async def create(answering: Answering, endpoint: str, request: Request, caller: Caller) -> Response:
    """Publish the request as a job and answer it, streamed or whole."""
    arrived = time.monotonic()
    fields, stream, include_usage = _read_request(
        answering.model, endpoint, await read_json(request)
    )
    logprobs = bool(fields["parameters"].get("return_logprobs"))
    await answering.admission.admit()
    request_id = uuid.uuid4().hex
    inputs, parameters, extra = _job_options(fields)
    if caller.tenant is not None:
        extra["tenant"] = caller.tenant
    try:
        await answering.client.submit(
            inputs, parameters, request_id=request_id, priority=caller.priority, **extra
        )
    except InvalidJobError as exc:
        raise bad_request(exc.message, code=exc.code) from None
    except QueueFull as exc:
        answering.metrics.refused.labels("queue_full").inc()
        raise too_many(f"the queue refused the job: {exc}") from None
    except ServiceUnavailable as exc:
        answering.metrics.refused.labels("unavailable").inc()
        raise unavailable(str(exc)) from None
    answer = _Answer(
        answering, endpoint, request_id, int(time.time()), logprobs, include_usage, arrived
    )
    events = answering.reader.stream(request_id)
    try:
        first = await _unless_gone(request.receive, _first(events))
    except _ClientGone:
        await events.aclose()
        answering.cancel_later(request_id)
        return Response(status_code=499)  # nobody reads it; the access log does
    except BaseException:
        # no answer began and the client has no request id to follow it by: nobody will
        # read this job (Redis lost past the reconnect timeout, the gateway stopping)
        await events.aclose()
        answering.cancel_later(request_id)
        raise
    if isinstance(first, ErrorEvent):
        await events.aclose()
        raise job_error(first.code, first.message)
    headers = {REQUEST_ID_HEADER: request_id}
    if stream:
        return EventSourceResponse(
            answer.chunks(first, events),
            headers=headers,
            ping=15,
            send_timeout=30,
        )
    try:
        done = await _unless_gone(request.receive, answer.collect(first, events))
    except _ClientGone:
        answering.cancel_later(request_id)
        return Response(status_code=499)
    finally:
        await events.aclose()
    return JSONResponse(done, headers=headers)


class _ClientGone(Exception):
    """The client closed its connection before the answer ended."""


async def _unless_gone(receive: Receive, work: Awaitable[_T]) -> _T:
    """`work`'s result, or `_ClientGone` as soon as the client disconnects."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise _ClientGone
    return task.result()


async def _first(events: AsyncIterator[Event]) -> Event:
    try:
        return await anext(events)
    except ServiceUnavailable as exc:
        raise unavailable(str(exc)) from None
    except StopAsyncIteration:
        raise APIError(
            500, "the job's stream ended without an answer", kind="server_error"
        ) from None


@dataclass
class _Answer:
    answering: Answering
    endpoint: str
    request_id: str
    created: int
    logprobs: bool
    include_usage: bool
    arrived: float

    @property
    def _id(self) -> str:
        return completion_id(self.endpoint, self.request_id)

    def _chunk(self, **parts: Any) -> dict[str, Any]:
        a = self.answering
        return chunk(
            self.endpoint,
            answer_id=self._id,
            created=self.created,
            model=a.model,
            with_usage=self.include_usage,
            token_text=a.token_text,
            **parts,
        )

    def _first_text(self) -> Callable[[], None]:
        route = self.endpoint
        histogram = self.answering.metrics.first_byte
        arrived = self.arrived
        said = False

        def once() -> None:
            nonlocal said
            if not said:
                said = True
                histogram.labels(route).observe(time.monotonic() - arrived)

        return once

    async def collect(self, first: Event, events: AsyncIterator[Event]) -> dict[str, Any]:
        """The whole answer, once the job's `done` entry is in."""
        tokens: list[Logprob] = []
        event: Event = first
        seen_first = self._first_text()
        try:
            while True:
                if isinstance(event, TokenEvent):
                    seen_first()
                    self.answering.metrics.tokens.inc()
                    if self.logprobs:
                        tokens.append(_logprob(event))
                elif isinstance(event, DoneEvent):
                    break
                elif isinstance(event, ErrorEvent):
                    raise job_error(event.code, event.message)
                event = await anext(events)
        except ServiceUnavailable as exc:
            # a whole answer's error names no request id: nobody can follow the job
            self.answering.cancel_later(self.request_id)
            raise unavailable(str(exc)) from None
        return answer_body(
            self.endpoint,
            answer_id=self._id,
            created=self.created,
            model=self.answering.model,
            done=event.model_dump(),
            logprobs=tokens if self.logprobs else None,
            token_text=self.answering.token_text,
        )

    async def chunks(
        self, first: Event, events: AsyncGenerator[Event, None]
    ) -> AsyncIterator[dict[str, str]]:
        """The server-sent events of a streamed answer, `[DONE]` last. A client gone
        before the end (the response's task cancelled) cancels the job."""
        metrics = self.answering.metrics
        metrics.streams_open.inc()
        ended = False
        seen_first = self._first_text()
        offset = 0
        began = False
        try:
            event: Event = first
            while True:
                if isinstance(event, TokenEvent):
                    metrics.tokens.inc()
                    if event.text or self.logprobs or not began:
                        seen_first()
                        yield self._data(
                            self._chunk(
                                text=event.text,
                                first=not began,
                                logprobs=[_logprob(event)] if self.logprobs else None,
                                text_offset=offset,
                            )
                        )
                        began = True
                        offset += len(event.text)
                elif isinstance(event, DoneEvent):
                    if not began and self.endpoint.endswith("chat/completions"):
                        yield self._data(self._chunk(first=True))
                    yield self._data(self._chunk(finish=finish_reason(event.finish_reason)))
                    if self.include_usage:
                        yield self._data(
                            usage_chunk(
                                self.endpoint,
                                answer_id=self._id,
                                created=self.created,
                                model=self.answering.model,
                                done=event.model_dump(),
                            )
                        )
                    ended = True
                    yield {"data": "[DONE]"}
                    return
                elif isinstance(event, ErrorEvent):
                    ended = True
                    yield self._data(job_error(event.code, event.message).body())
                    return
                try:
                    event = await anext(events)
                except ServiceUnavailable as exc:
                    ended = True  # the job goes on; the client may read it from /v1/streams
                    yield self._data(unavailable(str(exc)).body())
                    return
        finally:  # first what needs no await: a cancelled task may not get past one
            metrics.streams_open.dec()
            if not ended:
                self.answering.cancel_later(self.request_id)
            await events.aclose()

    @staticmethod
    def _data(value: dict[str, Any]) -> dict[str, str]:
        return {"data": json.dumps(value, ensure_ascii=False, separators=(",", ":"))}


def _logprob(event: TokenEvent) -> Logprob:
    return Logprob(
        event.token_id,
        event.text,
        event.logprob if event.logprob is not None else 0.0,
        event.top_logprobs or [],
    )
