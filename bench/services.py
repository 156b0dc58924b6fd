"""What the bench starts or asks beside the worker: redis-benchmark's XADD rate, a git
checkout of a baseline, a local Redis Cluster, a local OTLP sink."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from bench.settings import REPO


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def redis_xadd_ceiling(requests: int = 300_000) -> float:
    """Redis' own pipelined XADD rate for entries shaped like ours (redis-benchmark)."""
    key = f"bench:ceiling:{uuid.uuid4().hex}"
    entry = ("event", "token", "index", "1", "token_id", "97", "text", "a")
    out = subprocess.run(
        ["redis-benchmark", "-q", "-n", str(requests), "-P", "64", "XADD", key, "*", *entry],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    subprocess.run(["redis-cli", "del", key], capture_output=True, check=False)
    rates = re.findall(r"([\d.]+) requests per second", out)
    return float(rates[-1])


PACKAGES = ("trtllm_worker", "worker")
"""The worker's import package, newest name first: `worker` until issue 26 renamed it."""


def worker_package(root: Path) -> str:
    """The import package of the worker's code in `root` (a checkout)."""
    return next((name for name in PACKAGES if (root / name).is_dir()), PACKAGES[0])


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """The worker's package as it was at `ref` (under the name it had then), in a
    temporary folder (git archive: the working tree is not touched)."""
    root = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    try:
        listing = subprocess.run(
            ["git", "-C", str(REPO), "ls-tree", "--name-only", ref],
            capture_output=True,
            text=True,
            check=False,
        )
        names = listing.stdout.split()
        package = next((name for name in PACKAGES if name in names), PACKAGES[0])
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", ref, package],
            capture_output=True,
            check=False,
        )
        if archive.returncode != 0:
            raise SystemExit(
                f"baseline {ref!r} cannot be checked out: {archive.stderr.decode().strip()}"
                " (set BENCH_BASELINE to a ref of this repository)"
            )
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(root, filter="data")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def redis_cli(port: int, *args: str) -> str:
    return subprocess.run(
        ["redis-cli", "-p", str(port), *args], capture_output=True, text=True
    ).stdout


@contextlib.contextmanager
def local_redis_cluster(masters: int = 3) -> Iterator[str]:
    """A Redis Cluster of `masters` nodes on private ports (no replicas), from the
    installed redis-server, stopped by its own ports at the end; yields a node's URL."""
    root = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    ports: list[int] = []
    while len(ports) < masters:
        port = free_port()
        if port < 55000 and port not in ports and bindable(port + 10000):  # the bus port
            ports.append(port)
    try:
        for port in ports:
            subprocess.run(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes", "--cluster-config-file", f"{root}/{port}.conf",
                 "--dir", str(root), "--save", "", "--appendonly", "no", "--daemonize", "yes",
                 "--logfile", f"{root}/{port}.log"],
                check=True,
            )  # fmt: skip
        for port in ports:
            while redis_cli(port, "ping").strip() != "PONG":
                time.sleep(0.05)
        nodes = [f"127.0.0.1:{p}" for p in ports]
        subprocess.run(["redis-cli", "--cluster", "create", *nodes, "--cluster-yes"],
                       check=True, capture_output=True)  # fmt: skip
        for port in ports:
            while "cluster_state:ok" not in redis_cli(port, "cluster", "info"):
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for port in ports:
            redis_cli(port, "shutdown", "nosave")
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def otlp_sink() -> Iterator[int]:
    """bench/otlp_sink.py in a process of its own; yields its port."""
    port = free_port()
    sink = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "otlp_sink.py"), str(port)],
        stdout=subprocess.PIPE,
    )
    try:
        assert sink.stdout is not None
        sink.stdout.readline()  # "listening"
        yield port
    finally:
        sink.terminate()
        sink.wait(10)


def sink_count(port: int) -> dict[str, int]:
    """Spans the sink received since the last count."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET /spans HTTP/1.0\r\nHost: sink\r\n\r\n")
        reply = b"".join(iter(lambda: conn.recv(65536), b""))
    return dict(json.loads(reply.partition(b"\r\n\r\n")[2]))
