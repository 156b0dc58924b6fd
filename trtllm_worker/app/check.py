"""`trtllm-worker check`: whether a worker with these settings would start and run:
the broker and its queues, Redis, the tokenizer, the engine settings and the files the
settings name; one line each, `ok ...` or `problem ...`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trtllm_worker.config import Settings, redact_url
from trtllm_worker.connect.amqp import BrokerUnavailable, amqp_reply, connect
from trtllm_worker.connect.grants import redis_refusal
from trtllm_worker.connect.redis import connect_redis, redis_version
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.queues import cancel_queue_name, job_queue_arguments
from trtllm_worker.streams.store import StreamStore

if TYPE_CHECKING:
    from aio_pika.abc import AbstractConnection

    from trtllm_worker.tokenizer import TokenizerInfo

CHECK_NAME = "trtllm-worker-check"


class Report:
    """The lines of `check`: `ok <what>` or `problem <what>`, printed as they come."""

    def __init__(self) -> None:
        self.problems = 0

    def ok(self, text: str) -> None:
        print(f"ok {text}", flush=True)

    def problem(self, text: str) -> None:
        self.problems += 1
        print(f"problem {' '.join(text.split())}", flush=True)


async def check(settings: Settings) -> int:
    """Check what a worker with these settings needs; one line each. Returns the number
    of problems found."""
    report = Report()
    await _check_broker(settings, report)
    await _check_redis(settings, report)
    tokenizer = _check_tokenizer(settings, report)
    _check_guided_decoding(settings, report)
    _check_engine(settings, tokenizer, report)
    _check_adapters(settings, report)
    _check_files(settings, report)
    return report.problems


async def _check_broker(settings: Settings, report: Report) -> None:
    try:
        connection = await connect(settings.amqp_url, settings=settings, name=CHECK_NAME)
    except BrokerUnavailable as exc:
        report.problem(f"RabbitMQ: {exc}")
        return
    async with connection:
        underlay = getattr(connection.transport, "connection", None)
        version = (getattr(underlay, "server_properties", None) or {}).get("version", "?")
        report.ok(f"RabbitMQ {version} at {redact_url(settings.amqp_url)}")
        await _check_queue(connection, settings, settings.queue, "queue", report)
        await _check_queue(connection, settings, settings.dead_queue, "dead-letter queue", report)
        await _check_cancel_exchange(connection, settings, report)
        await _check_cancel_queue(connection, settings, report)


async def _check_queue(
    connection: AbstractConnection, settings: Settings, name: str, label: str, report: Report
) -> None:
    """If the queue exists, the worker's own declaration of it must succeed."""
    import aio_pika
    import aiormq

    from trtllm_worker.broker.consumer import queue_mismatch

    what = f"{label} {name!r}"
    try:
        async with connection.channel() as channel:
            try:
                declared = await channel.declare_queue(name, passive=True)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                report.ok(f"{what}: not declared yet (a worker declares it)")
                return
        result = declared.declaration_result
        async with connection.channel() as channel:
            arguments: dict[str, str | int] = (
                job_queue_arguments(settings.queue_type)
                if name == settings.queue
                else {"x-queue-type": settings.queue_type}
            )
            await channel.declare_queue(name, durable=True, arguments={**arguments})
        report.ok(
            f"{what}: {settings.queue_type}, {result.message_count} messages, "
            f"{result.consumer_count} consumers"
        )
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        reply = amqp_reply(exc)
        if "x-max-priority" in reply:
            report.problem(queue_mismatch(settings, reply))
        else:
            report.problem(
                f"{what} exists with other arguments than the worker declares (durable, "
                f"x-queue-type {settings.queue_type} from WORKER_QUEUE_TYPE): {reply}"
            )
    except (aiormq.exceptions.AMQPError, OSError) as exc:
        report.problem(f"{what}: {amqp_reply(exc)}")


async def _check_cancel_exchange(
    connection: AbstractConnection, settings: Settings, report: Report
) -> None:
    import aio_pika
    import aiormq

    what = f"cancel exchange {settings.cancel_exchange!r}"
    try:
        async with connection.channel() as channel:
            try:
                await channel.declare_exchange(settings.cancel_exchange, passive=True)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                report.ok(f"{what}: not declared yet (a worker declares it)")
                return
        async with connection.channel() as channel:
            await channel.declare_exchange(
                settings.cancel_exchange, aio_pika.ExchangeType.FANOUT, durable=True
            )
        report.ok(f"{what}: fanout")
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        report.problem(f"{what} is not a durable fanout exchange: {amqp_reply(exc)}")
    except (aiormq.exceptions.AMQPError, OSError) as exc:
        report.problem(f"{what}: {amqp_reply(exc)}")


async def _check_redis(settings: Settings, report: Report) -> None:
    from redis.exceptions import RedisError

    where = redact_url(settings.redis_url)
    if settings.redis_sentinels:
        where = (
            f"the master {settings.redis_sentinel_master!r} of Sentinels {settings.redis_sentinels}"
        )
    try:
        client = await connect_redis(
            settings.redis_url, settings=settings, client_name=CHECK_NAME, retry=False
        )
    except (RedisError, OSError) as exc:
        report.problem(f"Redis: cannot connect to Redis at {where}: {' '.join(str(exc).split())}")
        return
    if settings.redis_sentinels:
        pool = getattr(client, "connection_pool", None)
        address = getattr(pool, "master_address", None)
        if address:
            where += f", now at {address[0]}:{address[1]}"
    store = StreamStore(client, ttl_s=settings.stream_ttl_s)
    try:
        await store.ping()
        version = await redis_version(store.client)
        refused = await store.refused_commands(settings.stream_prefix)
    except (RedisError, OSError) as exc:
        report.problem(f"Redis: cannot connect to Redis at {where}: {' '.join(str(exc).split())}")
        return
    finally:
        await store.close()
    if refused:
        report.problem(f"Redis: {redis_refusal(settings, refused)}")
    if store.cluster:
        where += " (Redis Cluster)"
    major = int(version.split(".")[0]) if version.split(".")[0].isdigit() else 0
    if major and major < 5:
        report.problem(f"Redis {version} at {where}: streams need Redis 5 or later")
    else:
        report.ok(f"Redis {version} at {where}")


