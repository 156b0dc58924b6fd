"""The engine loop thread: the only thread that touches the engine.

Threading rule: the engine lives on this thread; request state, detokenizers and all
I/O live on the event loop. They meet at one thread-safe queue in (`submit`, `cancel`)
and one `call_soon_threadsafe` per wake-up out. Idle, the thread blocks on its command
queue; busy, it blocks in `engine.wait(timeout)`. It never spins."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from trtllm_worker.engine.base import Engine, EngineOutput, EngineRequest, EngineStats

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 1.0
"""How long the idle thread sleeps between heartbeats."""

BUSY_TIMEOUT_S = 0.05
"""The longest `engine.wait`: bounds how late a command is seen when an engine cannot be
woken (the echo engine can; TensorRT-LLM's Executor cannot)."""

MAX_UNCONSUMED_BATCHES = 2
"""Batches handed to the event loop and not yet taken before the thread stops asking
the engine for more: the engine keeps its outputs meanwhile and hands them over in one
bigger batch, so the event loop is never more than a couple of batches behind."""


class EngineStalled(RuntimeError):
    """Requests are in flight and the engine has said nothing for too long."""


@dataclass(slots=True)
class _Submit:  # not frozen: a frozen dataclass costs a setattr call per field, per job
    request: EngineRequest


@dataclass(slots=True)
class _Cancel:
    engine_id: int


class _Stop:
    pass


_Command = _Submit | _Cancel | _Stop

OutputSink = Callable[[list[EngineOutput], float], None]
"""Receives one batch of outputs and when the engine thread had it (`time.monotonic()`)."""
DeathSink = Callable[[BaseException], None]


class Looper:
    """Owns the engine on a dedicated thread."""

    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: OutputSink,
        on_death: DeathSink,
        stats_interval_s: float = 5.0,
        stall_timeout_s: float = 300.0,
    ) -> None:
        self._engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_death = on_death
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._in_flight: set[int] = set()
        self._unconsumed = threading.BoundedSemaphore(MAX_UNCONSUMED_BATCHES)
        self._stopping = threading.Event()
        self._in_engine_wait = False
        self._thread = threading.Thread(target=self._run, name="engine-looper", daemon=True)
        self.heartbeat = time.monotonic()
        self.error: BaseException | None = None
        self.stats = EngineStats()
        self._stats_interval_s = stats_interval_s
        self._stats_due = 0.0
        self._stall_timeout_s = stall_timeout_s
        self._progress_at = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    # -- called from the event loop -------------------------------------------------

    def submit(self, request: EngineRequest) -> None:
        self._commands.put(_Submit(request))
        self._wake_engine()

    def cancel(self, engine_id: int) -> None:
        self._commands.put(_Cancel(engine_id))
        self._wake_engine()

    def _wake_engine(self) -> None:
        """Interrupt `engine.wait` only when the thread is in it: idle, the thread blocks
        on the command queue, which the put above wakes (a wake per job cost more than
        the job's own work when jobs are short)."""
        if self._in_engine_wait:
            self._engine.wake()

    def consumed(self, batches: int) -> None:
        """The event loop took `batches` batches: the thread may deliver more."""
        for _ in range(batches):
            self._unconsumed.release()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread, then shut the engine down (on the thread, which owns it)."""
        self._stopping.set()
        self._commands.put(_Stop())
        self._engine.wake()
        self._thread.join(timeout)

    # -- the thread -----------------------------------------------------------------

    def _run(self) -> None:
        _name_os_thread(self._thread.name)
        try:
            while self._drain_commands():
                if self._in_flight:
                    self._in_engine_wait = True
                    outputs = self._engine.wait(BUSY_TIMEOUT_S)
                    self._in_engine_wait = False
                    self._deliver(outputs)
                self.heartbeat = now = time.monotonic()
                if self._in_flight and now - self._progress_at > self._stall_timeout_s:
                    # TensorRT-LLM 1.2 leaves results pending forever when its worker
                    # process dies (NVIDIA/TensorRT-LLM#10663): treat silence as death.
                    raise EngineStalled(
                        f"no output for {self._stall_timeout_s:.0f}s with "
                        f"{len(self._in_flight)} requests in flight"
                    )
                if now >= self._stats_due:
                    self._stats_due = now + self._stats_interval_s
                    self._sample_stats()
        except BaseException as exc:
            self.error = exc
            log.exception("engine loop died")
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                self._loop.call_soon_threadsafe(self._on_death, exc)
            return
        finally:
            self._shutdown_engine()

    def _drain_commands(self) -> bool:
        """Apply every queued command; block for the first one while idle. False on stop."""
        block = not self._in_flight
        while True:
            try:
                command = self._commands.get(block=block, timeout=IDLE_TIMEOUT_S if block else None)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, _Submit):
                if not self._in_flight:
                    self._progress_at = time.monotonic()
                self._engine.enqueue(command.request)
                self._in_flight.add(command.request.id)
            elif isinstance(command, _Cancel):
                if command.engine_id in self._in_flight:
                    self._engine.cancel(command.engine_id)
            else:
                return False

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        if not outputs:
            return
        self._progress_at = time.monotonic()
        in_flight = self._in_flight
        for output in outputs:  # `final`, inline: this loop runs once per token
            if output.finish is not None or output.error is not None:
                in_flight.discard(output.id)
        while not self._unconsumed.acquire(timeout=IDLE_TIMEOUT_S):
            self.heartbeat = time.monotonic()
            if self._stopping.is_set():  # nobody will consume it: drop it and stop
                return
        self._loop.call_soon_threadsafe(self._on_outputs, outputs, self._progress_at)

    def _sample_stats(self) -> None:
        """Engine statistics for /metrics (`stats` returns at once: an engine that must
        fetch them does it off this thread). With nothing in flight the engine is idle
        whatever its last report said: an idle engine reports no iterations at all."""
        try:
            stats = self._engine.stats()
        except Exception as exc:  # statistics are optional: never let them stop the engine
            log.warning("reading engine statistics failed: %s", exc)
            return
        if not self._in_flight:
            stats = replace(stats, active_requests=0, queued_requests=0)
        self.stats = stats

    def _shutdown_engine(self) -> None:
        try:
            self._engine.shutdown()
        except Exception:
            log.exception("engine shutdown failed")


def _name_os_thread(name: str) -> None:
    """Give the OS thread the Python thread's name, so that `top -H` and /proc show
    where the worker's CPU goes (Linux; a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
