"""A local Redis Cluster started by the test suite: three masters on private ports and
data folders, from the installed `redis-server` (never the shared Redis), stopped at
the end by its own ports."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ClusterDownError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.integration.conftest import (
    XreadReply,
    amqp_channel,
    cleanup_keys,
    producer,
    redis_client,
    run_gateway,
    run_worker,
    spawn,
    subscriber,
)

# the integration fixtures
__all__ = [
    "amqp_channel", "cleanup_keys", "producer", "redis_client", "run_gateway", "run_worker",
    "spawn", "subscriber",
]  # fmt: skip


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, low: int = 10000, high: int = 22000) -> list[int]:
    """Ports whose cluster bus port (port + 10000) is free too. Both stay below the
    kernel's ephemeral range (32768 and up): a port picked inside it was seen taken by an
    outgoing connection between this check and the server's bind."""
    ports: list[int] = []
    candidate = random.randrange(low, high)
    while len(ports) < count:
        candidate += 1
        if _free(candidate) and _free(candidate + 10000):
            ports.append(candidate)
    return ports


def redis_cli(port: int, *args: str) -> str:
    """One command to one node, as an operator would type it ('' when it is down)."""
    return subprocess.run(
        ["redis-cli", "-p", str(port), *args], capture_output=True, text=True
    ).stdout


