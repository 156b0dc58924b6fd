"""`GET /v1/streams/{request_id}`: any job's stream as server-sent events, one event per
entry (`id:` the entry id, `data:` the entry's fields as stored, one JSON object), ending
after the terminal entry. A reconnecting client sends `Last-Event-ID` (a browser's
`EventSource` does so by itself) and continues after that entry: nothing lost, nothing
twice. Any replica answers it: the stream is all the state there is."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response

from trtllm_worker.client import InvalidJobError, ServiceUnavailable
from trtllm_worker.gateway.errors import bad_request, unavailable
from trtllm_worker.gateway.metrics import GatewayMetrics
from trtllm_worker.gateway.reader import StreamHub

ENTRY_ID = re.compile(r"^(0|[0-9]{1,20}-[0-9]{1,20})$")
RETRY_MS = 1000
"""How long a browser waits before it reconnects (the `retry:` field)."""


def resume_from(request: Request) -> str:
    """The entry after which to continue: `Last-Event-ID`, else `?from=`, else the start."""
    raw = request.headers.get("last-event-id") or request.query_params.get("from") or "0"
    raw = raw.strip()
    if not ENTRY_ID.match(raw):
        raise bad_request(
            f"Last-Event-ID {raw!r}: not a stream entry id (<ms>-<seq>)", param="Last-Event-ID"
        )
    return raw


async def stream_events(
    reader: StreamHub, metrics: GatewayMetrics, request: Request, request_id: str
) -> Response:
    from_id = resume_from(request)
    try:
        reader.client.stream_key(request_id)
    except InvalidJobError as exc:
        raise bad_request(exc.message, param="request_id") from None
    try:
        if from_id != "0" and await reader.client.ended_by(request_id, from_id):
            # nothing more will come: 204 tells a browser's EventSource not to reconnect
            return Response(status_code=204)
    except ServiceUnavailable as exc:
        raise unavailable(str(exc)) from None
    entries = reader.entries(request_id, from_id)

    async def events() -> AsyncIterator[ServerSentEvent]:
        metrics.streams_open.inc()
        try:
            first = True
            async for entry_id, fields in entries:
                yield ServerSentEvent(
                    data=json.dumps(fields, ensure_ascii=False, separators=(",", ":")),
                    id=entry_id,
                    retry=RETRY_MS if first else None,
                )
                first = False
        except ServiceUnavailable as exc:
            yield ServerSentEvent(data=json.dumps(unavailable(str(exc)).body()), event="error")
        finally:
            metrics.streams_open.dec()
            await entries.aclose()

    return EventSourceResponse(events(), ping=15, send_timeout=30)
