"""The cancel fanout: every worker binds an exclusive queue to `<queue>.cancel`. The
broker's callback only hands the message over; a supervised task stops the request here
(if it runs here) and stores the cancel mark for a request no worker has taken yet."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aio_pika.abc import AbstractIncomingMessage

from trtllm_worker.config import Settings
from trtllm_worker.connect.redis import REDIS_FAILURES
from trtllm_worker.contract.job import parse_cancel
from trtllm_worker.contract.stream import stream_key
from trtllm_worker.ops.log import about
from trtllm_worker.streams.store import StreamStore

log = logging.getLogger(__name__)

MAX_PENDING = 10_000
"""Cancels waiting to be handled; beyond it the oldest are handled late, never lost (the
broker's callback waits)."""


class CancelListener:
    """Turns cancel messages into `cancel(request_id)` calls and cancel marks."""

    def __init__(
        self, settings: Settings, store: StreamStore, cancel: Callable[[str], bool]
    ) -> None:
        self._settings = settings
        self._store = store
        self._cancel = cancel
        self._pending: asyncio.Queue[bytes] = asyncio.Queue(MAX_PENDING)

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        """The broker's callback (no_ack: a cancel is a broadcast, not a job)."""
        await self._pending.put(message.body)

    async def run(self) -> None:
        """Forever: handle the cancels in the order they came."""
        while True:
            body = await self._pending.get()
            await self.handle(body)

    async def handle(self, body: bytes) -> None:
        request_id = parse_cancel(body)
        if request_id is None:
            log.warning("ignoring a cancel message without a valid request_id")
            return
        here = self._cancel(request_id)
        log.info("cancel%s", " (running here)" if here else "", extra=about(request_id))
        try:
            await self._store.mark_cancelled(stream_key(self._settings.stream_prefix, request_id))
        except REDIS_FAILURES as exc:
            log.warning("could not store the cancel mark: %s", exc, extra=about(request_id))
