"""`trtllm-worker gateway`: the application on uvicorn, one process, one event loop
(uvloop and httptools when installed). The port is bound before anything else, as the
worker binds its own: a port in use is one line and exit 2."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
from collections.abc import Callable

import uvicorn

from trtllm_worker.client import ServiceUnavailable
from trtllm_worker.config import Settings
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.exits import ExitCode
from trtllm_worker.gateway.app import Gateway, create_app
from trtllm_worker.gateway.keys import Caller, KeyRing

log = logging.getLogger(__name__)

READY_LINE = "gateway ready: model {model}, http://{host}:{port}/v1"


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (`ConfigError` in one line when the port is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise ConfigError(f"WORKER_GATEWAY_PORT {port} on {host}: {why}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def serve(
    settings: Settings, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
) -> int:
    """Serve until SIGTERM or SIGINT: uvicorn stops accepting, lets open answers run for
    up to `WORKER_DRAIN_TIMEOUT_S` (a streamed one cut then may be read on from
    `/v1/streams/{id}` on another replica), and the process exits 0."""
    sock: socket.socket | None = None
    try:
        sock = bind(settings.gateway_host, settings.gateway_port)
        keys = KeyRing(settings.gateway_keys_file, Caller(None, min(settings.preempt_priority, 9)))
    except ConfigError as exc:
        if sock is not None:
            sock.close()
        print(f"trtllm-worker: {exc}", file=sys.stderr, flush=True)
        return ExitCode.CONFIG
    if keys.is_open:
        log.warning(
            "WORKER_GATEWAY_KEYS_FILE is not set: the gateway is open, every request is "
            "served without a key and without a tenant"
        )
    else:
        log.info("%d API keys from %s", len(keys), settings.gateway_keys_file)
    app = create_app(settings, keys)
    config = uvicorn.Config(
        app,
        loop="none",  # the loop is the caller's (WORKER_EVENT_LOOP)
        http="httptools",
        lifespan="on",
        access_log=False,  # its lines hold query strings (a stream's api_key)
        log_config=None,  # the worker's logging setup stands
        timeout_graceful_shutdown=int(settings.drain_timeout_s) or None,
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    port = sock.getsockname()[1]
    host = settings.gateway_host

    gateway: Gateway = app.state.gateway

    async def run() -> ExitCode:
        try:
            refusal = await gateway.grants_refusal()
        except ServiceUnavailable as exc:
            log.warning("%s: /readyz answers 503 until it does", exc)
        else:
            if refusal is not None:  # a configuration error: the worker exits on it too
                print(f"trtllm-worker: {refusal}", file=sys.stderr, flush=True)
                await gateway.aclose()
                sock.close()
                return ExitCode.UNAVAILABLE
        log.info(READY_LINE.format(model=settings.served_model_name, host=host, port=port))
        await server.serve(sockets=[sock])
        return ExitCode.OK

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(run())
