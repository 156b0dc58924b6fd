"""Which TensorRT-LLM releases the worker accepts: at start (the adapters) and when the GPU
image is built (`python -m trtllm_worker.engine.versions` on the base image)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.engine import versions


@pytest.mark.parametrize(
    ("version", "line"),
    [("1.2.1", (1, 2)), ("1.4.0rc1", (1, 4)), ("1.3.0rc29", (1, 3)), ("1.2.0.post1", (1, 2))],
)
def test_release_reads_the_line(version: str, line: tuple[int, int]) -> None:
    assert versions.release(version) == line


@pytest.mark.parametrize("version", ["1.2.1", "1.3.0rc20", "1.4.0rc1"])
def test_supported_lines_start_quietly(version: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        versions.check(version)
    assert caplog.records == []


def test_an_older_release_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"TensorRT-LLM 1\.1\.0 is too old.*>=1\.2,<1\.5"):
        versions.check("1.1.0")


def test_a_newer_line_starts_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        versions.check("1.5.0rc0")
    assert "newer than the lines the worker is tested on" in caplog.text


def _fake_distribution(root: Path, version: str) -> Path:
    info = root / f"tensorrt_llm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: {version}\n"
    )
    return root


@pytest.mark.parametrize(("version", "ok"), [("1.2.1", True), ("1.4.0rc1", True), ("1.1.0", False)])
def test_the_image_build_check(tmp_path: Path, version: str, ok: bool) -> None:
    """What the Dockerfile's gpu stage runs on the base image's installed TensorRT-LLM."""
    site = _fake_distribution(tmp_path, version)
    source_root = str(Path(versions.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), source_root])}
    done = subprocess.run(
        [sys.executable, "-m", "trtllm_worker.engine.versions"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode == 0) is ok, done.stderr
    if ok:
        assert done.stdout.strip() == f"tensorrt_llm {version}: supported (tensorrt-llm>=1.2,<1.5)"
    else:
        assert "too old" in done.stderr
        assert "Traceback" not in done.stderr
