"""Redis managed by Sentinel: a master, its replica and a Sentinel started by the test on
private ports (passwords on both the data nodes and the Sentinel), a failover mid-run.
The worker is given the Sentinels (the first one listed is down) and the master's name,
never the master's address."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

from tests.cluster.conftest import assert_complete, free_ports
from tests.integration.conftest import Producer, WorkerFactory
from tests.integration.test_tls import certificates, stop_pid
from trtllm_worker.config import Settings

pytestmark = pytest.mark.cluster
__all__ = ["certificates"]  # the TLS fixture

PASSWORD = "data-secret"
SENTINEL_PASSWORD = "sentinel-secret"
MASTER = "jobs-master"
TOKENS = 300


def cli(port: int, *args: str, password: str = PASSWORD) -> str:
    return subprocess.run(
        ["redis-cli", "--no-auth-warning", "-a", password, "-p", str(port), *args],
        capture_output=True,
        text=True,
    ).stdout


def wait(condition: Callable[[], bool], what: str, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


@dataclass
class SentinelSetup:
    master: int
    replica: int
    sentinel: int
    down: int
    """A port where no Sentinel answers, listed first."""

    @property
    def sentinels(self) -> str:
        return f"127.0.0.1:{self.down},127.0.0.1:{self.sentinel}"

    def master_address(self) -> str:
        reply = cli(self.sentinel, "sentinel", "get-master-addr-by-name", MASTER,
                    password=SENTINEL_PASSWORD)  # fmt: skip
        return ":".join(reply.split())

    def role(self, port: int) -> str:
        return cli(port, "role").split("\n")[0].strip()


@pytest.fixture
def sentinel_setup(tmp_path: Path) -> Iterator[SentinelSetup]:
    master, replica, sentinel, down = free_ports(4)
    setup = SentinelSetup(master, replica, sentinel, down)
    started: list[int] = []
    try:
        for port, extra in ((master, []), (replica, ["--replicaof", "127.0.0.1", str(master)])):
            subprocess.run(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                 "--requirepass", PASSWORD, "--masterauth", PASSWORD, "--save", "",
                 "--appendonly", "no", "--dir", str(tmp_path), "--daemonize", "yes",
                 "--logfile", str(tmp_path / f"{port}.log"), *extra],
                check=True,
            )  # fmt: skip
            started.append(port)
        wait(lambda: "master_link_status:up" in cli(replica, "info", "replication"), "synced")
        config = tmp_path / "sentinel.conf"
        config.write_text(
            f"port {sentinel}\nbind 127.0.0.1\ndaemonize yes\ndir {tmp_path}\n"
            f"logfile {tmp_path / 'sentinel.log'}\nrequirepass {SENTINEL_PASSWORD}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {master} 1\n"
            f"sentinel auth-pass {MASTER} {PASSWORD}\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 10000\n"
        )
        subprocess.run(["redis-server", str(config), "--sentinel"], check=True)
        started.append(sentinel)
        wait(
            lambda: (
                str(replica)
                in cli(sentinel, "sentinel", "replicas", MASTER, password=SENTINEL_PASSWORD)
            ),
            "the Sentinel knows the replica",
        )
        yield setup
    finally:
        for port in started:
            password = SENTINEL_PASSWORD if port == sentinel else PASSWORD
            cli(port, "shutdown", "nosave", password=password)


@contextlib.asynccontextmanager
async def sentinel_client(setup: SentinelSetup) -> AsyncIterator[aioredis.Redis]:
    """A subscriber's client: asks the Sentinel for the master, as the worker does."""
    sentinel = Sentinel(
        [("127.0.0.1", setup.sentinel)], sentinel_kwargs={"password": SENTINEL_PASSWORD}
    )
    client: aioredis.Redis = sentinel.master_for(
        MASTER, password=PASSWORD, decode_responses=True, socket_timeout=5
    )
    try:
        yield client
    finally:
        await client.aclose()
        for each in sentinel.sentinels:
            await each.aclose()


