"""The composition root: builds everything from `Settings` and owns the order of
start (HTTP port → tokenizer → engine → loop thread → Redis → broker → ready) and of stop
(not ready → stop consuming → drain → hand back → close)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable

from prometheus_client import disable_created_metrics

from trtllm_worker.broker.cancel import CancelListener
from trtllm_worker.broker.consumer import Consumer
from trtllm_worker.config import Settings, redact_url
from trtllm_worker.connect.grants import redis_refusal
from trtllm_worker.connect.redis import REDIS_FAILURES, connect_redis
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.exits import ExitCode, Unavailable
from trtllm_worker.contract.priority import MAX_PRIORITY
from trtllm_worker.engine import engine_factory, start_engine
from trtllm_worker.engine.looper import Looper
from trtllm_worker.engine.lora import discover_adapters
from trtllm_worker.engine.stats import EngineStatsCollector
from trtllm_worker.ops.http import ProbeServer
from trtllm_worker.ops.metrics import Metrics
from trtllm_worker.ops.supervise import Supervisor
from trtllm_worker.ops.tracing import Tracing, start_tracing
from trtllm_worker.pipeline.chat import check_template
from trtllm_worker.pipeline.detokenize import piece_table
from trtllm_worker.pipeline.intake import Intake
from trtllm_worker.pipeline.leases import Leases
from trtllm_worker.pipeline.pump import Inbox, OutputPump
from trtllm_worker.pipeline.runner import JobRunner
from trtllm_worker.streams.store import StreamStore
from trtllm_worker.tokenizer import tokenizer_for

log = logging.getLogger(__name__)

HEARTBEAT_STALE_S = 30.0


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """WORKER_EVENT_LOOP: uvloop's loop when chosen or, with `auto`, when installed (it
    costs the worker less CPU per job and per token); None: asyncio's own."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(
                "invalid setting WORKER_EVENT_LOOP: uvloop is not installed"
                " (pip install 'trtllm-worker[uvloop]', or choose auto or asyncio)"
            ) from None
        return None
    return uvloop.new_event_loop


def event_loop_name() -> str:
    """`uvloop` or `asyncio`: the running loop, for the startup line."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


def model_name(settings: Settings) -> str:
    """What traces call the model (`gen_ai.request.model`): the checkpoint's or engine's
    folder name, else the engine's."""
    path = settings.model or settings.engine_dir
    return path.name if path is not None and path.name else settings.engine


REDIS_CHECK_S = 2.0


def prefetch_for(capacity: int, preempt_priority: int) -> int:
    """The broker hands a worker one job more than the engine has slots while pausing is
    on: the lookout through which an interactive job reaches a full worker
    (`pipeline.slots`)."""
    return capacity + 1 if preempt_priority <= MAX_PRIORITY else capacity


