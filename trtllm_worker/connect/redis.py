"""The one place a Redis client is built, for the worker, the SDK, the CLI and `check`:
URL, TLS files, timeouts and hiredis packing are settled here and nowhere else."""

from __future__ import annotations

import ssl
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from trtllm_worker.config import Settings, sentinel_addresses


class NotReplicated(RedisError):
    """Writes reached the master but not the replicas `WORKER_REDIS_MIN_REPLICAS` asks
    for: a job must not be acknowledged on them yet (a failover now would lose them).
    Retried like Redis being unreachable; the writes are idempotent."""


REDIS_UNAVAILABLE: tuple[type[Exception], ...] = (
    NotReplicated,
    RedisConnectionError,
    RedisTimeoutError,
    ClusterError,  # CLUSTERDOWN, a master down, redirections without end
    AskError,  # and MovedError: a slot moving that redis-py did not follow to its end
    TryAgainError,
    RedisClusterException,  # e.g. SlotNotCoveredError: no master known for a slot yet
)
"""Redis unreachable or being reconfigured (a failover, a resharding): retried with the
job in hand, never counted as a failed delivery."""

REDIS_FAILURES: tuple[type[Exception], ...] = (RedisError, OSError, RedisClusterException)
"""Everything a Redis call can raise that is Redis' doing, not the worker's (redis-py's
cluster errors are not all `RedisError`s)."""

CONNECT_TIMEOUT_S = 5.0
HEALTH_CHECK_S = 10
QUIET_HANDSHAKE: dict[str, Any] = {
    "driver_info": None,
    "maint_notifications_config": MaintNotificationsConfig(enabled=False),
}
"""redis-py 8.2 sends CLIENT SETINFO (its name and version) and CLIENT MAINT_NOTIFICATIONS
on every connect unless told not to. Redis 7.2 and later check them against the user's
ACL, and the least-privilege users of `trtllm-worker acl` are not granted them (Redis 7.0
knows neither, so no one rule fits 7.0 and 8.x): every connection would log a refusal in
ACL LOG. The worker's and the SDK's clients send neither; HELLO, which every user may
run, still chooses the protocol."""


class _WorkerConnection:
    """What the worker changes in redis-py's asyncio connections.

    - Packing: redis-py packs commands in Python, one argument at a time; on the hot path
      (ten arguments per token) that was the worker's largest cost. hiredis packs a whole
      command in C.
    - A connection closed under a command (redis-py 8.1: the cluster client closes every
      node's connections when it re-reads the topology, while other tasks use them; or
      the peer reset it) fails with `AttributeError`/`TypeError` from the closed writer
      or reader (redis/redis-py#4287, #3546). That is a lost connection: it is raised as
      `ConnectionError`, which every retry (redis-py's and the worker's) knows."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str) and " " in args[0]:  # e.g. "SCRIPT LOAD"
            args = (*args[0].split(), *args[1:])
        return [hiredis.pack_command(args)]

    async def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super().send_packed_command(*args, **kwargs)  # type: ignore[misc]
        except (AttributeError, TypeError) as exc:
            raise await self._lost(exc) from exc

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except (AttributeError, TypeError) as exc:
            raise await self._lost(exc) from exc

    async def _lost(self, exc: Exception) -> RedisConnectionError:
        await self.disconnect(nowait=True)  # type: ignore[attr-defined]
        return RedisConnectionError(f"the connection was closed under a command ({exc!r})")


def _worker_connection(connection_class: type[Any]) -> type[Any]:
    """The pool's connection class (plain, TLS or unix socket) with the worker's changes."""
    if issubclass(connection_class, _WorkerConnection):
        return connection_class
    return type(f"Worker{connection_class.__name__}", (_WorkerConnection, connection_class), {})


def tls_options(url: str, settings: Settings | None) -> dict[str, Any]:
    """redis-py's TLS options for `rediss://` from the CA and client-certificate
    settings (none: the system's defaults, or the URL's own `ssl_*` parameters)."""
    if settings is None or not url.startswith("rediss://"):
        return {}
    if not (settings.redis_ca_file or settings.redis_cert_file):
        return {}
    files = {
        "ssl_ca_certs": settings.redis_ca_file,
        "ssl_certfile": settings.redis_cert_file,
        "ssl_keyfile": settings.redis_key_file,
    }
    options: dict[str, Any] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    options.update({name: str(path) for name, path in files.items() if path})
    return options


def _options(
    url: str,
    settings: Settings | None,
    client_name: str,
    decode_responses: bool,
    socket_timeout_s: float,
    retry: bool,
) -> dict[str, Any]:
    """The connection options every plain or Sentinel-managed client gets."""
    options: dict[str, Any] = {
        "decode_responses": decode_responses,
        "client_name": client_name,
        **QUIET_HANDSHAKE,
        "health_check_interval": HEALTH_CHECK_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": socket_timeout_s,
        "retry_on_timeout": False,
        **tls_options(url, settings),
    }
    if not retry:
        options["retry"] = Retry(NoBackoff(), 0)
    return options


def redis_client(
    url: str,
    *,
    settings: Settings | None = None,
    client_name: str,
    decode_responses: bool = False,
    socket_timeout_s: float = 30.0,
    retry: bool = True,
) -> aioredis.Redis:
    """A client on its own pool. `retry=False` reports failures at once (callers that
    resume themselves, like the stream reader, want no hidden retries)."""
    options = _options(url, settings, client_name, decode_responses, socket_timeout_s, retry)
    pool = aioredis.ConnectionPool.from_url(url, **options)
    pool.connection_class = _worker_connection(pool.connection_class)
    return aioredis.Redis.from_pool(pool)  # the client owns (and closes) the pool


class _SentinelMaster(aioredis.Redis):
    """The master's client; closing it closes its connections to the Sentinels too."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        manager = getattr(self.connection_pool, "sentinel_manager", None)
        for client in getattr(manager, "sentinels", ()):
            await client.aclose()


