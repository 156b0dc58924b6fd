"""The CLI as users run it: `python -m trtllm_worker …` in a subprocess, with WORKER_* settings
pointing at this test's queue and prefix, against the real services and a running worker."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import cast

import aio_pika
import pytest

from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal, tokens
from tests.lora_fixtures import write_adapter
from tests.services import ServiceUrls
from trtllm_worker.engine.lora import adapter_id
from trtllm_worker.tokenizer import load_tokenizer

UNREACHABLE_AMQP = "amqp://guest:s3cret-pw@127.0.0.1:1/"
UNREACHABLE_REDIS = "redis://:s3cret-pw@127.0.0.1:1/0"


def rid() -> str:
    return f"cli-{uuid.uuid4().hex[:10]}"


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()


class Cli:
    """Runs `python -m trtllm_worker` with this test's settings."""

    def __init__(self, services: ServiceUrls, names: dict[str, str], cwd: Path) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
        self.env.update(
            WORKER_AMQP_URL=services.amqp,
            WORKER_REDIS_URL=services.redis,
            WORKER_QUEUE=names["queue"],
            WORKER_STREAM_PREFIX=names["stream_prefix"],
        )
        self.cwd = cwd

    async def start(self, *args: str, **env: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "trtllm_worker",
            *args,
            env={**self.env, **env},
            cwd=self.cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def run(self, *args: str, **env: str) -> Result:
        process = await self.start(*args, **env)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode is not None
        return Result(process.returncode, stdout.decode(), stderr.decode())


@pytest.fixture
def cli(
    services: ServiceUrls,
    names: dict[str, str],
    tmp_path: Path,
    subscriber: Subscriber,  # removes the test's keys afterwards
    producer: Producer,  # deletes the test's queues afterwards
) -> Cli:
    return Cli(services, names, tmp_path)


def no_traceback(result: Result) -> None:
    assert "Traceback" not in result.stderr, result.stderr


async def test_submit_follow_prints_tokens_live(
    run_worker: WorkerFactory, cli: Cli, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker(echo_step_ms=10):
        process = await cli.start(
            "submit", "abc", "-p", "max_new_tokens=2000", "--request-id", request_id, "--follow"
        )
        assert process.stdout is not None
        # The first token's text comes out while the job still runs: it only ends
        # because it is cancelled after the output was seen.
        first = await asyncio.wait_for(process.stdout.readexactly(3), 20)
        assert first == b"abc"
        await producer.cancel(request_id)
        rest, stderr = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode == 0, stderr
    done = terminal(await subscriber.entries(request_id))
    assert done["finish_reason"] == "cancelled"
    assert (first + rest).decode() == done["generated_text"] + "\n"
    lines = stderr.decode().splitlines()
    assert lines[0] == f"# request {request_id}"
    assert len(lines) == 2, lines
    summary = lines[1]
    assert summary.startswith(f"# {request_id}: cancelled, {done['generated_tokens']} tokens")
    assert "first token after" in summary
    assert summary.endswith("tokens/s")


async def test_submit_prints_the_request_id_then_tail_follows_it(
    run_worker: WorkerFactory, cli: Cli, subscriber: Subscriber
) -> None:
    async with run_worker():
        submitted = await cli.run("submit", "héllo wörld ", "-p", "max_new_tokens=20")
        assert submitted.code == 0, submitted.stderr
        request_id = submitted.stdout.strip()
        tail = await cli.run("tail", request_id)
    assert tail.code == 0, tail.stderr
    done = terminal(await subscriber.entries(request_id))
    assert tail.stdout == done["generated_text"] + "\n"
    assert tail.stdout.startswith("héllo wörld h")
    assert tail.stderr_lines == [f"# {request_id}: length, 20 tokens (14 in the prompt)"]


async def test_tail_from_the_terminal_entry_ends_at_once(
    run_worker: WorkerFactory, cli: Cli, subscriber: Subscriber
) -> None:
    async with run_worker():
        submitted = await cli.run("submit", "abc", "-p", "max_new_tokens=3")
        assert submitted.code == 0, submitted.stderr
        request_id = submitted.stdout.strip()
        await subscriber.read_until_terminal(request_id)
    reply = await subscriber.redis.xrange(subscriber.key(request_id))
    ids = [entry_id for entry_id, _ in cast(list[tuple[str, dict[str, str]]], reply)]
    last_token, terminal_id = ids[-2], ids[-1]
    rest = await cli.run("tail", request_id, "--from-id", last_token, "--timeout", "20")
    assert rest.code == 0, rest
    assert rest.stderr_lines == [f"# {request_id}: length, 3 tokens (3 in the prompt)"]
    for after in (terminal_id, "1"):
        ended = await cli.run("tail", request_id, "--from-id", after, "--timeout", "20")
        assert ended.code == 0, ended
        no_traceback(ended)
        assert ended.stdout == ""
        assert ended.stderr_lines == [
            f"# {request_id}: ended at or before entry {after}, nothing after it"
        ]


async def test_submit_reads_the_prompt_from_stdin(run_worker: WorkerFactory, cli: Cli) -> None:
    async with run_worker():
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "trtllm_worker",
            "submit",
            "-",
            "-p",
            "max_new_tokens=4",
            "--follow",
            env=cli.env,
            cwd=cli.cwd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(b"xy"), 30)
    assert process.returncode == 0, stderr
    assert stdout == b"xyxy\n"


async def test_cancel_command(
    run_worker: WorkerFactory, cli: Cli, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker(echo_step_ms=10):
        await producer.publish(
            {"request_id": request_id, "inputs": "ab", "parameters": {"max_new_tokens": 2000}}
        )
        await subscriber.first_entry(request_id)
        result = await cli.run("cancel", request_id)
        assert result.code == 0, result.stderr
        entries = await subscriber.read_until_terminal(request_id)
    assert terminal(entries)["finish_reason"] == "cancelled"
    assert len(tokens(entries)) < 2000


async def test_job_error_exits_1_with_one_line(run_worker: WorkerFactory, cli: Cli) -> None:
    async with run_worker(echo_fault_token_id=ord("!")):
        result = await cli.run("submit", "boom!", "--follow", "--request-id", "boom-1")
    assert result.code == 1
    no_traceback(result)
    assert result.stderr_lines[0] == "# request boom-1"
    assert result.stderr_lines[1].startswith("trtllm-worker: request boom-1 failed: engine_error: ")
    assert len(result.stderr_lines) == 2


@pytest.mark.parametrize(
    ("args", "env", "code", "mentions"),
    [
        (["submit", "hi", "-p", "top_k=0"], {}, 2, "invalid job: parameters.top_k"),
        (["submit", "hi", "-p", "top_k"], {}, 2, "expected NAME=VALUE"),
        (["submit", "hi", "--metadata", "[1]"], {}, 2, "--metadata: must be a JSON object"),
        (["submit", "hi", "--deadline", "tomorrow"], {}, 2, "deadline"),
        (["tail", "not an id"], {}, 2, "request_id 'not an id'"),
        (["submit", "hi"], {"WORKER_QUEUE_TYPE": "bogus"}, 2, "WORKER_QUEUE_TYPE"),
        (["submit", "hi"], {"WORKER_AMQP_URL": UNREACHABLE_AMQP}, 69, "cannot connect to Rabb"),
        (["cancel", "r1"], {"WORKER_AMQP_URL": UNREACHABLE_AMQP}, 69, "cannot connect to Rabb"),
        (["tail", "r1"], {"WORKER_REDIS_URL": UNREACHABLE_REDIS}, 69, "cannot connect to Redis"),
        (["dead-letters"], {"WORKER_AMQP_URL": UNREACHABLE_AMQP}, 69, "cannot connect to Rabb"),
        (["submit", "hi"], {}, 69, "no queue named"),
        (["tail", "never-submitted", "--timeout", "0.3"], {}, 75, "has not ended within 0.3s"),
    ],
    ids=[
        "invalid-job",
        "bad-param",
        "bad-metadata",
        "bad-deadline",
        "bad-request-id",
        "bad-setting",
        "submit-broker-down",
        "cancel-broker-down",
        "tail-redis-down",
        "dead-letters-broker-down",
        "no-queue",
        "timeout",
    ],
)
async def test_errors_are_one_line_and_an_exit_code(
    cli: Cli, args: list[str], env: dict[str, str], code: int, mentions: str
) -> None:
    result = await cli.run(*args, **env)
    assert result.code == code, result
    no_traceback(result)
    assert result.stdout == ""
    assert len(result.stderr_lines) == 1, result.stderr
    assert result.stderr_lines[0].startswith("trtllm-worker: ")
    assert mentions in result.stderr
    assert "s3cret-pw" not in result.stderr


async def test_usage_prints_json_lines_per_tenant_and_day(
    run_worker: WorkerFactory, cli: Cli, subscriber: Subscriber
) -> None:
    async with run_worker(max_batch=1):
        for tenant in ("beta", "alpha", None):
            extra = ["--tenant", tenant] if tenant else []
            submitted = await cli.run("submit", "abc", "-p", "max_new_tokens=4", *extra)
            assert submitted.code == 0, submitted.stderr
            await subscriber.read_until_terminal(submitted.stdout.strip())
    result = await cli.run("usage")
    assert result.code == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    day = lines[0]["day"]
    assert lines == [
        {"tenant": t, "day": day, "jobs": 1, "input_tokens": 3, "generated_tokens": 4}
        for t in ("-", "alpha", "beta")
    ]  # sorted by day, then tenant
    only = await cli.run("usage", "--tenant", "beta", "--since", day)
    assert [json.loads(line)["tenant"] for line in only.stdout.splitlines()] == ["beta"]
    later = (date.fromisoformat(day) + timedelta(days=1)).isoformat()
    assert (await cli.run("usage", "--since", later)).stdout == ""
    bad = await cli.run("usage", "--since", "tomorrow")
    assert bad.code == 2
    assert bad.stderr_lines == ["trtllm-worker: --since 'tomorrow': expected a day as YYYY-MM-DD"]


async def test_usage_errors_exit_2(cli: Cli) -> None:
    result = await cli.run("tail")  # no request id
    assert result.code == 2
    assert "usage:" in result.stderr
    no_traceback(result)


async def test_dead_letters_listed_then_requeued(
    run_worker: WorkerFactory, cli: Cli, producer: Producer, subscriber: Subscriber
) -> None:
    fixable, invalid = rid(), rid()
    async with run_worker(max_input_tokens=4):
        await producer.publish({"request_id": invalid, "inputs": "hi", "parameters": {"top_p": 2}})
        await producer.publish({"request_id": fixable, "inputs": "abcdefgh"})
        await subscriber.read_until_terminal(fixable)
    # stopped: both are settled in the dead-letter queue
    listed = await cli.run("dead-letters")
    assert listed.code == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert len(lines) == 2
    invalid_line = f"{invalid} invalid_request: parameters.top_p: Input should be less than"
    assert sum(line.startswith(invalid_line) for line in lines) == 1, lines
    assert sum(line.startswith(f"{fixable} input_too_long: ") for line in lines) == 1, lines
    assert listed.stderr_lines == [f"# 2 dead letters in '{cli.env['WORKER_QUEUE']}.dead'"]
    again = await cli.run("dead-letters")
    assert again.stdout == listed.stdout, "listing leaves them in place, in order"

    only = await cli.run("dead-letters", "--request-id", fixable, "missing-1")
    assert only.code == 1
    assert only.stdout.splitlines() == [x for x in lines if x.startswith(fixable)]
    assert only.stderr_lines[-1].startswith("trtllm-worker: no dead letter of request missing-1")

    async with run_worker():
        requeued = await cli.run("dead-letters", "--requeue", "--request-id", fixable)
        assert requeued.code == 0, requeued.stderr
        assert requeued.stdout.startswith(f"requeued {fixable} input_too_long: ")
        entries = await subscriber.read_until_terminal(fixable)
    done = terminal(entries)
    assert done["event"] == "done"
    assert done["generated_text"].startswith("abcdefgh")
    left = await cli.run("dead-letters")
    assert left.stdout.splitlines() == [x for x in lines if x.startswith(invalid)]


# -- check ------------------------------------------------------------------------------


def problems(result: Result) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("problem ")]


async def test_check_lists_the_lora_adapters_or_the_folder_that_does_not_load(
    cli: Cli, tmp_path: Path
) -> None:
    loras = tmp_path / "loras"
    write_adapter(loras, "sql", rank=16)
    write_adapter(loras, "chat")
    result = await cli.run("check", WORKER_LORA_DIR=str(loras))
    assert result.code == 0, result.stdout
    line = next(x for x in result.stdout.splitlines() if "LoRA adapters" in x)
    assert line == (
        f"ok LoRA adapters in {loras}: chat (id {adapter_id('chat')}, rank 8), "
        f"sql (id {adapter_id('sql')}, rank 16)"
    )
    write_adapter(loras, "broken", weights=None)
    result = await cli.run("check", WORKER_LORA_DIR=str(loras))
    assert result.code != 0
    assert problems(result) == [
        f"problem invalid setting WORKER_LORA_DIR: adapter folder {loras / 'broken'}: no "
        "weights (adapter_model.safetensors or adapter_model.bin)"
    ]


async def test_check_passes_against_the_real_services(run_worker: WorkerFactory, cli: Cli) -> None:
    before = await cli.run("check")
    assert before.code == 0, before.stdout
    assert "not declared yet" in before.stdout
    async with run_worker():
        result = await cli.run("check")
    assert result.code == 0, result.stdout
    no_traceback(result)
    lines = result.stdout.splitlines()
    assert all(line.startswith("ok ") for line in lines), lines
    queue = cli.env["WORKER_QUEUE"]
    assert f"ok queue '{queue}': quorum, 0 messages, 1 consumers" in lines
    assert any(line.startswith("ok RabbitMQ ") for line in lines)
    assert any(line.startswith("ok Redis ") for line in lines)
    assert any(line.startswith("ok tokenizer built-in byte-level") for line in lines)
    assert any(line.startswith("ok engine echo") for line in lines)


async def test_check_reports_an_unreachable_broker(cli: Cli) -> None:
    result = await cli.run("check", WORKER_AMQP_URL=UNREACHABLE_AMQP)
    assert result.code == 1
    no_traceback(result)
    assert len(problems(result)) == 1, result.stdout
    assert problems(result)[0].startswith("problem RabbitMQ: cannot connect to RabbitMQ at ")
    assert "s3cret-pw" not in result.stdout
    assert result.stderr == ""
    assert any(line.startswith("ok Redis") for line in result.stdout.splitlines())


async def test_check_reports_every_problem_one_line_each(cli: Cli, tmp_path: Path) -> None:
    result = await cli.run(
        "check",
        WORKER_AMQP_URL=UNREACHABLE_AMQP,
        WORKER_REDIS_URL=UNREACHABLE_REDIS,
        WORKER_TOKENIZER=str(tmp_path / "no-such-tokenizer.json"),
        WORKER_ENGINE="trtllm",
        WORKER_MODEL=str(tmp_path / "no-such-model"),
        WORKER_AMQP_CA_FILE=str(tmp_path / "no-ca.pem"),
    )
    assert result.code == 1
    no_traceback(result)
    found = problems(result)
    expected = [
        "problem RabbitMQ: cannot connect",
        "problem Redis: cannot connect",
        "problem tokenizer: invalid setting WORKER_TOKENIZER",
        "problem WORKER_MODEL: ",
        "problem WORKER_AMQP_CA_FILE: ",
    ]
    if importlib.util.find_spec("tensorrt_llm") is None:
        expected.append("problem invalid setting WORKER_ENGINE: 'trtllm' needs TensorRT-LLM")
    for start in expected:
        assert sum(line.startswith(start) for line in found) == 1, (start, found)
    assert len(found) == len(expected), found
    assert "s3cret-pw" not in result.stdout


async def test_check_reports_a_queue_of_another_type(run_worker: WorkerFactory, cli: Cli) -> None:
    async with run_worker():
        pass  # declares quorum queues
    result = await cli.run("check", WORKER_QUEUE_TYPE="classic")
    assert result.code == 1
    found = problems(result)
    assert len(found) == 2, result.stdout
    assert all("WORKER_QUEUE_TYPE" in line for line in found)
    assert found[0].startswith(f"problem queue '{cli.env['WORKER_QUEUE']}' exists with other")


async def test_submit_a_chat_job_with_stop_ids_and_a_grammar(
    run_worker: WorkerFactory,
    cli: Cli,
    subscriber: Subscriber,
    sentencepiece_model: Path,
    tmp_path: Path,
) -> None:
    messages = tmp_path / "chat.json"
    messages.write_text('[{"role": "user", "content": "Say hi"}]')
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    chat_id, stop_id, bad_id = rid(), rid(), rid()
    last = str(load_tokenizer(sentencepiece_model, None).tokenizer.encode("a b c").ids[-1])
    async with run_worker(tokenizer=sentencepiece_model):
        chat = await cli.run(
            "submit", "--messages", str(messages), "--grammar", str(schema),
            "--request-id", chat_id, "-p", "max_new_tokens=6", "--follow",
            WORKER_TOKENIZER=str(sentencepiece_model),
        )  # fmt: skip
        stop = await cli.run(
            "submit", "a b c", "--stop-token-id", last, "--regex", "[a-z]+",
            "--request-id", stop_id, "--follow", WORKER_TOKENIZER=str(sentencepiece_model),
        )  # fmt: skip
        bad = await cli.run(
            "submit", "--messages", str(schema), "--request-id", bad_id,
            WORKER_TOKENIZER=str(sentencepiece_model),
        )  # fmt: skip
    assert chat.code == 0, chat.stderr
    done = terminal(await subscriber.entries(chat_id))
    assert chat.stdout == done["generated_text"] + "\n"
    assert done["generated_text"].startswith("[INST] Say")
    assert stop.code == 0, stop.stderr
    stopped = terminal(await subscriber.entries(stop_id))
    assert stopped["finish_reason"] == "stop_sequence"
    assert tokens(await subscriber.entries(stop_id))[-1]["token_id"] == last
    assert bad.code == 2
    assert "--messages" in bad.stderr
    assert "list of objects" in bad.stderr
    no_traceback(bad)


async def test_submit_refuses_a_prompt_and_messages_together(cli: Cli, tmp_path: Path) -> None:
    messages = tmp_path / "chat.json"
    messages.write_text('[{"role": "user", "content": "hi"}]')
    both = await cli.run("submit", "hi", "--messages", str(messages))
    neither = await cli.run("submit")
    for result in (both, neither):
        assert result.code == 2
        assert "either a prompt or --messages" in result.stderr
        no_traceback(result)


async def test_check_reports_the_chat_template_and_guided_decoding(
    cli: Cli, sentencepiece_model: Path
) -> None:
    result = await cli.run("check", WORKER_TOKENIZER=str(sentencepiece_model))
    lines = result.stdout.splitlines()
    assert f"ok chat template from {sentencepiece_model / 'tokenizer_config.json'}" in lines
    assert "ok guided decoding xgrammar: grammars checked with llguidance" in lines
    plain = await cli.run("check", WORKER_GUIDED_DECODING="none")
    assert "ok chat template: none (jobs with messages are refused)" in plain.stdout
    assert "ok guided decoding: none (jobs with a grammar are refused)" in plain.stdout


async def test_submit_continues_the_trace_of_traceparent(
    cli: Cli, amqp_channel: aio_pika.abc.AbstractChannel, names: dict[str, str]
) -> None:
    """TRACEPARENT/TRACESTATE (OpenTelemetry's environment carrier) make the caller's
    span the job's parent; the message also says when it was published."""
    queue = await amqp_channel.declare_queue(
        names["queue"], durable=True, arguments={"x-queue-type": "quorum"}
    )
    traceparent = f"00-{'ab' * 16}-{'cd' * 8}-01"
    before = int(time.time() * 1000)
    result = await cli.run("submit", "hi", TRACEPARENT=traceparent, TRACESTATE="ci=1")
    assert result.code == 0, result.stderr
    message = await queue.get(no_ack=True)
    headers = message.headers or {}
    assert (headers["traceparent"], headers["tracestate"]) == (traceparent, "ci=1")
    published = headers["timestamp_in_ms"]
    assert isinstance(published, int)
    assert before <= published <= int(time.time() * 1000)
    assert message.timestamp is not None


async def test_submit_refuses_a_malformed_traceparent(cli: Cli) -> None:
    result = await cli.run("submit", "hi", TRACEPARENT="00-not-a-trace-01")
    assert result.code == 2
    assert result.stderr.strip().endswith("TRACEPARENT: not a W3C traceparent: '00-not-a-trace-01'")
    no_traceback(result)
