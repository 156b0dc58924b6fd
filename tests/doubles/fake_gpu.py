"""The simulated device behind the TensorRT-LLM double (tests only; no real source mirrored).

One deterministic fake model serves both APIs: generated token k of a request is
``prompt[k % len(prompt)]``.  An :class:`Engine` (one per ``LLM`` or ``Executor``) steps all of
its active requests together every ``FakeGpu.step_s`` seconds on a background thread, keeps at
most ``max_batch_size`` active and queues the rest, and reports each step through a callback.
The API doubles turn those steps into the real result shapes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, Literal

Finish = Literal["end_id", "stop_words", "length", "timed_out", "cancelled"]
_POISON_ERROR = "Encountered an error when fetching new request: prompt holds FakeGpu.POISON_TOKEN"


@dataclass(frozen=True, slots=True)
class Step:
    """What one request got in one iteration.  ``tokens`` includes the end id when
    ``finish == "end_id"``: the PyTorch sampler keeps it, the C++ Executor double drops it."""

    tokens: list[int]
    finish: Finish | None
    error: str | None = None


@dataclass(eq=False, slots=True)
class Job:
    """One request as the fake model sees it.  ``end_id`` None or -1: never stops on EOS."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[Step], None]
    end_id: int | None = None
    min_tokens: int = 1
    stop_words: list[list[int]] = field(default_factory=list)
    deadline: float | None = None
    generated: list[int] = field(default_factory=list)
    cancel_requested: bool = False
    steps: int = 0


@dataclass(frozen=True, slots=True)
class IterStats:
    """Plain numbers for one iteration; each API double renders them in its real shape."""

    iter: int
    timestamp: str
    iter_latency_ms: float
    num_new_active_requests: int
    num_active_requests: int
    num_queued_requests: int
    num_completed_requests: int
    max_num_active_requests: int
    max_num_blocks: int
    used_num_blocks: int
    tokens_per_block: int
    num_context_requests: int
    num_ctx_tokens: int


class Engine:
    """A scheduler over the fake model.  Its thread runs only while it has requests."""

    def __init__(
        self,
        gpu: FakeGpu,
        max_batch_size: int,
        on_stats: Callable[[IterStats], None] | None = None,
        *,
        queued_cancel: Literal["silent", "after_admission"] = "after_admission",
        max_seq_len: int | None = None,
    ) -> None:
        self.gpu = gpu
        self.max_batch_size = max_batch_size
        self.on_stats = on_stats
        self.queued_cancel = queued_cancel
        """What a cancel does to a request still waiting (each API double chooses its
        engine's): "silent" removes it without any response (the PyTorch executor);
        "after_admission" leaves it queued until admitted, its first step runs, and the
        next iteration ends it cancelled (the C++ Executor)."""
        self.max_seq_len = max_seq_len
        """Prompt + generated tokens at which a request stops with `length`."""
        self.closed = False
        self._lock = threading.Lock()
        self._queued: deque[Job] = deque()
        self._active: list[Job] = []
        self._thread: threading.Thread | None = None
        self._fail_message: str | None = None
        self._iter = 0

    def submit(self, job: Job) -> None:
        with self._lock:
            self._queued.append(job)
            if self._thread is None and not self.closed and not self.gpu.dead:
                self._thread = threading.Thread(target=self._run, name="fake-gpu", daemon=True)
                self._thread.start()

    def cancel(self, job: Job) -> None:
        with self._lock:
            job.cancel_requested = True

    def fail_active(self, message: str) -> None:
        with self._lock:
            self._fail_message = message

    def close(self) -> None:
        with self._lock:
            self.closed = True

    def _run(self) -> None:
        while True:
            time.sleep(self.gpu.step_s)
            with self._lock:
                if self.closed or self.gpu.dead or not (self._active or self._queued):
                    self._thread = None
                    return
                emissions, stats = self._iterate()
            for job, step in emissions:
                job.emit(step)
            if self.on_stats is not None:
                self.on_stats(stats)

    def _iterate(self) -> tuple[list[tuple[Job, Step]], IterStats]:
        start = time.perf_counter()
        out: list[tuple[Job, Step]] = []
        now = time.monotonic()
        for job in [*self._active, *self._queued]:
            timed_out = job.deadline is not None and now >= job.deadline
            queued = job in self._queued
            if job.cancel_requested and queued and self.queued_cancel == "after_admission":
                continue  # executorImpl.cpp checks cancels against active requests only
            if job.cancel_requested or timed_out:
                self._drop(job)
                if job.cancel_requested and queued and self.queued_cancel == "silent":
                    continue  # gone without a word
                out.append((job, Step([], "cancelled" if job.cancel_requested else "timed_out")))
        if self._fail_message is not None:
            message = f"Encountered an error in forward function: {self._fail_message}"
            out += [(job, Step([], None, message)) for job in self._active]
            self._active.clear()
            self._fail_message = None
        new = 0
        room = self.max_batch_size
        if self.gpu.kv_cache_requests is not None:
            room = min(room, self.gpu.kv_cache_requests)
        while self._queued and len(self._active) < room:
            job = self._queued.popleft()
            new += 1
            if FakeGpu.POISON_TOKEN in job.prompt:
                out.append((job, Step([], None, _POISON_ERROR)))
            else:
                self._active.append(job)
        completed = 0
        for job in list(self._active):
            step = self._decode(job)
            out.append((job, step))
            if step.finish is not None:
                self._active.remove(job)
                completed += 1
        self._iter += 1
        return out, self._stats(new, completed, (time.perf_counter() - start) * 1000)

    def _drop(self, job: Job) -> None:
        if job in self._active:
            self._active.remove(job)
        elif job in self._queued:
            self._queued.remove(job)

    def _decode(self, job: Job) -> Step:
        job.steps += 1
        tokens: list[int] = []
        eos = job.end_id is not None and job.end_id >= 0
        for _ in range(max(1, self.gpu.tokens_per_step)):
            k = len(job.generated)
            token = job.prompt[k % len(job.prompt)]
            if eos and token == job.end_id and k < job.min_tokens:
                token += 1  # EOS is masked until min_tokens tokens exist
            job.generated.append(token)
            tokens.append(token)
            if eos and token == job.end_id:
                return Step(tokens, "end_id")
            if len(job.generated) >= job.max_tokens:
                return Step(tokens, "length")
            if (
                self.max_seq_len is not None
                and len(job.prompt) + len(job.generated) >= self.max_seq_len
            ):
                return Step(tokens, "length")  # clamped silently, reported as length
            if any(w and job.generated[-len(w) :] == w for w in job.stop_words):
                return Step(tokens, "stop_words")
        return Step(tokens, None)

    def _stats(self, new: int, completed: int, latency_ms: float) -> IterStats:
        tpb = self.gpu.tokens_per_block
        used = sum(math.ceil((len(j.prompt) + len(j.generated)) / tpb) for j in self._active)
        return IterStats(
            iter=self._iter,
            timestamp=datetime.now().strftime("%m-%d-%Y %H:%M:%S.%f"),
            iter_latency_ms=latency_ms,
            num_new_active_requests=new,
            num_active_requests=len(self._active),
            num_queued_requests=len(self._queued),
            num_completed_requests=completed,
            max_num_active_requests=self.max_batch_size,
            max_num_blocks=self.gpu.max_num_blocks,
            used_num_blocks=min(used, self.gpu.max_num_blocks),
            tokens_per_block=tpb,
            num_context_requests=new,
            num_ctx_tokens=0,
        )


