"""The shape of the package as a user of the SDK meets it: importing the client loads
no job runner, engine or consumer, and leaves the host application's logging and
prometheus-client state as they were. (`lint-imports` checks the layers themselves.)"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, logging, sys
root = logging.getLogger()
before = (root.level, list(root.handlers), logging.getLogger("aio_pika").level)
import trtllm_worker.client
after = (root.level, list(root.handlers), logging.getLogger("aio_pika").level)
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m.startswith("trtllm_worker")),
    "prometheus": "prometheus_client" in sys.modules,
    "logging_unchanged": before == after,
}))
"""


def _probe() -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_importing_the_client_loads_no_worker_internals() -> None:
    modules = _probe()["modules"]
    assert isinstance(modules, list)
    assert "trtllm_worker.client.sdk" in modules  # the probe did import it
    loaded = [
        m
        for m in modules
        if m.startswith(
            (
                "trtllm_worker.pipeline",
                "trtllm_worker.engine",
                "trtllm_worker.ops",
                "trtllm_worker.broker",
                "trtllm_worker.app",
            )
        )
    ]
    assert loaded == []


def test_importing_the_client_touches_no_global_state() -> None:
    result = _probe()
    assert result["prometheus"] is False
    assert result["logging_unchanged"] is True


def test_importtime_shows_no_worker_internals() -> None:
    """The issue's own check: `python -X importtime -c "import trtllm_worker.client"`."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import trtllm_worker.client"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    assert "trtllm_worker.client.sdk" in imported
    assert not {
        m for m in imported if m.startswith(("trtllm_worker.pipeline", "trtllm_worker.engine"))
    }
    assert not {m for m in imported if m.startswith(("trtllm_worker.broker", "trtllm_worker.app"))}