async def _check_cancel_queue(
    connection: AbstractConnection, settings: Settings, report: Report
) -> None:
    """The worker's own cancel queue, as it declares and binds it: exclusive, so it is
    gone with this check's connection (and deleted at once)."""
    import aio_pika
    import aiormq

    what = "cancel queue"
    try:
        async with connection.channel() as channel:
            queue = await channel.declare_queue(
                cancel_queue_name(settings.cancel_exchange), exclusive=True, auto_delete=True
            )
            try:
                await queue.bind(settings.cancel_exchange)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                report.ok(f"{what}: may be declared (the cancel exchange is not declared yet)")
                return
            await queue.delete(if_unused=False, if_empty=False)
        report.ok(f"{what} {settings.cancel_exchange}.<id>: may be declared and bound")
    except (aiormq.exceptions.AMQPError, OSError) as exc:
        report.problem(f"{what}: {amqp_reply(exc)}")


def _check_tokenizer(settings: Settings, report: Report) -> TokenizerInfo | None:
    from trtllm_worker.pipeline.chat import check_template
    from trtllm_worker.tokenizer import tokenizer_for

    try:
        tokenizer = tokenizer_for(settings)
    except ConfigError as exc:
        report.problem(f"tokenizer: {exc}")
        return None
    eos = ", ".join(str(i) for i in sorted(tokenizer.eos_ids)) or "none"
    report.ok(f"tokenizer {tokenizer.source}: vocabulary {tokenizer.vocab_size}, EOS ids {eos}")
    if tokenizer.chat_template is None:
        report.ok("chat template: none (jobs with messages are refused)")
    else:
        try:
            check_template(tokenizer.chat_template, str(tokenizer.chat_template_source))
        except ConfigError as exc:
            report.problem(str(exc))
        else:
            report.ok(f"chat template from {tokenizer.chat_template_source}")
    return tokenizer


def _check_guided_decoding(settings: Settings, report: Report) -> None:
    from trtllm_worker.pipeline.grammar import compiler_name

    backend = settings.guided_decoding
    if backend == "none":
        report.ok("guided decoding: none (jobs with a grammar are refused)")
        return
    compiler = compiler_name(backend)
    if compiler == "none":
        report.problem(f"guided decoding {backend}: neither xgrammar nor llguidance imports")
    else:
        report.ok(f"guided decoding {backend}: grammars checked with {compiler}")


def _check_engine(settings: Settings, tokenizer: TokenizerInfo | None, report: Report) -> None:
    from trtllm_worker.engine import engine_factory
    from trtllm_worker.tokenizer import load_tokenizer

    if settings.engine == "echo":
        report.ok(f"engine echo: CPU, no model, {settings.max_batch} requests at once")
        return
    if settings.engine == "trtllm" and settings.model is not None:
        if not settings.model.is_dir():
            report.problem(f"WORKER_MODEL: {settings.model} is not a folder")
        elif not (settings.model / "config.json").is_file():
            report.problem(f"WORKER_MODEL: {settings.model} holds no config.json")
    if settings.engine == "trtllm-executor" and settings.engine_dir is not None:
        if not settings.engine_dir.is_dir():
            report.problem(f"WORKER_ENGINE_DIR: {settings.engine_dir} is not a folder")
        elif not (settings.engine_dir / "config.json").is_file():
            report.problem(f"WORKER_ENGINE_DIR: {settings.engine_dir} holds no config.json")
    try:
        engine_factory(settings, tokenizer or load_tokenizer(None, None))
    except ConfigError as exc:
        report.problem(str(exc))
        return
    import tensorrt_llm

    version = getattr(tensorrt_llm, "__version__", "?")
    report.ok(f"engine {settings.engine}: tensorrt_llm {version} imports")


def _check_adapters(settings: Settings, report: Report) -> None:
    """The LoRA adapters the worker would load, or why one folder would stop it."""
    from trtllm_worker.engine.lora import discover_adapters

    if settings.lora_dir is None:
        return
    try:
        adapters = discover_adapters(settings.lora_dir)
    except ConfigError as exc:
        report.problem(str(exc))
        return
    report.ok(f"LoRA adapters in {settings.lora_dir}: {adapters.describe()}")


def _check_files(settings: Settings, report: Report) -> None:
    """Every other file a setting names must exist."""
    names = (
        "llm_extra_options",
        "executor_worker_path",
        "amqp_ca_file",
        "amqp_cert_file",
        "amqp_key_file",
        "redis_ca_file",
        "redis_cert_file",
        "redis_key_file",
    )
    for name in names:
        path = getattr(settings, name)
        if isinstance(path, Path) and not path.exists():
            report.problem(f"WORKER_{name.upper()}: {path} does not exist")
