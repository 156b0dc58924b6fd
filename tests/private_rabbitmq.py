"""A private RabbitMQ node for tests that need a broker configured otherwise than the
shared one (TLS only, a short consumer timeout): its own node name, ports and folder,
owned by the `rabbitmq` user (the server drops to it), stopped by its node name on every
path. The machine's broker is never touched."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class PrivateNode:
    port: int
    node: str
    folder: Path
    env: dict[str, str]

    def log(self) -> str:
        """Everything the node logged so far."""
        return "".join(
            path.read_text(errors="replace") for path in (self.folder / "log").glob("*.log")
        )

    def ctl(self, *args: str) -> str:
        result = subprocess.run(
            ["rabbitmqctl", "-n", self.node, *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return result.stdout


@contextlib.contextmanager
def private_rabbitmq(
    config: str = "", advanced: str = "", files: dict[str, Path] | None = None, *, tls: bool = False
) -> Iterator[PrivateNode]:
    """Start a node with `config` (rabbitmq.conf lines; `{port}` and `{folder}` are filled
    in) and `advanced` (advanced.config terms), wait until its AMQP port answers."""
    if shutil.which("rabbitmq-server") is None or shutil.which("rabbitmqctl") is None:
        pytest.fail("rabbitmq-server is needed for a private broker")
    folder = Path(tempfile.mkdtemp(prefix="trtllm-worker-broker-", dir="/tmp"))
    port, dist_port = free_port(), free_port()
    for name, source in (files or {}).items():
        shutil.copy(source, folder / name)
    listener = "listeners.tcp = none\n" if tls else f"listeners.tcp.local = 127.0.0.1:{port}\n"
    (folder / "rabbitmq.conf").write_text(
        listener + config.format(port=port, folder=folder) + "\nloopback_users = none\n"
    )
    (folder / "advanced.config").write_text(f"[{advanced}].\n" if advanced else "[].\n")
    (folder / "enabled_plugins").write_text("[].\n")
    for sub in ("mnesia", "log"):
        (folder / sub).mkdir()
    subprocess.run(["chown", "-R", "rabbitmq:rabbitmq", str(folder)], check=True)
    folder.chmod(0o755)
    node = f"trtllm-test-{port}@localhost"
    env = {
        **os.environ,
        "RABBITMQ_NODENAME": node,
        "RABBITMQ_DIST_PORT": str(dist_port),
        "RABBITMQ_CONFIG_FILE": str(folder / "rabbitmq"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(folder / "advanced.config"),
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
                pytest.fail(f"the private broker did not start (see {folder}/log)")
            time.sleep(0.2)
        yield PrivateNode(port, node, folder, env)
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
            server.wait()
        shutil.rmtree(folder, ignore_errors=True)
