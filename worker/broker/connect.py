"""The one place an AMQP connection is made, for the worker, the SDK and `check`: the
URL, TLS and the client properties the broker shows operators."""

from __future__ import annotations

import ssl

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection, AbstractRobustConnection

from worker.config import Settings, redact_url

CONNECT_TIMEOUT_S = 5.0


def amqp_ssl_context(settings: Settings | None) -> ssl.SSLContext | None:
    """TLS for `amqps://` from the CA and client-certificate settings (None: aio-pika's
    defaults, or the URL's own `cafile`/`certfile`/`keyfile` query parameters)."""
    if settings is None or not settings.amqp_url.startswith("amqps://"):
        return None
    if not (settings.amqp_ca_file or settings.amqp_cert_file):
        return None
    context = ssl.create_default_context(
        cafile=str(settings.amqp_ca_file) if settings.amqp_ca_file else None
    )
    if settings.amqp_cert_file:
        context.load_cert_chain(
            str(settings.amqp_cert_file),
            str(settings.amqp_key_file) if settings.amqp_key_file else None,
        )
    return context


def reason(exc: BaseException) -> str:
    """An exception as one line for a user."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


async def connect_robust(settings: Settings, name: str) -> AbstractRobustConnection:
    """The worker's connection: it reconnects by itself and restores its channels,
    queues and consumers. `ConnectionError` with one line when the broker does not answer
    at start."""
    try:
        return await aio_pika.connect_robust(
            settings.amqp_url,
            client_properties={"connection_name": name},
            ssl_context=amqp_ssl_context(settings),
        )
    except (OSError, aiormq.exceptions.AMQPError) as exc:
        raise ConnectionError(
            f"cannot connect to RabbitMQ at {redact_url(settings.amqp_url)}: {reason(exc)}"
        ) from None


async def connect(
    url: str, *, settings: Settings | None, name: str, timeout_s: float = CONNECT_TIMEOUT_S
) -> AbstractConnection:
    """A plain connection for a short-lived user (the SDK, `check`): failures surface at
    once as `ConnectionError` with one line, for the caller to report or retry."""
    try:
        return await aio_pika.connect(
            url,
            timeout=timeout_s,
            client_properties={"connection_name": name},
            ssl_context=amqp_ssl_context(settings),
        )
    except (OSError, TimeoutError, aiormq.exceptions.AMQPError) as exc:
        raise ConnectionError(
            f"cannot connect to RabbitMQ at {redact_url(url)}: {reason(exc)}"
        ) from None
