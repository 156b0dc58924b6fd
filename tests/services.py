"""Where the tests find RabbitMQ and Redis: explicit URLs from the environment, else
containers when a Docker engine answers, else the services running on this machine.
If none answers, the run fails with one clear line rather than skipping."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

DEFAULT_AMQP_URL = "amqp://guest:guest@localhost:5672/"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"


@dataclass(frozen=True)
class ServiceUrls:
    amqp: str
    redis: str
    source: str


def _answers(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "localhost", parts.port or default_port), 2
        ):
            return True
    except OSError:
        return False


def _docker_answers() -> bool:
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:
        return False
    with warnings.catch_warnings():
        # docker-py leaves its socket to the garbage collector when the engine is absent
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            docker.from_env(timeout=3).ping()
        except (DockerException, OSError):
            return False
        finally:
            gc.collect()
    return True


@contextlib.contextmanager
def _containers() -> Iterator[ServiceUrls]:
    with warnings.catch_warnings():
        # testcontainers 4.15 warns about its own deprecated decorators on import
        warnings.simplefilter("ignore", DeprecationWarning)
        from testcontainers.community.rabbitmq import RabbitMqContainer
        from testcontainers.community.redis import RedisContainer
    with RabbitMqContainer("rabbitmq:4.2-management") as rabbit, RedisContainer("redis:7.4") as red:
        host = rabbit.get_container_host_ip()
        amqp = f"amqp://guest:guest@{host}:{rabbit.get_exposed_port(5672)}/{quote('/', safe='')}"
        redis_url = f"redis://{red.get_container_host_ip()}:{red.get_exposed_port(6379)}/0"
        yield ServiceUrls(amqp, redis_url, "testcontainers")


@contextlib.contextmanager
def service_urls() -> Iterator[ServiceUrls]:
    amqp = os.environ.get("WORKER_TEST_AMQP_URL")
    redis_url = os.environ.get("WORKER_TEST_REDIS_URL")
    if amqp is None and redis_url is None and _docker_answers():
        with _containers() as urls:
            yield urls
        return
    urls = ServiceUrls(amqp or DEFAULT_AMQP_URL, redis_url or DEFAULT_REDIS_URL, "running services")
    missing = [
        name
        for name, url, port in (("RabbitMQ", urls.amqp, 5672), ("Redis", urls.redis, 6379))
        if not _answers(url, port)
    ]
    if missing:
        raise RuntimeError(
            f"{' and '.join(missing)} not reachable ({urls.amqp}, {urls.redis}); start them "
            "(bash .ci/run does) or set WORKER_TEST_AMQP_URL / WORKER_TEST_REDIS_URL"
        )
    yield urls
