# mirrors tensorrt_llm/executor/result.py (1.2.x)
from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from queue import Empty, Queue
from typing import Any, Literal, TypeAlias

from ..bindings.executor import FinishReason
from ..executor.params.sampling import SamplingParams
from ..llmapi.utils import AsyncQueue, _SyncQueue
from .utils import RequestError, has_event_loop

__all__ = ["CompletionOutput", "GenerationResult", "IterationResult", "Logprob"]

_NO_LOOP = (
    "The asyncio event loop was not present during initialization, "
    "so async operations are not available."
)


@dataclass(slots=True)
class Logprob:
    """Holds logprob and vocab rank for a token."""

    logprob: float
    rank: int | None = None


# List of token_id -> Logprob dicts, one per generated token (PyTorch backend)
TokenLogprobs: TypeAlias = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] | None = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: TokenLogprobs | None = field(default_factory=list)
    prompt_logprobs: TokenLogprobs | None = field(default_factory=list)
    finish_reason: Literal["stop", "length", "timeout", "cancelled"] | None = None
    stop_reason: int | str | None = None
    generation_logits: Any | None = None
    disaggregated_params: Any | None = None

    _last_text_len: int = field(default=0, init=False, repr=False)
    _last_token_ids_len: int = field(default=0, init=False, repr=False)
    _last_logprobs_len: int = field(default=0, init=False, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids or [])

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return (self.token_ids or [])[self._last_token_ids_len :]

    @property
    def logprobs_diff(self) -> TokenLogprobs:
        return (self.logprobs or [])[self._last_logprobs_len :]


# mirrors tensorrt_llm/_torch/pyexecutor/llm_request.py (PyResult / LlmResponse), which
# duck-type bindings.executor.Result / Response; log_probs are cumulative per beam.
@dataclass(slots=True)
class _PyResult:
    is_final: bool
    output_token_ids: list[list[int]]
    finish_reasons: list[FinishReason]
    log_probs: list[TokenLogprobs] | None = None
    cum_log_probs: list[float] | None = None
    decoding_iter: int = 0
    sequence_index: int = 0


@dataclass(slots=True)
class _LlmResponse:
    request_id: int
    error: str | None
    payload: _PyResult | None = None
    client_id: int | None = None

    def has_error(self) -> bool:
        return self.error is not None

    @property
    def error_msg(self) -> str:
        if self.error is None:
            raise RuntimeError("Cannot get the error message for a response without error")
        return self.error

    @property
    def result(self) -> _PyResult:
        if self.payload is None:
            raise RuntimeError(f"Cannot get the result for a response with an error: {self.error}")
        return self.payload


_FINISH_REASON: dict[FinishReason, Literal["stop", "length", "timeout"] | None] = {
    FinishReason.END_ID: "stop",
    FinishReason.STOP_WORDS: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TIMED_OUT: "timeout",
    FinishReason.CANCELLED: None,  # already set to 'cancelled' above
}

_ResponseItem: TypeAlias = tuple[_LlmResponse, None]


