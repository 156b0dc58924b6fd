"""The gateway driven by the official OpenAI Node package (`openai` on npm, pinned in
tests/node/package-lock.json): tests/node/gateway.mjs runs chat (whole and streamed with
usage), completions, models, the errors and a batch against a `trtllm-worker gateway`
process and a worker (echo engine), printing what the SDK parsed; each answer is checked
against its job's stream in Redis. Skipped only where node or npm is not installed."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from tests.integration.conftest import Entry, SpawnGateway, Subscriber, WorkerFactory
from tests.node_deps import NODE_DIR, node_modules

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen2.5.jinja"
MODEL = "tiny-echo"
KEY = "sk-test-node"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="session")
def node_sdk() -> Path:
    """The Node package installed with `npm ci` from the committed lockfile (once)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: the OpenAI Node SDK tests need them")
    return node_modules()


async def run_node(base_url: str, *steps: str) -> dict[str, dict[str, Any]]:
    """`node gateway.mjs STEPS` on the gateway: its JSON lines by step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    env.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY=KEY, GATEWAY_MODEL=MODEL)
    node = await asyncio.create_subprocess_exec(
        "node", "gateway.mjs", *steps,
        cwd=NODE_DIR, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(node.communicate(), 150)
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()
    assert node.returncode == 0, f"node exited {node.returncode}:\n{err.decode()}"
    results = [json.loads(line) for line in out.decode().splitlines()]
    return {result.pop("step"): result for result in results}


@pytest.fixture
async def gateway_url(
    node_sdk: Path,
    run_worker: WorkerFactory,
    spawn_gateway: SpawnGateway,
    amqp_channel: aio_pika.abc.AbstractChannel,  # deletes the test's queues afterwards
    tmp_path: Path,
) -> AsyncIterator[str]:
    """A worker (echo engine, a chat template) and a gateway process with one key."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY: {"tenant": "node", "priority": 5}}))
    async with run_worker(chat_template=TEMPLATE, model_name=MODEL, echo_step_ms=2):
        gateway = await spawn_gateway(
            WORKER_GATEWAY_KEYS_FILE=str(keys),
            WORKER_CHAT_TEMPLATE=str(TEMPLATE),
            WORKER_MODEL_NAME=MODEL,
        )
        yield gateway.base_url


async def done_entry(subscriber: Subscriber, request_id: str) -> Entry:
    entries = await subscriber.read_until_terminal(request_id)
    assert entries[-1]["event"] == "done", entries[-1]
    return entries[-1]


def request_id_of(answer_id: str) -> str:
    return answer_id.split("-", 1)[1]


async def test_the_node_sdk_chats_streams_completes_and_lists(
    gateway_url: str, subscriber: Subscriber
) -> None:
    got = await run_node(gateway_url, "chat", "stream", "completions", "models", "errors")

    chat = got["chat"]
    done = await done_entry(subscriber, chat["request_id"])
    assert chat["id"] == f"chatcmpl-{chat['request_id']}"
    assert chat["object"] == "chat.completion"
    assert chat["model"] == MODEL
    assert chat["choices"] == 1
    assert chat["role"] == "assistant"
    assert chat["content"] == done["generated_text"]
    assert chat["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == int(done["generated_tokens"]) == 12
    assert chat["usage"]["prompt_tokens"] == int(done["input_tokens"])
    assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + 12

    stream = got["stream"]
    (stream_id,) = stream["ids"]
    done = await done_entry(subscriber, request_id_of(stream_id))
    assert stream_id.startswith("chatcmpl-")
    assert stream["objects"] == ["chat.completion.chunk"]
    assert stream["first_role"] == "assistant"
    assert stream["text"] == done["generated_text"]
    assert stream["finish_reasons"][-1] == "length"
    assert set(stream["finish_reasons"][:-1]) <= {None}
    assert stream["last_choices"] == 0, "include_usage: the last chunk has no choices"
    assert stream["usage_chunks"] == 1
    assert stream["usage"]["completion_tokens"] == 20
    assert stream["usage"]["prompt_tokens"] == int(done["input_tokens"])

    completion = got["completions"]
    done = await done_entry(subscriber, completion["request_id"])
    assert completion["id"] == f"cmpl-{completion['request_id']}"
    assert completion["object"] == "text_completion"
    assert completion["text"] == done["generated_text"]
    assert completion["finish_reason"] == "length"
    assert completion["usage"]["completion_tokens"] == 5
    streamed = await done_entry(subscriber, request_id_of(completion["streamed_id"]))
    assert completion["streamed_text"] == streamed["generated_text"]
    assert completion["streamed_finish"] == "length"

    assert got["models"] == {"ids": [MODEL], "retrieved": MODEL, "object": "model"}

    wrong_key = got["errors"]["wrong_key"]
    assert wrong_key["class"] == "AuthenticationError"
    assert wrong_key["status"] == 401
    assert wrong_key["code"] == "invalid_api_key"
    unknown = got["errors"]["unknown_model"]
    assert unknown["class"] == "NotFoundError"
    assert unknown["status"] == 404
    assert unknown["code"] == "model_not_found"
    assert unknown["type"] == "invalid_request_error"


async def test_the_node_sdk_runs_a_batch(gateway_url: str, subscriber: Subscriber) -> None:
    batch = (await run_node(gateway_url, "batch"))["batch"]
    assert batch["purpose"] == "batch"
    assert batch["file_bytes"] == batch["sent_bytes"]
    assert batch["status"] == "completed", batch
    assert batch["statuses"][-1] == "completed"
    counts = batch["request_counts"]
    assert (counts["total"], counts["completed"], counts["failed"]) == (3, 3, 0)
    assert batch["output_file_id"]
    assert batch["listed"] == [batch["second_id"], batch["batch_id"]], "newest first"
    assert batch["cancelled_status"] in ("cancelling", "cancelled", "completed")
    output = batch["output"]
    assert [line["custom_id"] for line in output] == ["node-0", "node-1", "node-2"]
    for line in output:
        response = line["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["object"] == "chat.completion"
        assert body["model"] == MODEL
        assert body["usage"]["completion_tokens"] == 4
        assert body["choices"][0]["message"]["content"]