def worker_settings(setup: SentinelSetup) -> dict[str, Any]:
    return {
        # the host and port are not used: the Sentinels say where the master is
        "redis_url": f"redis://:{PASSWORD}@127.0.0.1:1/0",
        "redis_sentinels": setup.sentinels,
        "redis_sentinel_master": MASTER,
        "redis_sentinel_password": SENTINEL_PASSWORD,
        # a job is acknowledged once its end is on the replica: what a failover promotes
        "redis_min_replicas": 1,
    }


async def test_a_sentinel_failover_mid_run_loses_no_job(
    sentinel_setup: SentinelSetup,
    run_worker: WorkerFactory,
    producer: Producer,
    names: dict[str, str],
) -> None:
    setup = sentinel_setup
    prefix = names["stream_prefix"]
    async with sentinel_client(setup) as client:
        assert setup.master_address() == f"127.0.0.1:{setup.master}"
        async with run_worker(**worker_settings(setup), echo_step_ms=4):
            jobs = {f"rs-{uuid.uuid4().hex[:10]}": f"job {n}. " for n in range(24)}
            for request_id, prompt in jobs.items():
                await producer.publish(
                    {"request_id": request_id, "inputs": prompt,
                     "parameters": {"max_new_tokens": TOKENS}}
                )  # fmt: skip
            first = prefix + next(iter(jobs))
            async with asyncio.timeout(30):
                while int(await client.xlen(first)) < 30:
                    pass
            reply = cli(setup.sentinel, "sentinel", "failover", MASTER, password=SENTINEL_PASSWORD)
            assert reply.strip() == "OK", reply
            await asyncio.to_thread(
                wait,
                lambda: setup.master_address() == f"127.0.0.1:{setup.replica}",
                "the Sentinel names the replica as master",
            )
            await asyncio.to_thread(
                wait, lambda: setup.role(setup.master) == "slave", "the old master is demoted"
            )
            assert setup.role(setup.replica) == "master"
            await assert_complete(client, prefix, jobs, TOKENS)