class GenerationResult:
    """Result of one request.  Binds an AsyncQueue when created while an event loop runs in
    the creating thread, a queue.Queue otherwise (then only sync iteration works)."""

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        streaming: bool,
        abort: Callable[[int], None],
    ) -> None:
        self.id = request_id
        self.sampling_params = sampling_params
        self._prompt_token_ids = prompt_token_ids
        self._streaming = streaming
        self._abort = abort
        self._aborted = False
        self._done = False
        self.decoding_iter = 0
        self.context_logits: Any | None = None
        self.aqueue: AsyncQueue | None
        self.queue: Queue[_ResponseItem] | _SyncQueue
        if has_event_loop():
            self.aqueue = AsyncQueue()
            self.queue = self.aqueue.sync_q
        else:
            self.queue = Queue()
            self.aqueue = None
        self._outputs = [CompletionOutput(i) for i in range(sampling_params.best_of or 1)]

    @property
    def request_id(self) -> int:
        return self.id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs[: self.sampling_params.n]

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Cancel the request; it ends with finish_reason 'cancelled' on a later step."""
        self._abort(self.request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def _deliver(self, item: _ResponseItem) -> None:
        """Called from the engine thread (the proxy's dispatch thread in the real code)."""
        # On EventLoopShutdownError the real proxy logs a warning: the item stays queued but
        # nobody is woken.
        with contextlib.suppress(AsyncQueue.EventLoopShutdownError):
            self.queue.put(item)

    def _handle_sequence(self, finish: FinishReason, res: _PyResult) -> None:
        output = self._outputs[res.sequence_index]
        token_ids = output.token_ids if output.token_ids is not None else []
        output._last_token_ids_len = len(token_ids)
        token_ids.extend(res.output_token_ids[0])
        output.token_ids = token_ids
        if res.cum_log_probs is not None:
            output.cumulative_logprob = res.cum_log_probs[0]
        if res.log_probs is not None:
            output._last_logprobs_len = len(output.logprobs or [])
            output.logprobs = res.log_probs[0]
        if finish == FinishReason.CANCELLED:
            output.finish_reason = "cancelled"
        if not self._done:
            return
        if finish not in _FINISH_REASON:
            raise ValueError(f"Unknown finish reason: {finish}")
        output.finish_reason = _FINISH_REASON[finish] or output.finish_reason
        if finish == FinishReason.STOP_WORDS:
            self._trim_stop_words(output)

    def _trim_stop_words(self, output: CompletionOutput) -> None:
        token_ids = output.token_ids or []
        for reason, words in self.sampling_params._get_stop_reasons_and_words():
            if token_ids[-len(words) :] == words:
                output.stop_reason = reason
                if not self.sampling_params.include_stop_str_in_output:
                    output.token_ids = token_ids[: -len(words)]
                break

    def _handle_response(self, response: _LlmResponse) -> None:
        if response.has_error():
            raise RequestError(response.error_msg)  # via _handle_background_error in 1.2
        res = response.result
        self._done = res.is_final
        self.decoding_iter = res.decoding_iter
        self._handle_sequence(res.finish_reasons[0], res)

    def _result_step(self, timeout: float | None = None) -> None:
        response, _ = self.queue.get(timeout=timeout)
        self._handle_response(response)

    async def _aresult_step(self) -> None:
        assert self.aqueue is not None, _NO_LOOP
        response, _ = await self.aqueue.get()
        self._handle_response(response)

    def result(self, timeout: float | None = None) -> GenerationResult:
        while not self._done:
            self._result_step(timeout)
        return self

    async def aresult(self) -> GenerationResult:
        while not self._done:
            await self._aresult_step()
        return self

    def __await__(self) -> Generator[Any, None, GenerationResult]:
        return self.aresult().__await__()

    def __iter__(self) -> Iterator[GenerationResult]:
        return self

    def __next__(self) -> GenerationResult:
        if self._done:
            raise StopIteration
        self._result_step()
        return self

    def __aiter__(self) -> AsyncIterator[GenerationResult]:
        return self

    async def __anext__(self) -> GenerationResult:
        if self._done:
            raise StopAsyncIteration
        await self._aresult_step()
        return self

    def __hash__(self) -> int:
        return hash(self.request_id)


class IterationResult:
    """Runtime stats for all available iterations (drained by get_stats / get_stats_async)."""

    def __init__(self) -> None:
        self._done = False
        self._timeout: float | None = 2
        self.aqueue: AsyncQueue | None
        self.queue: Queue[str] | _SyncQueue
        if has_event_loop():
            self.aqueue = AsyncQueue()
            self.queue = self.aqueue.sync_q
        else:
            self.queue = Queue()
            self.aqueue = None

    def set_timeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def mark_undone(self) -> None:
        self._done = False  # called whenever a new prompt is submitted

    def get_results(self) -> list[dict[str, Any]]:
        """Block until the queue stays empty for the timeout; return everything seen."""
        results = []
        while not self._done:
            try:
                data = self.queue.get(timeout=self._timeout)
                if data is None:
                    raise Empty
                results.append(json.loads(data))
            except Empty:
                self._done = True
        return results

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._done:
            raise StopAsyncIteration
        assert self.aqueue is not None, _NO_LOOP
        try:
            data = await self.aqueue.get(timeout=self._timeout)
        except TimeoutError:
            self._done = True
            raise StopAsyncIteration from None
        result: dict[str, Any] = json.loads(data)
        return result