@dataclass
class LocalCluster:
    ports: list[int]

    def pid(self, port: int) -> int:
        info = redis_cli(port, "info", "server")
        return int(info.split("process_id:")[1].split()[0])

    def answers(self, port: int) -> bool:
        return redis_cli(port, "ping").strip() == "PONG"

    def replica_of(self, port: int) -> int:
        """The port of the replica of the master on `port`."""
        master_id = redis_cli(port, "cluster", "myid").strip()
        for other in self.ports:
            line = next(
                (
                    line
                    for line in redis_cli(other, "cluster", "nodes").splitlines()
                    if "myself" in line.split()[2]
                ),
                "",
            )
            if line and line.split()[3] == master_id:
                return other
        raise AssertionError(f"the master on port {port} has no replica")

    def wait_role(self, port: int, role: str, within_s: float = 30) -> None:
        """Until the node on `port` says it is `role` ('master' once a failover ends)."""
        deadline = time.monotonic() + within_s
        while redis_cli(port, "role").split("\n")[0].strip() != role:
            if time.monotonic() > deadline:
                raise AssertionError(f"the node on port {port} did not become {role}")
            time.sleep(0.1)
        _wait_state_ok([p for p in self.ports if self.answers(p)], within_s)

    def slots(self, port: int) -> set[int]:
        """The slots the node on `port` serves, as it says itself (none: a replica)."""
        own: set[int] = set()
        for line in redis_cli(port, "cluster", "nodes").splitlines():
            fields = line.split()
            if "myself" in fields[2]:
                for span in fields[8:]:
                    if not span.startswith("["):  # [slot->-node]: a slot migrating
                        low, _, high = span.partition("-")
                        own.update(range(int(low), int(high or low) + 1))
        return own

    def slot_count(self, port: int) -> int:
        return len(self.slots(port))

    def reshard(self, source: int, target: int, slots: int) -> None:
        """Move `slots` slots from the master on `source` to the one on `target` with
        `redis-cli --cluster reshard`, keys and all, as an operator does."""
        ids = [redis_cli(p, "cluster", "myid").strip() for p in (source, target)]
        subprocess.run(
            ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{source}",
             "--cluster-from", ids[0], "--cluster-to", ids[1],
             "--cluster-slots", str(slots), "--cluster-yes"],
            check=True,
            capture_output=True,
        )  # fmt: skip

    @property
    def url(self) -> str:
        """Any node will do: the worker finds the others."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def client(self) -> RedisCluster:
        return RedisCluster.from_url(self.url, decode_responses=True)


def _wait_answering(ports: list[int], within_s: float = 10) -> None:
    """`--daemonize yes` returns before the node listens."""
    deadline = time.monotonic() + within_s
    while not all(redis_cli(p, "ping").strip() == "PONG" for p in ports):
        if time.monotonic() > deadline:
            raise AssertionError(f"the Redis nodes on {ports} do not answer")
        time.sleep(0.05)


def _wait_state_ok(ports: list[int], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not all("cluster_state:ok" in redis_cli(p, "cluster", "info") for p in ports):
        if time.monotonic() > deadline:
            raise AssertionError("the local Redis Cluster did not recover")
        time.sleep(0.1)


def _wait_ok(ports: list[int], within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while True:
        states = [
            subprocess.run(
                ["redis-cli", "-p", str(p), "cluster", "info"], capture_output=True, text=True
            ).stdout
            for p in ports
        ]
        replication = [
            subprocess.run(
                ["redis-cli", "-p", str(p), "info", "replication"], capture_output=True, text=True
            ).stdout
            for p in ports
        ]
        # a replica that has not synced with its master yet would not take over from it
        synced = all("role:slave" not in r or "master_link_status:up" in r for r in replication)
        replicas_known = all(
            "connected_slaves:0" not in r for r in replication if "role:master" in r
        )
        if (
            all("cluster_state:ok" in s for s in states)
            and synced
            and (len(ports) == 3 or replicas_known)
        ):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the local Redis Cluster did not come up: {states}")
        time.sleep(0.1)


@contextlib.contextmanager
def local_cluster(root: Path, masters: int, replicas: int) -> Iterator[LocalCluster]:
    """Start `masters * (1 + replicas)` cluster nodes and join them; stop them all at
    the end, each by its own port (a node already down is skipped)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.fail("redis-server and redis-cli are needed for the local Redis Cluster")
    ports = free_ports(masters * (1 + replicas))
    started: list[int] = []
    try:
        for port in ports:
            folder = root / str(port)
            folder.mkdir()
            subprocess.run(
                [
                    "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                    "--cluster-enabled", "yes", "--cluster-config-file", str(folder / "nodes.conf"),
                    "--cluster-node-timeout", "1500", "--dir", str(folder), "--save", "",
                    "--appendonly", "no", "--daemonize", "yes",
                    "--logfile", str(folder / "redis.log"),
                ],
                check=True,
            )  # fmt: skip
            started.append(port)
        _wait_answering(ports)
        nodes = [f"127.0.0.1:{p}" for p in ports]
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", str(replicas),
             "--cluster-yes"],
            capture_output=True,
            text=True,
        )  # fmt: skip
        if created.returncode:
            raise AssertionError(f"redis-cli --cluster create failed: {created.stdout}")
        _wait_ok(ports)
        yield LocalCluster(ports)
    finally:
        for port in started:
            subprocess.run(
                ["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True
            )


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three masters, shared by the tests that do not break it."""
    with local_cluster(tmp_path_factory.mktemp("redis-cluster"), 3, 0) as cluster:
        yield cluster


@pytest.fixture
async def cluster_client(redis_cluster: LocalCluster) -> AsyncIterator[RedisCluster]:
    client = redis_cluster.client()
    await client.initialize()
    yield client
    await client.aclose()


async def read_stream(
    client: RedisCluster | aioredis.Redis, key: str, wait_s: float = 20
) -> list[dict[str, str]]:
    """One stream to its terminal entry, as a subscriber of a cluster reads it (one key
    per XREAD: a multi-key XREAD would span slots)."""
    entries: list[dict[str, str]] = []
    last = "0"
    async with asyncio.timeout(wait_s):
        while True:
            try:
                reply = cast(XreadReply, await client.xread({key: last}, block=1000, count=500))
            except (RedisConnectionError, ClusterDownError, RedisTimeoutError):
                # a failover in progress: as a subscriber does, read again from `last`
                await asyncio.sleep(0.1)
                continue
            for _, items in reply or []:
                for entry_id, fields in items:
                    last = entry_id
                    entries.append(fields)
                    if fields["event"] in ("done", "error"):
                        return entries


async def assert_complete(
    client: RedisCluster | aioredis.Redis, prefix: str, jobs: dict[str, str], tokens: int
) -> None:
    """Every job (request id → prompt) ended `done`, its indices 0..tokens-1 each once,
    its text whole (the echo engine repeats the prompt)."""
    for request_id, prompt in jobs.items():
        entries = await read_stream(client, prefix + request_id, wait_s=90)
        done = entries[-1]
        assert done["event"] == "done", (request_id, done)
        indices = [int(e["index"]) for e in entries if e["event"] == "token"]
        assert indices == list(range(tokens)), request_id
        text = "".join(e["text"] for e in entries if e["event"] == "token")
        assert text == done["generated_text"] == (prompt * tokens)[:tokens]


RABBITMQ_CLUSTER = Path(__file__).parents[2] / "tools" / "rabbitmq-cluster.sh"


@dataclass
class RabbitCluster:
    """Nodes started by tools/rabbitmq-cluster.sh (the script `make cluster-up` runs):
    node trtw-PORT@localhost listens for AMQP on PORT."""

    root: Path
    ports: list[int]

    def url(self, port: int) -> str:
        return f"amqp://guest:guest@127.0.0.1:{port}/"

    def node(self, port: int) -> str:
        return f"trtw-{port}@localhost"

    def ctl(self, port: int, *args: str) -> str:
        """rabbitmqctl on one node, with the cluster's own cookie."""
        done = subprocess.run(
            ["bash", str(RABBITMQ_CLUSTER), "ctl", str(self.root), str(port), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, (args, done.stderr)
        return done.stdout

    def stop(self, port: int) -> None:
        """Stop one node as an operator would (its connections are closed), and wait
        until its process has exited."""
        subprocess.run(["bash", str(RABBITMQ_CLUSTER), "stop", str(self.root), str(port)],
                       check=True, capture_output=True)  # fmt: skip

    def answers(self, port: int) -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def rabbitmq_cluster() -> Iterator[RabbitCluster]:
    """Three RabbitMQ nodes joined into one cluster, on private ports (below the
    ephemeral range) and a data folder the rabbitmq user owns (pytest's own tmp folders
    are private to root); every node is stopped by its name at the end."""
    if shutil.which("rabbitmq-server") is None or shutil.which("rabbitmqctl") is None:
        pytest.fail("rabbitmq-server and rabbitmqctl are needed for the local RabbitMQ cluster")
    root = Path(tempfile.mkdtemp(prefix="trtw-rabbitmq-"))
    ports = free_ports(3, low=12000, high=22000)
    try:
        started = subprocess.run(
            ["bash", str(RABBITMQ_CLUSTER), "up", str(root), *map(str, ports)],
            capture_output=True,
            text=True,
        )
        assert started.returncode == 0, f"the local RabbitMQ cluster did not start: {started}"
        yield RabbitCluster(root, ports)
    finally:
        subprocess.run(["bash", str(RABBITMQ_CLUSTER), "down", str(root)], capture_output=True)
