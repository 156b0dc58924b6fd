"""`rediss://` with a CA and a client certificate, against a private TLS redis-server
that requires client certificates; the `amqps://` TLS context from the settings."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import pytest
import redis.asyncio as aioredis

from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal
from tests.integration.test_faults import free_port, run, wait_until
from worker.broker.connect import amqp_ssl_context
from worker.config import Settings


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make test certificates")
    folder = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=trtllm-worker test CA",
    )
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            "san.ext",
        )
    return folder


@pytest.fixture
async def tls_redis(
    certificates: Path, tmp_path: Path
) -> AsyncIterator[tuple[str, aioredis.Redis]]:
    port = free_port()
    assert (
        await run(
            "redis-server",
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(certificates / "server.crt"),
            "--tls-key-file",
            str(certificates / "server.key"),
            "--tls-ca-cert-file",
            str(certificates / "ca.crt"),
            "--tls-auth-clients",
            "yes",
            "--daemonize",
            "yes",
            "--save",
            "",
            "--dir",
            str(tmp_path),
            "--logfile",
            str(tmp_path / "redis.log"),
        )
        == 0
    )
    client = aioredis.Redis(
        host="127.0.0.1",
        port=port,
        ssl=True,
        ssl_ca_certs=str(certificates / "ca.crt"),
        ssl_certfile=str(certificates / "client.crt"),
        ssl_keyfile=str(certificates / "client.key"),
        decode_responses=True,
    )

    async def answers() -> bool:
        try:
            return bool(await client.ping())
        except (OSError, aioredis.ConnectionError):
            return False

    await wait_until(answers)
    yield f"rediss://127.0.0.1:{port}/0", client
    await client.shutdown(nosave=True)
    await client.aclose()


async def test_rediss_with_ca_and_client_certificate(
    tls_redis: tuple[str, aioredis.Redis],
    certificates: Path,
    run_worker: WorkerFactory,
    producer: Producer,
    names: dict[str, str],
) -> None:
    url, client = tls_redis
    request_id = f"tls-{uuid.uuid4().hex[:8]}"
    reader = Subscriber(client, names["stream_prefix"])
    async with run_worker(
        redis_url=url,
        redis_ca_file=certificates / "ca.crt",
        redis_cert_file=certificates / "client.crt",
        redis_key_file=certificates / "client.key",
    ):
        await producer.publish(
            {"request_id": request_id, "inputs": "tls", "parameters": {"max_new_tokens": 3}}
        )
        entries = await reader.read_until_terminal(request_id)
    assert terminal(entries)["generated_text"] == "tls"


async def test_rediss_without_the_client_certificate_is_refused(
    tls_redis: tuple[str, aioredis.Redis], certificates: Path, run_worker: WorkerFactory
) -> None:
    url, _ = tls_redis
    with pytest.raises(ConnectionError, match="cannot connect to Redis"):
        async with run_worker(redis_url=url, redis_ca_file=certificates / "ca.crt"):
            pass


def test_amqps_context_from_the_settings(certificates: Path) -> None:
    settings = Settings(
        _env_file=None,
        amqp_url="amqps://user:pw@broker:5671/",
        amqp_ca_file=certificates / "ca.crt",
        amqp_cert_file=certificates / "client.crt",
        amqp_key_file=certificates / "client.key",
    )
    context = amqp_ssl_context(settings)
    assert context is not None
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert context.check_hostname
    assert any("test CA" in str(ca.get("subject")) for ca in context.get_ca_certs())
    plain = Settings(_env_file=None, amqp_url="amqp://user:pw@broker:5672/")
    assert amqp_ssl_context(plain) is None


@pytest.fixture(scope="module")
def tls_broker(certificates: Path) -> Iterator[int]:
    """A private RabbitMQ node (never the shared one) that only speaks TLS and requires
    client certificates. rabbitmq-server runs as the `rabbitmq` user: its files must be
    readable by it."""
    if shutil.which("rabbitmq-server") is None or shutil.which("rabbitmqctl") is None:
        pytest.fail("rabbitmq-server is needed for a private TLS broker")
    folder = Path(tempfile.mkdtemp(prefix="trtllm-worker-tls-broker-", dir="/tmp"))
    port, dist_port = free_port(), free_port()
    for name in ("ca.crt", "server.crt", "server.key"):
        shutil.copy(certificates / name, folder / name)
    (folder / "rabbitmq.conf").write_text(
        "listeners.tcp = none\n"
        f"listeners.ssl.default = {port}\n"
        f"ssl_options.cacertfile = {folder}/ca.crt\n"
        f"ssl_options.certfile = {folder}/server.crt\n"
        f"ssl_options.keyfile = {folder}/server.key\n"
        "ssl_options.verify = verify_peer\n"
        "ssl_options.fail_if_no_peer_cert = true\n"
    )
    (folder / "enabled_plugins").write_text("[].\n")
    for sub in ("mnesia", "log"):
        (folder / sub).mkdir()
    subprocess.run(["chown", "-R", "rabbitmq:rabbitmq", str(folder)], check=True)
    folder.chmod(0o755)
    node = f"trtllm-tls-{port}@localhost"
    env = {
        **os.environ,
        "RABBITMQ_NODENAME": node,
        "RABBITMQ_DIST_PORT": str(dist_port),
        "RABBITMQ_CONFIG_FILE": str(folder / "rabbitmq"),
        "RABBITMQ_MNESIA_BASE": str(folder / "mnesia"),
        "RABBITMQ_LOG_BASE": str(folder / "log"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(folder / "enabled_plugins"),
        "RABBITMQ_FEATURE_FLAGS_FILE": str(folder / "feature_flags"),
        "RABBITMQ_PID_FILE": str(folder / "pid"),
    }
    server = subprocess.Popen(
        ["rabbitmq-server"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline or server.poll() is not None:
                pytest.fail(f"the private TLS broker did not start (see {folder}/log)")
            time.sleep(0.2)
        yield port
    finally:
        subprocess.run(
            ["rabbitmqctl", "-n", node, "stop"],
            env=env,
            capture_output=True,
            check=False,
            timeout=60,
        )
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(30)
        if server.poll() is None:
            server.kill()
        shutil.rmtree(folder, ignore_errors=True)


async def test_amqps_with_ca_and_client_certificate(
    tls_broker: int,
    certificates: Path,
    run_worker: WorkerFactory,
    subscriber: Subscriber,
    names: dict[str, str],
) -> None:
    url = f"amqps://guest:guest@localhost:{tls_broker}/"
    tls = {
        "amqp_ca_file": certificates / "ca.crt",
        "amqp_cert_file": certificates / "client.crt",
        "amqp_key_file": certificates / "client.key",
    }
    request_id = f"amqps-{uuid.uuid4().hex[:8]}"
    async with run_worker(amqp_url=url, **tls) as service:
        settings = service.settings
        context = amqp_ssl_context(settings)
        connection = await aio_pika.connect(url, ssl_context=context)
        async with connection:
            channel = await connection.channel()
            body = {"request_id": request_id, "inputs": "tls", "parameters": {"max_new_tokens": 3}}
            await channel.default_exchange.publish(
                aio_pika.Message(json.dumps(body).encode()), routing_key=names["queue"]
            )
            entries = await subscriber.read_until_terminal(request_id)
    assert terminal(entries)["generated_text"] == "tls"


async def test_amqps_without_the_client_certificate_is_refused(
    tls_broker: int, certificates: Path, run_worker: WorkerFactory
) -> None:
    url = f"amqps://guest:guest@localhost:{tls_broker}/"
    with pytest.raises(ConnectionError, match="cannot connect to RabbitMQ"):
        async with run_worker(amqp_url=url, amqp_ca_file=certificates / "ca.crt"):
            pass