class Service:
    """One worker: use `async with Service(settings) as service:`; leaving the block
    drains and closes."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.metrics = Metrics()
        self.draining = False
        self.redis_up = False
        self._stopped = asyncio.Event()
        self.supervisor = Supervisor(self._on_task_death)
        self._looper: Looper | None = None
        self._runner: JobRunner | None = None
        self._pump: OutputPump | None = None
        self._consumer: Consumer | None = None
        self._store: StreamStore | None = None
        self._http: ProbeServer | None = None
        self._tracing: Tracing | None = None

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        settings = self.settings
        if self._http is None:
            await self._listen()
        self._tracing = await start_tracing(os.environ, instance_id=self.worker_id)
        if self._tracing is not None:
            log.info("traces: %s", self._tracing.description)
        tokenizer = tokenizer_for(settings)
        log.info(
            "tokenizer: %s, vocabulary %d, EOS ids %s",
            tokenizer.source,
            tokenizer.vocab_size,
            sorted(tokenizer.eos_ids) or "none",
        )
        if tokenizer.chat_template is not None:
            check_template(tokenizer.chat_template, str(tokenizer.chat_template_source))
            log.info("chat template from %s", tokenizer.chat_template_source)
        adapters = discover_adapters(settings.lora_dir)
        if settings.lora_dir is not None:
            log.info("LoRA adapters in %s: %s", settings.lora_dir, adapters.describe())
        factory = engine_factory(settings, tokenizer, adapters)
        log.info("starting the %s engine", settings.engine)
        engine = await start_engine(factory, settings.engine_start_timeout_s)
        self.metrics.capacity.set(engine.capacity)
        try:
            client = await connect_redis(
                settings.redis_url, settings=settings, client_name="trtllm-worker"
            )
        except REDIS_FAILURES as exc:
            raise Unavailable(
                f"cannot connect to Redis at {redact_url(settings.redis_url)}: {exc}"
            ) from None
        self._store = store = StreamStore(
            client,
            ttl_s=settings.stream_ttl_s,
            lease_ttl_s=settings.lease_ttl_s,
            min_replicas=settings.redis_min_replicas,
            compact_after_s=settings.stream_compact_after_s,
            prefix=settings.stream_prefix,
            usage_ttl_s=settings.usage_ttl_s,
            model_name=settings.served_model_name,
        )
        if store.cluster:
            log.info("Redis Cluster at %s", redact_url(settings.redis_url))
        leases = Leases(store, ttl_s=settings.lease_ttl_s)
        # engine thread --> the inbox: one batch of outputs per wake-up
        inbox = Inbox()
        self._looper = looper = Looper(
            engine,
            asyncio.get_running_loop(),
            inbox.put,
            self._on_engine_death,
            stats_interval_s=settings.engine_stats_interval_s,
            stall_timeout_s=settings.engine_stall_timeout_s,
        )
        self.metrics.registry.register(EngineStatsCollector(lambda: looper.stats))
        # the inbox --> stream entries, stored in one fenced call per batch
        self._pump = pump = OutputPump(settings, store, leases, self.metrics, looper, inbox)
        # Job --> EngineRequest
        intake = Intake(settings, tokenizer, engine.limits, adapters)
        piece_table(tokenizer.tokenizer)  # built now, not while the first job waits
        # one job: lease, intake, resume, submit to the looper, wait for the pump
        self._runner = runner = JobRunner(
            settings, intake, store, leases, pump, looper, self.metrics, engine.capacity
        )
        looper.start()
        self.supervisor.start("pump", pump.run())
        self.supervisor.start("leases", runner.keep_leases())
        try:
            await store.ping()
            refused = await store.refused_commands(settings.stream_prefix)
        except REDIS_FAILURES as exc:
            raise Unavailable(
                f"cannot connect to Redis at {redact_url(settings.redis_url)}: {exc}"
            ) from None
        if refused:
            raise Unavailable(redis_refusal(settings, refused))
        self.redis_up = True
        self.supervisor.start("redis-watch", self._watch_redis())
        cancels = CancelListener(settings, store, runner.cancel)
        self.supervisor.start("cancels", cancels.run())
        self._consumer = Consumer(
            settings,
            intake,
            runner.run,
            cancels,
            store,
            self.metrics,
            on_connection_lost=runner.hand_back_all,
            prefetch=prefetch_for(engine.capacity, settings.preempt_priority),
            name=f"trtllm-worker {self.worker_id}",
            tracing=self._tracing,
            model_name=model_name(settings),
        )
        consumer = self._consumer
        self.metrics.broker_connected.set_function(lambda: float(consumer.connected))
        self.metrics.redis_connected.set_function(lambda: float(self.redis_up))
        await self._consumer.start()
        # where the broker ignores priorities, giving jobs back cannot bring one forward
        runner.slots.lookout = consumer.orders_priorities
        log.info(
            "ready: engine %s, HTTP on port %d, event loop %s",
            settings.engine,
            self.http_port,
            event_loop_name(),
        )

    async def _listen(self) -> None:
        """Bind the HTTP port first of all: a port that is taken (or a host that is not
        ours) stops the worker with one line before it loads an engine or takes a job.
        Until the worker is ready, `/healthz` and `/readyz` answer 503."""
        settings = self.settings
        self._http = ProbeServer(
            host=settings.http_host,
            port=settings.http_port,
            alive=self.alive,
            ready=self.ready,
            registry=self.metrics.registry,
        )
        try:
            await self._http.start()
        except OSError as exc:
            self._http = None
            raise ConfigError(
                f"invalid setting WORKER_HTTP_PORT: cannot listen on "
                f"{settings.http_host}:{settings.http_port}: "
                f"{os.strerror(exc.errno).lower() if exc.errno else exc}"
            ) from None

    async def stop(self) -> None:
        """Drain: stop taking jobs, let running ones finish for up to the drain timeout,
        hand the rest back, close everything."""
        self.draining = True
        self._stopped.set()
        consumer = self._consumer
        if consumer is not None:
            await consumer.stop_consuming()
            finished = await consumer.wait_jobs(self.settings.drain_timeout_s)
            if not finished and self._runner is not None:
                self._runner.stop_taking()
                count = self._runner.hand_back_all("the worker is stopping")
                log.info("drain timeout: %d running jobs handed back", count)
                await consumer.wait_jobs(5.0)
            await consumer.close()
        await self.supervisor.stop()
        if self._pump is not None:
            await self._pump.wait_background()
        if self._looper is not None:
            await asyncio.to_thread(self._looper.stop)
        if self._store is not None:
            await self._store.close()
        if self._http is not None:
            await self._http.close()
        if self._tracing is not None:
            await self._tracing.close()
        log.info("stopped")

    async def __aenter__(self) -> Service:
        await self._listen()  # nothing to undo yet when the port cannot be bound
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def request_stop(self) -> None:
        self._stopped.set()

    # -- health -----------------------------------------------------------------------

    @property
    def http_port(self) -> int:
        assert self._http is not None
        return self._http.port

    @property
    def engine_failed(self) -> bool:
        return self._runner is not None and self._runner.engine_error is not None

    def alive(self) -> bool:
        looper = self._looper
        if looper is None or not looper.alive:
            return False
        if time.monotonic() - looper.heartbeat > HEARTBEAT_STALE_S:
            return False
        return self.supervisor.healthy

    def ready(self) -> bool:
        ok = (
            not self.draining
            and self.alive()
            and not self.engine_failed
            and self.redis_up
            and self._runner is not None
            and self._runner.redis_healthy
            and self._consumer is not None
            and self._consumer.connected
        )
        self.metrics.ready.set(1 if ok else 0)
        return ok

    @property
    def exit_code(self) -> ExitCode:
        if self.engine_failed:
            return ExitCode.ENGINE_DIED
        return ExitCode.TASK_DIED if self.supervisor.dead is not None else ExitCode.OK

    def _on_task_death(self, name: str, exc: BaseException | None) -> None:
        log.error("stopping: the %s task is dead", name)
        self._stopped.set()

    def _on_engine_death(self, exc: BaseException) -> None:
        log.error("the engine died (%s): handing running jobs back and stopping", exc)
        self.supervisor.start("engine-death", self._after_engine_death(exc), forever=False)

    async def _after_engine_death(self, exc: BaseException) -> None:
        """Stop consuming first, so the jobs handed back go to other workers instead of
        coming straight back here (each return counts as a delivery)."""
        if self._runner is not None:
            self._runner.engine_error = exc
        if self._consumer is not None:
            await self._consumer.stop_consuming()
        if self._runner is not None:
            self._runner.on_engine_death(exc)
        self._stopped.set()

    async def _watch_redis(self) -> None:
        """Ping Redis; while it does not answer, take no new jobs (readiness is 503)."""
        assert self._store is not None
        while True:
            await asyncio.sleep(REDIS_CHECK_S)
            try:
                up = await self._store.ping()
            except REDIS_FAILURES:
                up = False
            if up != self.redis_up and self._consumer is not None and not self.draining:
                await (self._consumer.resume() if up else self._consumer.pause())
            self.redis_up = up


GIL_SWITCH_INTERVAL_S = 0.0005
"""The event loop gives the GIL up for every socket call; with the engine's threads busy,
Python's default 5 ms switch interval can keep it waiting that long to get it back."""


async def serve(settings: Settings) -> ExitCode:
    """Run a worker until SIGTERM/SIGINT (OK after draining), engine death (ENGINE_DIED)
    or the death of a background task (TASK_DIED)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # `_created` series double every family for no use to an operator; set here, in the
    # worker's own process, never on import (the SDK lives in other applications)
    disable_created_metrics()  # type: ignore[no-untyped-call]
    loop = asyncio.get_running_loop()
    async with Service(settings) as service:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, service.request_stop)
        await service.wait_stopped()
        log.info("stopping: draining for up to %.0fs", settings.drain_timeout_s)
        code = service.exit_code
    return code
