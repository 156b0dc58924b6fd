"""The Dockerfile (hadolint, and what each image must be), .dockerignore and the compose
demo. No Docker engine is needed: the images are not built here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.support import COMPOSE, DOCKERFILE, DOCKERIGNORE, ROOT
from trtllm_worker.app.cli import build_parser
from trtllm_worker.config import Settings
from trtllm_worker.engine import versions


def tool(name: str) -> str:
    """A command installed with the dev extra (next to this Python, else on PATH)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is missing: pip install -e '.[dev]'"
    return found


# -- the Dockerfile, read into its stages ----------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"stage {self.name} has no {keyword}"
        return found[-1]


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            out.append((keyword.upper(), " ".join(args.split())))
    return out


def parse() -> tuple[dict[str, str], list[Stage]]:
    """The global ARG defaults and the stages, in order."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in instructions(DOCKERFILE.read_text(encoding="utf-8")):
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            stages.append(Stage(name.strip(), base.strip()))
        elif not stages:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            key, _, value = rest.partition("=")
            args[key] = value
        else:
            stages[-1].instructions.append((keyword, rest))
    return args, stages


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"not exec form: {args}"
    return [str(v) for v in value]


def test_hadolint_finds_nothing() -> None:
    result = subprocess.run(
        [
            tool("hadolint"),
            "--no-color",
            "--format",
            "json",
            "--failure-threshold",
            "style",
            "--disable-ignore-pragma",
            str(DOCKERFILE),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert json.loads(result.stdout or "[]") == [], result.stdout
    assert result.returncode == 0, result.stderr


def test_stages_and_default_target() -> None:
    args, stages = parse()
    names = [stage.name for stage in stages]
    assert {"cpu", "gpu"} <= set(names)
    # `docker build .` builds the last stage: the production image
    assert names[-1] == "gpu"
    # pinned bases, changeable with build arguments
    # the release container of the newest stable TensorRT-LLM, another by TRTLLM_VERSION
    assert args["TRTLLM_VERSION"] == versions.STABLE
    assert args["TRTLLM_IMAGE"] == "nvcr.io/nvidia/tensorrt-llm/release:${TRTLLM_VERSION}"
    assert re.fullmatch(r"python:3\.12\.\d+-slim(-\w+)?", args["PYTHON_IMAGE"])
    by_name = {stage.name: stage for stage in stages}
    assert by_name["gpu"].base == "${TRTLLM_IMAGE}"
    assert by_name["cpu"].base == "${PYTHON_IMAGE}"


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_runtime_image(target: str) -> None:
    stage = {s.name: s for s in parse()[1]}[target]
    # non-root, numeric so that Kubernetes' runAsNonRoot can verify it
    assert stage.last("USER") == "1000:1000"
    # the worker's probes and metrics, and the gateway's API (`trtllm-worker gateway`)
    assert stage.last("EXPOSE").split() == ["8080", "8000"]
    entrypoint = exec_form(stage.last("ENTRYPOINT"))
    assert entrypoint[-1] == "trtllm-worker"
    # an init passes SIGTERM on to the worker (it drains) and reaps what TensorRT-LLM spawns
    assert entrypoint[entrypoint.index("dumb-init") + 1] == "--single-child"
    assert exec_form(stage.last("CMD")) == ["serve"]
    installs = " ".join(stage.all("RUN"))
    assert "--no-cache-dir" in installs
    # every dependency from uv.lock, hash-checked (dumb-init is the lock's `image` extra)
    assert re.search(
        r"pip install [^&]*--require-hashes [^&]*-r /tmp/\S*requirements\.txt", installs
    )


def test_images_install_what_the_lock_pins() -> None:
    stage = {s.name: s for s in parse()[1]}["wheel"]
    run = " ".join(stage.all("RUN"))
    # uv itself by hash, then the lock exported as it is (--frozen: never re-resolved)
    assert "--require-hashes -r tools/uv-requirements.txt" in run
    export = re.search(r"uv export ([^&]*)", run)
    assert export, run
    flags = export.group(1).split()
    assert "--frozen" in flags
    assert {"uvloop", "otel", "image", "gateway"} <= {
        flags[i + 1] for i, flag in enumerate(flags) if flag == "--extra"
    }
    lock = (ROOT / "uv.lock").read_text(encoding="utf-8")
    assert 'name = "dumb-init"' in lock


def test_gpu_image_keeps_the_tensorrt_llm_of_its_base() -> None:
    stage = {s.name: s for s in parse()[1]}["gpu"]
    run = " ".join(stage.all("RUN"))
    # the lock's requirements the image lacks, with every package of the image as a
    # constraint; then the worker, whose dependencies must all be there (--no-index)
    assert "image_requirements.py /tmp/wheels/requirements.txt /tmp/image-packages.txt" in run
    assert (
        "--require-hashes --constraint /tmp/image-packages.txt -r /tmp/worker-requirements.txt"
        in run
    )
    assert (
        '--no-index --constraint /tmp/image-packages.txt "${wheel}[uvloop,otel,image,gateway]"'
        in run
    )
    assert "pip list --format=freeze > /tmp/image-packages.txt" in run
    # the build fails on a base whose TensorRT-LLM the worker does not support
    assert "python3 -m trtllm_worker.engine.versions" in run
    assert not re.search(r"pip install[^&]*\btensorrt[-_]llm\b", run)


def test_either_image_runs_either_role() -> None:
    # one image, two commands: `serve` (the default CMD) and `gateway`, whose extra both
    # images install (test_images_install_what_the_lock_pins) and whose default port they
    # expose (test_runtime_image)
    parser = build_parser()
    assert parser.parse_args(["serve"]).command == "serve"
    assert parser.parse_args(["gateway"]).command == "gateway"
    assert Settings.model_fields["gateway_port"].default == 8000


def test_cpu_image_runs_the_echo_engine() -> None:
    stage = {s.name: s for s in parse()[1]}["cpu"]
    assert "WORKER_ENGINE=echo" in " ".join(stage.all("ENV"))


def _ignore_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerignore_lets_in_only_the_package() -> None:
    patterns = _ignore_patterns()
    # everything out (.git, .venv, tests, caches, .env), then the package back in
    assert patterns[0] == "*"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert allowed == {
        "pyproject.toml",
        "README.md",
        "trtllm_worker",
        "uv.lock",
        "tools/uv-requirements.txt",
        "tools/image_requirements.py",
    }
    # what the Dockerfile copies from the context is let in
    for stage in parse()[1]:
        for args in stage.all("COPY"):
            if args.startswith("--from="):
                continue
            *sources, _destination = args.split()
            for source in sources:
                assert source.rstrip("/") in allowed, source


# -- docker-compose.yml ------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return loaded


def test_compose_file_matches_the_compose_spec() -> None:
    result = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_demo_wiring() -> None:
    services = compose()["services"]
    assert set(services) == {"rabbitmq", "redis", "worker"}
    assert "management" in services["rabbitmq"]["image"]
    worker = services["worker"]
    assert worker["build"] == {"context": ".", "target": "cpu"}
    env = worker["environment"]
    assert env["WORKER_AMQP_URL"].startswith("amqp://")
    assert "@rabbitmq:5672/" in env["WORKER_AMQP_URL"]
    assert env["WORKER_REDIS_URL"].startswith("redis://redis:6379/")
    assert env["WORKER_ENGINE"] == "echo"
    assert worker["depends_on"] == {
        "rabbitmq": {"condition": "service_healthy"},
        "redis": {"condition": "service_healthy"},
    }
    assert "127.0.0.1:8080:8080" in worker["ports"]
    # the worker drains within its stop grace period
    drain = float(env["WORKER_DRAIN_TIMEOUT_S"])
    assert int(worker["stop_grace_period"].removesuffix("s")) > drain


@pytest.mark.parametrize("service", ["rabbitmq", "redis", "worker"])
def test_compose_healthchecks(service: str) -> None:
    definition = compose()["services"][service]
    check = definition["healthcheck"]
    assert check["test"][0] == "CMD"
    assert check["retries"] >= 3
    assert ":" in definition["image"], "images are pinned to a tag"
    assert not definition["image"].endswith(":latest")


def test_compose_worker_is_probed_on_readyz() -> None:
    check = compose()["services"]["worker"]["healthcheck"]["test"]
    assert any("http://127.0.0.1:8080/readyz" in part for part in check)
