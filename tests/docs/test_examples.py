"""Every example the docs include (docs/examples) runs against a real worker on this
test's own queue and stream prefix, which the examples read from WORKER_* variables."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import GatewayFactory, WorkerFactory
from tests.services import ServiceUrls

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.fixture
def example_env(services: ServiceUrls, names: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        WORKER_AMQP_URL=services.amqp,
        WORKER_REDIS_URL=services.redis,
        WORKER_QUEUE=names["queue"],
        WORKER_STREAM_PREFIX=names["stream_prefix"],
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


async def run_example(env: dict[str, str], cwd: Path, *command: str) -> str:
    """The example's stdout; it must exit 0 (its stderr is shown when it does not)."""
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=cwd,  # not the repository: its .env must not leak into the example
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(45):
        out, err = await process.communicate()
    assert process.returncode == 0, f"{command} exited {process.returncode}: {err.decode()}"
    return out.decode()


@pytest.mark.usefixtures("amqp_channel", "cleanup_keys")
async def test_the_sdk_producer_streams_and_waits(
    run_worker: WorkerFactory, example_env: dict[str, str], tmp_path: Path
) -> None:
    async with run_worker():
        out = await run_example(
            example_env, tmp_path, sys.executable, str(EXAMPLES / "producer.py")
        )
    # the echo engine repeats the prompt: 16 bytes, 16 tokens
    assert out.startswith("Once upon a time\nlength, 16 tokens\n")
    assert out.endswith("HelloHel\n")


@pytest.mark.usefixtures("amqp_channel", "cleanup_keys")
async def test_a_job_published_with_aio_pika_is_read_by_the_subscriber(
    run_worker: WorkerFactory, example_env: dict[str, str], tmp_path: Path
) -> None:
    async with run_worker():
        await run_example(
            example_env, tmp_path, sys.executable, str(EXAMPLES / "publish_aio_pika.py")
        )
        out = await run_example(
            example_env, tmp_path, sys.executable, str(EXAMPLES / "subscriber.py"), "req-1"
        )
    text, _, terminal = out.partition("\n")
    assert text.startswith("Once upon a time")
    assert "'event': 'done'" in terminal
    assert "'finish_reason': 'length'" in terminal


@pytest.mark.usefixtures("amqp_channel", "cleanup_keys")
async def test_the_sync_client_generates_and_lists_dead_letters(
    run_worker: WorkerFactory, example_env: dict[str, str], tmp_path: Path
) -> None:
    async with run_worker():
        out = await run_example(
            example_env, tmp_path, sys.executable, str(EXAMPLES / "sync_client.py")
        )
    assert out == "HelloHelloHelloH\n"  # no dead letters on this test's queue


@pytest.mark.usefixtures("amqp_channel", "cleanup_keys")
async def test_the_cli_example(
    run_worker: WorkerFactory, example_env: dict[str, str], tmp_path: Path
) -> None:
    async with run_worker():
        out = await run_example(example_env, tmp_path, "bash", str(EXAMPLES / "cli.sh"))
    assert out == "Once upon a time\nHelloHel\n"


@pytest.mark.usefixtures("amqp_channel", "cleanup_keys")
async def test_the_batch_example(
    run_worker: WorkerFactory, example_env: dict[str, str], tmp_path: Path
) -> None:
    async with run_worker():
        out = await run_example(example_env, tmp_path, "bash", str(EXAMPLES / "batch.sh"))
    assert out == (
        "{'total': 3, 'completed': 2, 'failed': 1}\n"
        "greeting 'HelloHel'\n"
        "story 'Once upon a time'\n"
        "three invalid_request\n"
    )
    assert (tmp_path / "output.jsonl").read_bytes().count(b"\n") == 2


@pytest.mark.usefixtures("amqp_channel", "cleanup_keys")
async def test_the_gateway_examples_curl_and_the_openai_package(
    run_worker: WorkerFactory,
    run_gateway: GatewayFactory,
    example_env: dict[str, str],
    tmp_path: Path,
) -> None:
    async with run_worker(), run_gateway() as gateway:
        env = {**example_env, "GATEWAY": gateway.url}
        curl = await run_example(env, tmp_path, "bash", str(EXAMPLES / "gateway.sh"))
        python = await run_example(env, tmp_path, sys.executable, str(EXAMPLES / "gateway_sdk.py"))
    # 16 token chunks and the finish chunk; 16 token entries and `done`, 3 of them before
    assert curl == "HelloHel\n17\n14 entries after the third, the last: done\n"
    assert python == "HelloHel 8\n'Once upon a time' 32\n"
