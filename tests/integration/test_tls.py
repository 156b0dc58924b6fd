"""`rediss://` with a CA and a client certificate, against a private TLS redis-server
that requires client certificates; the `amqps://` TLS context from the settings."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import pytest
import redis.asyncio as aioredis

from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal
from tests.integration.test_faults import free_port, run, wait_until
from tests.private_rabbitmq import private_rabbitmq
from trtllm_worker.config import Settings
from trtllm_worker.connect.amqp import amqp_ssl_context
from trtllm_worker.contract.exits import Unavailable

CA_CONFIG = """\
[req]
prompt = no
distinguished_name = dn
x509_extensions = ca
[dn]
CN = trtllm-worker test CA
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
"""
"""What a real CA's certificate carries. Python 3.13 verifies strictly
(VERIFY_X509_STRICT): a CA without the key-usage extension is refused."""

LEAF_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = {usage}
subjectAltName = DNS:localhost, IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""
"""A server's or client's certificate; strict verification wants its issuer's key id."""


def make_pki(folder: Path) -> None:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate,
    with the extensions a real CA issues."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    (folder / "ca.cnf").write_text(CA_CONFIG)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
            "-out", "ca.crt", "-days", "2", "-config", "ca.cnf")  # fmt: skip
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        (folder / f"{name}.ext").write_text(LEAF_EXTENSIONS.format(usage=usage))
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
                "-out", f"{name}.csr", "-subj", f"/CN={name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
                "-extfile", f"{name}.ext")  # fmt: skip


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test PKI (`make_pki`), made once per module."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make test certificates")
    folder = tmp_path_factory.mktemp("tls")
    make_pki(folder)
    return folder


def strict_context(certificates: Path) -> ssl.SSLContext:
    """A client context that verifies as Python 3.13 does by default, on any Python."""
    context = ssl.create_default_context(cafile=str(certificates / "ca.crt"))
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    context.load_cert_chain(certificates / "client.crt", certificates / "client.key")
    return context


def running(pid: int) -> bool:
    """Whether the process is there and not a zombie (a daemon's parent may never reap
    it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def stop_pid(pidfile: Path) -> None:
    """End the process whose pid a server wrote, and wait for it: a test stops what it
    started, whether or not it got as far as using it."""
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
        pid = int(pidfile.read_text().strip())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if running(pid):
            os.kill(pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def private_tls_redis(
    certificates: Path, folder: Path, *, client_ca: Path | None = None, within_s: float = 30
) -> AsyncIterator[tuple[str, aioredis.Redis]]:
    """A private redis-server that speaks only TLS and requires client certificates,
    stopped by its pid on every path (a server that never answered too)."""
    port = free_port()
    pidfile = folder / "redis.pid"
    try:
        assert (
            await run("redis-server", "--port", "0", "--tls-port", str(port),
                      "--bind", "127.0.0.1",
                      "--tls-cert-file", str(certificates / "server.crt"),
                      "--tls-key-file", str(certificates / "server.key"),
                      "--tls-ca-cert-file", str(certificates / "ca.crt"),
                      "--tls-auth-clients", "yes", "--daemonize", "yes", "--save", "",
                      "--dir", str(folder), "--pidfile", str(pidfile),
                      "--logfile", str(folder / "redis.log"))
            == 0
        )  # fmt: skip
        client = aioredis.Redis(
            host="127.0.0.1",
            port=port,
            ssl=True,
            ssl_ca_certs=str(client_ca or certificates / "ca.crt"),
            ssl_certfile=str(certificates / "client.crt"),
            ssl_keyfile=str(certificates / "client.key"),
            decode_responses=True,
        )
        try:

            async def answers() -> bool:
                try:
                    return bool(await client.ping())
                except (OSError, aioredis.ConnectionError):
                    return False

            await wait_until(answers, within_s)
            yield f"rediss://127.0.0.1:{port}/0", client
        finally:
            await client.aclose()
    finally:
        stop_pid(pidfile)


@pytest.fixture
async def tls_redis(
    certificates: Path, tmp_path: Path
) -> AsyncIterator[tuple[str, aioredis.Redis]]:
    async with private_tls_redis(certificates, tmp_path) as server:
        yield server


async def test_the_test_pki_passes_strict_verification(
    tls_redis: tuple[str, aioredis.Redis], certificates: Path
) -> None:
    """What Python 3.13 does by default (VERIFY_X509_STRICT), on this Python too: the
    CA has key usage, the server certificate its issuer's key id."""
    port = int(tls_redis[0].rsplit(":", 1)[1].split("/")[0])
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=strict_context(certificates), server_hostname="localhost"
    )
    writer.write(b"PING\r\n")
    assert await reader.readline() == b"+PONG\r\n"
    writer.close()
    await writer.wait_closed()


async def test_a_tls_redis_that_never_answers_is_stopped(
    certificates: Path, tmp_path: Path
) -> None:
    """The fixture's server is stopped when the fixture fails (a CA the client cannot
    use: the server never answers it)."""
    other = tmp_path / "other-ca"
    other.mkdir()
    make_pki(other)
    with pytest.raises(TimeoutError):
        async with private_tls_redis(
            certificates, tmp_path, client_ca=other / "ca.crt", within_s=2
        ):
            pass
    log = (tmp_path / "redis.log").read_text()
    assert "Ready to accept connections" in log  # it did start
    assert "ready to exit" in log  # and was stopped (SIGTERM: a clean shutdown)


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
    with pytest.raises(Unavailable, match="cannot connect to Redis"):
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
    client certificates."""
    config = (
        "listeners.ssl.default = {port}\n"
        "ssl_options.cacertfile = {folder}/ca.crt\n"
        "ssl_options.certfile = {folder}/server.crt\n"
        "ssl_options.keyfile = {folder}/server.key\n"
        "ssl_options.verify = verify_peer\n"
        "ssl_options.fail_if_no_peer_cert = true\n"
    )
    files = {name: certificates / name for name in ("ca.crt", "server.crt", "server.key")}
    with private_rabbitmq(config, files=files, tls=True) as node:
        yield node.port


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
    with pytest.raises(Unavailable, match="cannot connect to RabbitMQ"):
        async with run_worker(amqp_url=url, amqp_ca_file=certificates / "ca.crt"):
            pass