class _Sentinels(Sentinel):
    """redis-py's Sentinel client, with a failed discovery said in one readable line:
    what each Sentinel answered (its error, or that it names no such master) instead of
    the clients' reprs, where a TLS or password failure was lost."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        try:
            address: tuple[str, int] = await super().discover_master(service_name)
        except MasterNotFoundError:
            reasons = []
            for client in self.sentinels:
                kwargs = client.connection_pool.connection_kwargs
                where = f"{kwargs.get('host')}:{kwargs.get('port')}"
                try:
                    masters = await client.sentinel_masters()
                except (RedisError, OSError) as exc:
                    reasons.append(f"{where}: {' '.join(str(exc).split()) or type(exc).__name__}")
                else:
                    state = "names it down" if service_name in masters else "knows no such master"
                    reasons.append(f"{where} {state}")
            raise MasterNotFoundError(
                f"no Sentinel named a master {service_name!r} ({'; '.join(reasons)})"
            ) from None
        return address


def sentinel_master(
    url: str,
    settings: Settings,
    *,
    client_name: str,
    decode_responses: bool = False,
    socket_timeout_s: float = 30.0,
    retry: bool = True,
) -> aioredis.Redis:
    """A client of the master Sentinel names for `WORKER_REDIS_SENTINEL_MASTER`. Every
    new connection asks the Sentinels (the first that answers) where the master is; a
    connection to a demoted master (READONLY) is dropped and reconnects to the new one.
    `url` gives the scheme (`rediss://`: TLS to the master and the Sentinels), the user,
    password and database; its host and port are not used."""
    assert settings.redis_sentinels is not None
    target = parse_url(url)
    tls = url.startswith("rediss://")
    tls_files = tls_options(url, settings)
    options = _options(url, settings, client_name, decode_responses, socket_timeout_s, retry)
    options |= {
        "username": target.get("username"),
        "password": target.get("password"),
        "db": target.get("db", 0),
        "connection_class": _worker_connection(
            SentinelManagedSSLConnection if tls else SentinelManagedConnection
        ),
    }
    sentinel_options: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": CONNECT_TIMEOUT_S,
        **QUIET_HANDSHAKE,
        "password": settings.redis_sentinel_password,
        **({"ssl": True, **tls_files} if tls else {}),
    }
    sentinel = _Sentinels(
        sentinel_addresses(settings.redis_sentinels), sentinel_kwargs=sentinel_options
    )
    master: aioredis.Redis = sentinel.master_for(
        settings.redis_sentinel_master, redis_class=_SentinelMaster, **options
    )
    return master


AnyRedis = aioredis.Redis | RedisCluster
"""A single node (or Sentinel's master) or a Redis Cluster: the calls the worker makes
are the same on both; only batching differs (`StreamStore`)."""


async def connect_redis(
    url: str,
    *,
    settings: Settings | None = None,
    client_name: str,
    decode_responses: bool = False,
    socket_timeout_s: float = 30.0,
    retry: bool = True,
) -> AnyRedis:
    """Connect and find out what `url` names: a node of a Redis Cluster (`INFO cluster`
    says `cluster_enabled:1`) gets redis-py's cluster client, which follows MOVED and
    ASK; anything else the plain client. With `WORKER_REDIS_SENTINELS` set, the master
    the Sentinels name. Raises the connection error when Redis does not answer."""
    if settings is not None and settings.redis_sentinels:
        master = sentinel_master(
            url,
            settings,
            client_name=client_name,
            decode_responses=decode_responses,
            socket_timeout_s=socket_timeout_s,
            retry=retry,
        )
        try:
            await master.ping()
        except BaseException:
            await master.aclose()
            raise
        return master
    plain = redis_client(
        url,
        settings=settings,
        client_name=client_name,
        decode_responses=decode_responses,
        socket_timeout_s=socket_timeout_s,
        retry=retry,
    )
    try:
        info = await plain.info("cluster")
    except BaseException:
        await plain.aclose()
        raise
    if not (isinstance(info, dict) and str(info.get("cluster_enabled", "0")) == "1"):
        return plain
    await plain.aclose()
    options: dict[str, Any] = {
        "decode_responses": decode_responses,
        "client_name": client_name,
        **QUIET_HANDSHAKE,
        "health_check_interval": HEALTH_CHECK_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": socket_timeout_s,
        **tls_options(url, settings),
    }
    cluster = RedisCluster.from_url(url, **options)
    _use_worker_connections(cluster)
    await cluster.initialize()
    return cluster


def _use_worker_connections(cluster: RedisCluster) -> None:
    """redis-py's cluster client takes no connection class: every node it creates gets
    the manager's connection options, so the class is set there (and on the nodes it
    starts from)."""
    manager = cluster.nodes_manager
    connection_class = _worker_connection(manager.connection_kwargs["connection_class"])
    manager.connection_kwargs["connection_class"] = connection_class
    for node in manager.startup_nodes.values():
        node.connection_class = connection_class


async def redis_version(client: AnyRedis) -> str:
    """The server's version, for start-up logs and `check`."""
    info = await client.info("server")
    version = info.get("redis_version", b"") if isinstance(info, dict) else b""
    return version.decode() if isinstance(version, bytes) else str(version)