class FakeGpu:
    """The shared simulated device.  Tests tune the knobs and read the records."""

    POISON_TOKEN: ClassVar[int] = 999_999

    def __init__(self) -> None:
        self.step_s = 0.001
        self.tokens_per_step = 1  # 2+ imitates speculative decoding: several tokens per step
        self.logprob = -0.5
        self.device_count = 1
        self.engine_max_batch_size = 64  # what ExecutorConfig(max_batch_size=None) gets
        self.tokenizer_eos_id = 2  # end_id the LLM's simulated tokenizer would supply
        self.tokens_per_block = 32
        self.max_num_blocks = 4096
        self.kv_cache_requests: int | None = None
        """Requests the KV cache holds at once (None: no limit): below max_batch_size
        the engine queues the rest on its own, as under KV-cache pressure."""
        self.version = "1.2.1"
        """The TensorRT-LLM release the double imitates, fixed when it is installed
        (`install_tensorrt_llm(version=...)` or TRTLLM_DOUBLE_RELEASE): "1.2.x", or
        "1.4.x" for the 1.4 line (tests/doubles/__init__.py)."""
        # Everything the doubles received, in order (real objects of the double's classes).
        self.llm_kwargs: list[dict[str, Any]] = []
        self.submit_options: list[dict[str, Any]] = []
        """Per `LLM.generate_async` call: the `cache_salt` it got and, on 1.4, `priority`
        and `trace_headers`."""
        self.sampling_params: list[Any] = []
        self.requests: list[Any] = []
        self.executor_configs: list[Any] = []
        self.engines: list[Engine] = []
        self.dead = False
        self.death_message = ""
        self._kill_listeners: list[Callable[[], None]] = []

    def new_engine(
        self,
        max_batch_size: int,
        on_stats: Callable[[IterStats], None] | None = None,
        **behaviour: Any,
    ) -> Engine:
        engine = Engine(self, max_batch_size, on_stats, **behaviour)
        self.engines.append(engine)
        return engine

    def on_kill(self, listener: Callable[[], None]) -> None:
        self._kill_listeners.append(listener)

    def fail_active(self, message: str = "CUDA error: an illegal memory access") -> None:
        """A forward-pass failure: every active request of every engine gets an error
        (the real engines answer this way and keep running)."""
        for engine in self.engines:
            engine.fail_active(message)

    def kill(self, message: str = "Executor worker died") -> None:
        """Engine death: stepping stops for good; what each API shows is in its double."""
        self.dead = True
        self.death_message = message
        for listener in self._kill_listeners:
            listener()


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a release string such as "1.2.1" or "1.4.0rc1"."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def line() -> tuple[int, int]:
    """(major, minor) of the release the installed double imitates."""
    return release(current().version)


_current: FakeGpu | None = None


def current() -> FakeGpu:
    if _current is None:
        raise RuntimeError("tensorrt_llm double used without tests.doubles.install_tensorrt_llm")
    return _current
