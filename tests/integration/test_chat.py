"""Real-checkpoint jobs end to end on the echo engine with a real model folder (Mistral
7B's tokenizer and chat template): chat jobs, special tokens, stop token ids, grammars;
and every malformed chat or grammar job dead-lettered with a reason naming its field,
the worker unaffected."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Producer, Subscriber, WorkerFactory, terminal, tokens
from tests.real_tokenizers import hf_tokenizer

CONVERSATION = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
]


def rid() -> str:
    return f"chat-{uuid.uuid4().hex[:10]}"


async def test_a_chat_job_runs_on_the_models_template(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber, sentencepiece_model: Path
) -> None:
    request_id, keeping = rid(), rid()
    expected_ids = hf_tokenizer(sentencepiece_model).apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=True
    )
    expected_ids = list(
        expected_ids["input_ids"] if hasattr(expected_ids, "keys") else expected_ids
    )
    async with run_worker(tokenizer=sentencepiece_model):
        for job_id, skip in ((request_id, True), (keeping, False)):
            await producer.publish(
                {
                    "request_id": job_id,
                    "messages": CONVERSATION,
                    "parameters": {"max_new_tokens": 12, "skip_special_tokens": skip},
                }
            )
        entries = await subscriber.read_until_terminal(request_id)
        kept = await subscriber.read_until_terminal(keeping)
    done = terminal(entries)
    assert done["event"] == "done", done
    assert int(done["input_tokens"]) == len(expected_ids)
    # the echo engine repeats the prompt: its first token is the template's <s>
    assert [int(e["token_id"]) for e in tokens(entries)] == expected_ids[:12]
    assert tokens(entries)[0]["text"] == ""
    assert done["generated_text"] == "".join(e["text"] for e in tokens(entries))
    assert "<s>" not in done["generated_text"]
    assert done["generated_text"].startswith("[INST] Name a colour. [/INST]")
    assert terminal(kept)["generated_text"].startswith("<s>[INST] Name a colour.")


async def test_stop_token_ids_end_the_job_even_with_ignore_eos(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker():
        await producer.publish(
            {
                "request_id": request_id,
                "inputs": "abc",
                "parameters": {"stop_token_ids": [99], "ignore_eos": True},
            }
        )
        entries = await subscriber.read_until_terminal(request_id)
    done = terminal(entries)
    assert (done["finish_reason"], done["generated_text"]) == ("stop_sequence", "ab")
    assert [e["text"] for e in tokens(entries)] == ["a", "b", ""]
    assert tokens(entries)[-1]["token_id"] == "99"


async def test_a_grammar_job_runs_on_the_echo_engine(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    """The echo engine checks the grammar at intake, then ignores it."""
    request_id = rid()
    grammar = {
        "type": "json",
        "value": {"type": "object", "properties": {"a": {"type": "integer"}}},
    }
    async with run_worker():
        await producer.publish(
            {"request_id": request_id, "inputs": "abc", "parameters": {"grammar": grammar}}
        )
        entries = await subscriber.read_until_terminal(request_id)
    assert terminal(entries)["event"] == "done"


BAD_JOBS: list[Any] = [
    pytest.param({"messages": "hi"}, "messages", id="messages-not-a-list"),
    pytest.param({"messages": []}, "messages", id="messages-empty"),
    pytest.param(
        {"messages": [{"role": "user", "content": "x"}] * 257}, "messages", id="257-messages"
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": 1}]}, "messages.0.content", id="content-int"
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "x", "lang": "en"}]},
        "messages.0.lang",
        id="unknown-key",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "x"}], "tools": "get_weather"},
        "tools",
        id="tools",
    ),
    pytest.param(
        {"messages": [{"role": "system", "content": "x"}]},
        "Conversation roles must alternate",
        id="template-refuses",
    ),
    pytest.param(
        {"inputs": "x", "parameters": {"grammar": {"type": "lark", "value": "start: x"}}},
        "parameters.grammar",
        id="grammar-unknown-type",
    ),
    pytest.param(
        {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(a"}}},
        "parameters.grammar",
        id="grammar-does-not-compile",
    ),
    pytest.param(
        {"inputs": "x", "parameters": {"stop_token_ids": [32000]}},
        "parameters.stop_token_ids",
        id="stop-id-outside-vocabulary",
    ),
]


@pytest.mark.parametrize(("fields", "mentions"), BAD_JOBS)
async def test_bad_chat_and_grammar_jobs_are_dead_lettered(
    run_worker: WorkerFactory,
    producer: Producer,
    subscriber: Subscriber,
    sentencepiece_model: Path,
    fields: dict[str, Any],
    mentions: str,
) -> None:
    bad, good = rid(), rid()
    async with run_worker(tokenizer=sentencepiece_model):
        await producer.publish({"request_id": bad, **fields})
        dead = await producer.get_dead()
        error = terminal(await subscriber.read_until_terminal(bad))
        await producer.publish({"request_id": good, "inputs": "still here"})
        after = terminal(await subscriber.read_until_terminal(good))
    assert dead.headers is not None
    assert dead.headers["x-error-code"] == "invalid_request"
    assert mentions in str(dead.headers["x-error-message"])
    assert json.loads(dead.body)["request_id"] == bad
    assert (error["event"], error["code"]) == ("error", "invalid_request")
    assert mentions in error["message"]
    assert after["event"] == "done"  # the worker is unaffected


async def test_without_a_template_messages_are_refused(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker():  # the built-in tokenizer has no chat template
        await producer.publish({"request_id": request_id, "messages": CONVERSATION})
        error = terminal(await subscriber.read_until_terminal(request_id))
    assert error["code"] == "invalid_request"
    assert "no chat template" in error["message"]


async def test_guided_decoding_none_refuses_grammars(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber
) -> None:
    request_id = rid()
    async with run_worker(guided_decoding="none"):
        await producer.publish(
            {
                "request_id": request_id,
                "inputs": "x",
                "parameters": {"grammar": {"type": "regex", "value": "a+"}},
            }
        )
        error = terminal(await subscriber.read_until_terminal(request_id))
    assert error["code"] == "invalid_request"
    assert "WORKER_GUIDED_DECODING=none" in error["message"]


async def test_worker_chat_template_setting(
    run_worker: WorkerFactory, producer: Producer, subscriber: Subscriber, tmp_path: Path
) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    request_id = rid()
    async with run_worker(chat_template=template):
        await producer.publish(
            {
                "request_id": request_id,
                "messages": [{"role": "user", "content": "hey"}],
                "parameters": {"max_new_tokens": 11},
            }
        )
        done = terminal(await subscriber.read_until_terminal(request_id))
    assert done["generated_text"] == "<user>hey<u"  # the echo of the rendered prompt
