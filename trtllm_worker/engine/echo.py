"""The built-in echo engine: generated token k is prompt token k mod n. It stands in for
a GPU in tests and benchmarks: all in-flight requests advance together, `tokens_per_step`
tokens per step of `step_s` seconds (more than one: as with speculative decoding or
MTP, where TensorRT-LLM hands over several tokens per request per step), at most
`capacity` of them at once (the rest wait). EOS ids,
stop token ids, `min_new_tokens` and `max_new_tokens` end requests as a model's would;
sampling parameters and guided decoding (checked at intake) are ignored. Log
probabilities are deterministic stand-ins: the generated token's is 0.0, and its top
logprobs list it first, then the lowest other ids at -1.0, -2.0, ... (`echo_top`)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from trtllm_worker.contract.job import MAX_TOP_LOGPROBS
from trtllm_worker.engine.base import (
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    TopLogprobs,
)


def echo_top(token: int, k: int) -> TopLogprobs:
    """The echo engine's top `k` for a generated `token`: the token itself first (log
    probability 0.0, as its `logprob`), then ids 0, 1, 2, ... other than it at -1.0,
    -2.0, ...: deterministic, distinct, most likely first, and within any vocabulary
    of more than `MAX_TOP_LOGPROBS` tokens."""
    others = [i for i in range(k) if i != token][: k - 1]
    return [(token, 0.0), *((other, -float(rank)) for rank, other in enumerate(others, 1))]


@dataclass(slots=True)
class _Running:
    request: EngineRequest
    source: list[int]
    generated: int
    """Tokens so far, the resumed ones included."""
    limit: int
    """`generated` at which `max_new_tokens` is reached."""
    may_stop_at: int
    """`generated` from which an EOS or stop token ends the request (min_new_tokens)."""
    ends: frozenset[int]
    """The ids that end it: its EOS ids (none with ignore_eos) and stop token ids."""
    cancelled: bool = False

    @classmethod
    def of(cls, request: EngineRequest) -> _Running:
        resumed = request.resumed_tokens
        eos = frozenset() if request.ignore_eos else request.eos_ids
        return cls(
            request,
            request.prompt_ids[: len(request.prompt_ids) - resumed],
            resumed,
            resumed + request.max_new_tokens,
            resumed + request.min_new_tokens,
            eos | request.stop_token_ids,
        )


class EchoEngine:
    """CPU-only engine with the contract's echo behaviour."""

    def __init__(
        self,
        *,
        capacity: int,
        step_s: float,
        tokens_per_step: int = 1,
        fault_token: int | None = None,
        crash_token: int | None = None,
    ) -> None:
        self._capacity = capacity
        self._step_s = step_s
        self._tokens_per_step = tokens_per_step
        self._fault_token = fault_token
        self._crash_token = crash_token
        self._waiting: deque[EngineRequest] = deque()
        self._running: dict[int, _Running] = {}
        self._cancelled_waiting: set[int] = set()
        self._cancelled_running: set[int] = set()
        """Running requests cancelled since the last step (a step leaves them first)."""
        self._next_step = time.monotonic()
        self._wakeup = threading.Event()
        self._closed = False

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def limits(self) -> EngineLimits:
        """None: the worker's own limits are the only ones; every top logprobs count."""
        return EngineLimits(max_top_logprobs=MAX_TOP_LOGPROBS)

    def enqueue(self, request: EngineRequest) -> None:
        self._waiting.append(request)

    def cancel(self, request_id: int) -> None:
        running = self._running.get(request_id)
        if running is not None:
            running.cancelled = True
            self._cancelled_running.add(request_id)
        else:
            self._cancelled_waiting.add(request_id)

    def wake(self) -> None:
        if not self._wakeup.is_set():  # set() takes a lock and notifies even when set
            self._wakeup.set()

    def stats(self) -> EngineStats:
        return EngineStats(
            active_requests=len(self._running),
            queued_requests=len(self._waiting),
            step_time_s=self._step_s,
        )

    def shutdown(self) -> None:
        self._closed = True
        self._running.clear()
        self._waiting.clear()

    def wait(self, timeout: float) -> list[EngineOutput]:
        """Sleep until the next step is due (or `timeout`, or `wake`), then run it."""
        if self._closed:
            raise RuntimeError("echo engine is shut down")
        now = time.monotonic()
        if not self._running and not self._waiting:
            self._wakeup.wait(timeout)
            self._wakeup.clear()
            return []
        delay = self._next_step - now
        if delay > 0:
            if self._wakeup.wait(min(delay, timeout)):
                self._wakeup.clear()
            if time.monotonic() < self._next_step:
                return self._admit_cancelled()
        self._next_step = max(self._next_step, time.monotonic()) + self._step_s
        return self._step()

    def _admit_cancelled(self) -> list[EngineOutput]:
        """Requests cancelled while still waiting end at once, with no tokens."""
        if not self._cancelled_waiting:
            return []
        outputs = []
        for request in [r for r in self._waiting if r.id in self._cancelled_waiting]:
            self._waiting.remove(request)
            outputs.append(EngineOutput(request.id, [], finish=FinishReason.CANCELLED))
        self._cancelled_waiting.clear()
        return outputs

    def _step(self) -> list[EngineOutput]:
        outputs = self._admit_cancelled()
        # cancelled requests leave before admission: a slot freed by a cancel (a pause)
        # takes a waiting request in this same step
        if self._cancelled_running:
            for request_id in self._cancelled_running:
                if self._running.pop(request_id, None) is not None:
                    outputs.append(EngineOutput(request_id, [], finish=FinishReason.CANCELLED))
            self._cancelled_running.clear()
        while self._waiting and len(self._running) < self._capacity:
            request = self._waiting.popleft()
            if self._crash_token is not None and self._crash_token in request.prompt_ids:
                raise RuntimeError(
                    f"echo engine crashed on token {self._crash_token} (test switch)"
                )
            if self._fault_token is not None and self._fault_token in request.prompt_ids:
                message = (
                    f"echo engine failed the request on token {self._fault_token} (test switch)"
                )
                outputs.append(EngineOutput(request.id, [], error=message))
                continue
            self._running[request.id] = _Running.of(request)
        finished = []
        now = time.time()
        tokens = self._tokens_per_step
        for request_id, running in self._running.items():
            # the common step, inline: one token that ends nothing (and no top logprobs)
            if (
                tokens == 1
                and not running.cancelled
                and running.request.deadline is None
                and not running.request.top_logprobs
            ):
                start = running.generated
                token = running.source[start % len(running.source)]
                if start + 1 < running.limit and token not in running.ends:
                    running.generated = start + 1
                    logprobs = [0.0] if running.request.return_logprobs else None
                    outputs.append(EngineOutput(request_id, [token], logprobs))
                    continue
            output = self._advance(running, now, tokens)
            outputs.append(output)
            if output.finish is not None:
                finished.append(request_id)
        for request_id in finished:
            del self._running[request_id]
        return outputs

    @staticmethod
    def _advance(running: _Running, now: float, tokens: int) -> EngineOutput:
        """Up to `tokens` more tokens; a step ends early where the request finishes (an
        EOS or stop token, or `max_new_tokens`, in the middle of the step)."""
        request = running.request
        if running.cancelled:
            return EngineOutput(request.id, [], finish=FinishReason.CANCELLED)
        if request.deadline is not None and now >= request.deadline:
            return EngineOutput(request.id, [], finish=FinishReason.DEADLINE)
        source, start = running.source, running.generated
        count = min(tokens, running.limit - start)
        if count == 1:
            generated = [source[start % len(source)]]
        else:
            generated = [source[k % len(source)] for k in range(start, start + count)]
        finish = None
        if running.ends and not running.ends.isdisjoint(generated):
            for k, token in enumerate(generated):
                if start + k + 1 >= running.may_stop_at and token in running.ends:
                    stop = token in request.stop_token_ids and (
                        request.ignore_eos or token not in request.eos_ids
                    )
                    finish = FinishReason.STOP_SEQUENCE if stop else FinishReason.EOS_TOKEN
                    del generated[k + 1 :]
                    break
        running.generated = start + len(generated)
        if finish is None and running.generated >= running.limit:
            finish = FinishReason.LENGTH
        logprobs = [0.0] * len(generated) if request.return_logprobs else None
        output = EngineOutput(request.id, generated, logprobs, finish)
        if request.top_logprobs:
            output.top_logprobs = [echo_top(token, request.top_logprobs) for token in generated]
        return output
