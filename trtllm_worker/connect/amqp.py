"""The one place an AMQP connection is made, for the worker, the SDK and `check`: the
URL, TLS and the client properties the broker shows operators."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection, AbstractRobustConnection
from aio_pika.robust_connection import RobustConnection
from yarl import URL

from trtllm_worker.config import Settings, redact_url, split_urls
from trtllm_worker.contract.exits import Unavailable

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
RECONNECT_INTERVAL_S = 1.0


class BrokerUnavailable(Unavailable, ConnectionError):
    """No RabbitMQ node answered (exit 69). A `ConnectionError` too: the SDK reports it
    as `ServiceUnavailable`, `check` as a problem."""


"""Between attempts to reconnect (aio-pika's default is 5 s; a node that is down costs one)."""


def amqp_ssl_context(settings: Settings | None) -> ssl.SSLContext | None:
    """TLS for `amqps://` from the CA and client-certificate settings (None: aio-pika's
    defaults, or the URL's own `cafile`/`certfile`/`keyfile` query parameters)."""
    if settings is None or not any(u.startswith("amqps://") for u in settings.amqp_urls):
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


def amqp_reply(exc: BaseException) -> str:
    """The broker's reply text of an AMQP error (`ACCESS_REFUSED - access to queue …`),
    else the exception as one line."""
    args: tuple[object, ...] = exc.args
    if len(args) >= 2 and isinstance(args[1], str):
        return args[1]
    return reason(exc)


class ClusterConnection(RobustConnection):
    """aio-pika's robust connection (it reconnects by itself and restores channels,
    queues and consumers) over the nodes of one RabbitMQ cluster: it starts on the first
    node that answers, and when the connection to a node closes, or an attempt to connect
    fails, the next attempt goes to the next node, round the list.

    aio-pika connects to one URL only; the hooks are its connection-closed callback and
    its private per-attempt method, which is why aio-pika is pinned below 11 and the
    RabbitMQ tests (several URLs, a node going away) guard them."""

    def __init__(self, urls: list[str], **kwargs: Any) -> None:
        self._nodes = [URL(url) for url in urls]
        self._node = 0
        super().__init__(self._nodes[0], **kwargs)

    @property
    def node(self) -> URL:
        """The node connected to, or tried next."""
        return self._nodes[self._node]

    def _next_node(self) -> None:
        if len(self._nodes) == 1:
            return
        gone = self.node
        self._node = (self._node + 1) % len(self._nodes)
        self.url = self._nodes[self._node]
        log.warning(
            "RabbitMQ node %s is gone or does not answer; next attempt on %s",
            redact_url(str(gone)),
            redact_url(str(self.node)),
        )

    async def _on_connection_close(self, closing: asyncio.Future[Any]) -> None:
        # a connection that was up went away (a failed attempt is the method below's)
        if self.connected.is_set() and not (self._close_called or self.is_closed):
            self._next_node()
        await super()._on_connection_close(closing)

    async def _RobustConnection__connect_transport(self) -> None:
        try:
            await super()._RobustConnection__connect_transport()  # type: ignore[misc]
        except BaseException:
            self._next_node()
            raise


async def connect_robust(settings: Settings, name: str) -> AbstractRobustConnection:
    """The worker's connection (`ClusterConnection`). At start every node is tried once,
    in order; `BrokerUnavailable` with one line when none answers."""
    urls = settings.amqp_urls
    failures: list[str] = []
    for first, url in enumerate(urls):
        connection = ClusterConnection(
            urls[first:] + urls[:first],
            reconnect_interval=RECONNECT_INTERVAL_S,
            client_properties={"connection_name": name},
            ssl_context=amqp_ssl_context(settings),
        )
        try:
            await connection.connect()
        except (OSError, aiormq.exceptions.AMQPError) as exc:
            await connection.close()
            failures.append(f"{redact_url(url)}: {reason(exc)}")
            continue
        return connection
    raise BrokerUnavailable(f"cannot connect to RabbitMQ at {'; '.join(failures)}")


async def connect(
    url: str, *, settings: Settings | None, name: str, timeout_s: float = CONNECT_TIMEOUT_S
) -> AbstractConnection:
    """A plain connection for a short-lived user (the SDK, `check`) to the first of the
    comma-separated nodes in `url` that answers: failures surface at once as
    `BrokerUnavailable` with one line, for the caller to report or retry."""
    failures: list[str] = []
    for each in split_urls(url):
        # not `aio_pika.connect`: it leaves a failed attempt open, and its `__del__`
        # then schedules a close that a program about to end never awaits
        connection = aio_pika.Connection(
            URL(each),
            client_properties={"connection_name": name},
            ssl_context=amqp_ssl_context(settings),
        )
        try:
            await connection.connect(timeout=timeout_s)
        except (OSError, TimeoutError, aiormq.exceptions.AMQPError) as exc:
            await connection.close()
            failures.append(f"{redact_url(each)}: {reason(exc)}")
            continue
        return connection
    raise BrokerUnavailable(f"cannot connect to RabbitMQ at {'; '.join(failures)}")