async def test_check_finds_the_master_through_sentinel(
    sentinel_setup: SentinelSetup,
    make_settings: Callable[..., Settings],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from trtllm_worker.app.check import Report, _check_redis

    report = Report()
    await _check_redis(make_settings(**worker_settings(sentinel_setup)), report)
    out = capsys.readouterr().out
    assert report.problems == 0, out
    assert f"now at 127.0.0.1:{sentinel_setup.master}" in out


async def test_a_wrong_sentinel_password_is_one_clear_line(
    sentinel_setup: SentinelSetup,
    make_settings: Callable[..., Settings],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from trtllm_worker.app.check import Report, _check_redis

    settings = make_settings(**{**worker_settings(sentinel_setup), "redis_sentinel_password": "no"})
    report = Report()
    await _check_redis(settings, report)
    out = capsys.readouterr().out
    assert report.problems == 1, out
    assert f"Sentinels {sentinel_setup.sentinels}" in out


def wait_listening(port: int, within_s: float = 10) -> None:
    """Until the port accepts a TCP connection (a process offers no event to wait on)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def tls_sentinel_setup(certificates: Path, tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A master and a Sentinel that speak only TLS and require client certificates
    (the Sentinel reaches the master over TLS too): (master port, Sentinel port)."""
    master, sentinel = free_ports(2)
    tls = [f"--tls-cert-file {certificates / 'server.crt'}",
           f"--tls-key-file {certificates / 'server.key'}",
           f"--tls-ca-cert-file {certificates / 'ca.crt'}", "--tls-auth-clients yes",
           "--tls-replication yes"]  # fmt: skip
    options = [part for option in tls for part in option.split(" ", 1)]
    started: list[int] = []
    try:
        subprocess.run(
            ["redis-server", "--port", "0", "--tls-port", str(master), "--bind", "127.0.0.1",
             "--requirepass", PASSWORD, "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path), "--daemonize", "yes",
             "--pidfile", str(tmp_path / "master.pid"),
             "--logfile", str(tmp_path / "master.log"), *options],
            check=True,
        )  # fmt: skip
        started.append(master)
        config = tmp_path / "sentinel.conf"
        config.write_text(
            f"port 0\ntls-port {sentinel}\nbind 127.0.0.1\ndaemonize yes\ndir {tmp_path}\n"
            f"logfile {tmp_path / 'sentinel.log'}\npidfile {tmp_path / 'sentinel.pid'}\n"
            + "".join(f"{option}\n" for option in (o.lstrip("-") for o in tls))
            + f"requirepass {SENTINEL_PASSWORD}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {master} 1\n"
            f"sentinel auth-pass {MASTER} {PASSWORD}\n"
        )
        subprocess.run(["redis-server", str(config), "--sentinel"], check=True)
        started.append(sentinel)
        # daemonized: the servers may not listen yet when redis-server returns (Redis 8's
        # Sentinel was seen refusing the first connection)
        for port in (master, sentinel):
            wait_listening(port)
        yield master, sentinel
    finally:
        for port in started:
            password = SENTINEL_PASSWORD if port == sentinel else PASSWORD
            subprocess.run(
                ["redis-cli", "--tls", "--cacert", str(certificates / "ca.crt"),
                 "--cert", str(certificates / "client.crt"),
                 "--key", str(certificates / "client.key"), "--no-auth-warning",
                 "-a", password, "-p", str(port), "shutdown", "nosave"],
                capture_output=True,
            )  # fmt: skip
        # and by pid, in case the shutdown could not be sent (a TLS client refused)
        stop_pid(tmp_path / "master.pid")
        stop_pid(tmp_path / "sentinel.pid")


async def test_sentinel_and_master_over_tls(
    tls_sentinel_setup: tuple[int, int],
    certificates: Path,
    run_worker: WorkerFactory,
    producer: Producer,
    make_settings: Callable[..., Settings],
    names: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`rediss://` with Sentinels: the worker asks the Sentinel over TLS with the CA and
    client certificate of its settings, then writes to the master over TLS; `check`
    finds the master the same way, and without the client certificate it is refused in
    one line."""
    from trtllm_worker.app.check import Report, _check_redis

    master, sentinel = tls_sentinel_setup
    settings: dict[str, Any] = {
        "redis_url": f"rediss://:{PASSWORD}@127.0.0.1:1/0",
        "redis_sentinels": f"127.0.0.1:{sentinel}",
        "redis_sentinel_master": MASTER,
        "redis_sentinel_password": SENTINEL_PASSWORD,
        "redis_ca_file": certificates / "ca.crt",
        "redis_cert_file": certificates / "client.crt",
        "redis_key_file": certificates / "client.key",
    }
    report = Report()
    await _check_redis(make_settings(**settings), report)
    out = capsys.readouterr().out
    assert report.problems == 0, out
    assert f"now at 127.0.0.1:{master}" in out

    request_id = f"rst-{uuid.uuid4().hex[:10]}"
    client = aioredis.Redis(
        host="127.0.0.1", port=master, password=PASSWORD, ssl=True,
        ssl_ca_certs=str(certificates / "ca.crt"),
        ssl_certfile=str(certificates / "client.crt"),
        ssl_keyfile=str(certificates / "client.key"), decode_responses=True,
    )  # fmt: skip
    try:
        async with run_worker(**settings):
            await producer.publish(
                {"request_id": request_id, "inputs": "over tls ",
                 "parameters": {"max_new_tokens": 20}}
            )  # fmt: skip
            await assert_complete(client, names["stream_prefix"], {request_id: "over tls "}, 20)
    finally:
        await client.aclose()

    without_certificate = {**settings, "redis_cert_file": None, "redis_key_file": None}
    report = Report()
    await _check_redis(make_settings(**without_certificate), report)
    out = capsys.readouterr().out
    assert report.problems == 1, out
    # TLS 1.3 sends the refusal after the client's handshake: the client reads it as the
    # certificate-required alert, or as a reset when the Sentinel closed first
    refusals = ("CERTIFICATE_REQUIRED", "Connection reset by peer")
    assert any(r in out for r in refusals), "the Sentinel's own refusal, not a client repr"
    assert "redis.asyncio" not in out
