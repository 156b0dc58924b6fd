"""`Client` for code without an event loop: each call runs the async client's call to
completion on a private event loop, with the same typed signature, so that the two
cannot drift apart unnoticed (mypy checks the pass-through)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Collection, Coroutine, Iterator, Mapping
from collections.abc import Sequence as Seq
from datetime import date
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, Unpack

from trtllm_worker.client.admin import DeadLetter
from trtllm_worker.client.async_client import Client, ClientOptions
from trtllm_worker.client.batch_files import DEFAULT_MAX_BYTES, DEFAULT_MAX_LINES
from trtllm_worker.client.batches import DEFAULT_WINDOW, BatchObject, Progress
from trtllm_worker.client.completions import TokenText
from trtllm_worker.client.events import DoneEvent, Event
from trtllm_worker.client.jobs import JobOptions
from trtllm_worker.client.usage import Usage
from trtllm_worker.config import Settings
from trtllm_worker.contract.job import Parameters

_T = TypeVar("_T")


class SyncClient:
    """`Client` for code without an event loop: the same calls, blocking. Its event loop
    and connections live until `close()` (or the end of a `with` block).

    ```python
    with SyncClient(load_settings()) as client:
        print(client.generate("Hello", {"max_new_tokens": 16}).generated_text)
    ```"""

    def __init__(self, settings: Settings | None = None, **options: Unpack[ClientOptions]) -> None:
        self._settings = settings
        self._options = options
        self._runner: asyncio.Runner | None = None
        self._client: Client | None = None

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self, call: Callable[[Client], Coroutine[Any, Any, _T]]) -> _T:
        if self._runner is None:
            self._runner = asyncio.Runner()
        if self._client is None:
            self._client = Client(self._settings, **self._options)
        return self._runner.run(call(self._client))

    def close(self) -> None:
        """Close the connections and the event loop."""
        if self._runner is None:
            return
        if self._client is not None:
            self._runner.run(self._client.aclose())
            self._client = None
        self._runner.close()
        self._runner = None

    def submit(
        self,
        inputs: str | Seq[int] | None = None,
        parameters: Mapping[str, Any] | Parameters | None = None,
        *,
        trace_context: Mapping[str, str] | None = None,
        priority: int | None = None,
        **options: Unpack[JobOptions],
    ) -> str:
        """`Client.submit`."""
        return self._run(
            lambda client: client.submit(
                inputs, parameters, trace_context=trace_context, priority=priority, **options
            )
        )

    def generate(
        self,
        inputs: str | Seq[int] | None = None,
        parameters: Mapping[str, Any] | Parameters | None = None,
        **options: Unpack[JobOptions],
    ) -> DoneEvent:
        """`Client.generate`."""
        return self._run(lambda client: client.generate(inputs, parameters, **options))

    def result(self, request_id: str) -> DoneEvent:
        """`Client.result`."""
        return self._run(lambda client: client.result(request_id))

    def cancel(self, request_id: str) -> None:
        """`Client.cancel`."""
        self._run(lambda client: client.cancel(request_id))

    def usage(self, tenant: str | None = None, since: date | None = None) -> list[Usage]:
        """`Client.usage`."""
        return self._run(lambda client: client.usage(tenant, since))

    def dead_letters(self, limit: int | None = None) -> list[DeadLetter]:
        """`Client.dead_letters`."""
        return self._run(lambda client: client.dead_letters(limit))

    def requeue_dead_letters(self, request_ids: Collection[str] | None = None) -> list[DeadLetter]:
        """`Client.requeue_dead_letters`."""
        return self._run(lambda client: client.requeue_dead_letters(request_ids))

    def submit_batch(
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
    ) -> str:
        """`Client.submit_batch`."""
        return self._run(
            lambda client: client.submit_batch(
                path,
                batch_id=batch_id,
                priority=priority,
                completion_window=completion_window,
                tenant=tenant,
                max_lines=max_lines,
                max_bytes=max_bytes,
                progress=progress,
                on_total=on_total,
            )
        )

    def batch(self, batch_id: str) -> BatchObject:
        """`Client.batch`."""
        return self._run(lambda client: client.batch(batch_id))

    def write_batch_results(
        self,
        batch_id: str,
        output: str | Path,
        errors: str | Path | None = None,
        token_text: TokenText | None = None,
    ) -> tuple[int, int]:
        """`Client.write_batch_results`."""
        return self._run(
            lambda client: client.write_batch_results(batch_id, output, errors, token_text)
        )

    def cancel_batch(self, batch_id: str) -> BatchObject:
        """`Client.cancel_batch`."""
        return self._run(lambda client: client.cancel_batch(batch_id))

    def list_batches(self, limit: int = 100) -> list[BatchObject]:
        """`Client.list_batches`."""
        return self._run(lambda client: client.list_batches(limit))

    def wait_batch(
        self, batch_id: str, *, poll_s: float = 1.0, progress: Progress | None = None
    ) -> BatchObject:
        """`Client.wait_batch`."""
        return self._run(
            lambda client: client.wait_batch(batch_id, poll_s=poll_s, progress=progress)
        )

    def stream(self, request_id: str, from_id: str = "0") -> Iterator[Event]:
        """`Client.stream`, as a blocking iterator."""
        holder: list[AsyncGenerator[Event, None]] = []

        async def start(client: Client) -> None:
            holder.append(client.stream(request_id, from_id))

        self._run(start)
        events = holder[0]
        try:
            while True:
                try:
                    event = self._run(lambda _: anext(events))
                except StopAsyncIteration:
                    return
                yield event
        finally:
            self._run(lambda _: events.aclose())
