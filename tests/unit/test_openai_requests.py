"""OpenAI request bodies as jobs (`contract/openai.py`): what batch lines and the gateway
accept, how each field becomes a job field, and that every refusal names the field."""

from __future__ import annotations

from typing import Any

import pytest

from trtllm_worker.contract.job import Job
from trtllm_worker.contract.openai import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    UnsupportedRequest,
    job_fields,
)

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def as_job(endpoint: str, body: dict[str, Any]) -> Job:
    """The mapped fields as the worker would validate them."""
    return Job.model_validate({**job_fields(endpoint, body), "request_id": "r-1"})


def test_a_chat_body_with_every_mapped_field() -> None:
    body = {
        **CHAT,
        "max_completion_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": "END",
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logprobs": True,
        "top_logprobs": 3,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
        },
        "user": "u-1",
        "metadata": {"k": "v"},
    }
    job = as_job(CHAT_COMPLETIONS, body)
    params = job.parameters
    assert job.messages is not None
    assert [(m.role, m.content) for m in job.messages] == [("user", "Hi")]
    assert params.max_new_tokens == 64
    assert (params.temperature, params.top_p, params.seed) == (0.7, 0.9, 7)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.stop == ["END"]
    assert (params.return_logprobs, params.top_logprobs) == (True, 3)
    assert params.grammar is not None
    assert params.grammar.model_dump() == {"type": "json", "value": {"type": "object"}}


def test_a_completion_body_with_a_prompt_and_logprobs_as_a_count() -> None:
    body = {"model": "m", "prompt": "Once", "max_tokens": 5, "logprobs": 2, "stop": ["\n", "."]}
    job = as_job(COMPLETIONS, body)
    assert job.inputs == "Once"
    assert job.parameters.max_new_tokens == 5
    assert (job.parameters.return_logprobs, job.parameters.top_logprobs) == (True, 2)
    assert job.parameters.stop == ["\n", "."]
    zero = as_job(COMPLETIONS, {"model": "m", "prompt": "x", "logprobs": 0})
    assert (zero.parameters.return_logprobs, zero.parameters.top_logprobs) == (True, None)


@pytest.mark.parametrize(
    ("prompt", "field", "value"),
    [
        (["one prompt"], "inputs", "one prompt"),
        ([1, 2, 3], "input_ids", [1, 2, 3]),
        ([[4, 5]], "input_ids", [4, 5]),
    ],
)
def test_a_completion_prompt_in_each_of_openais_shapes(prompt: Any, field: str, value: Any) -> None:
    assert getattr(as_job(COMPLETIONS, {"model": "m", "prompt": prompt}), field) == value


def test_temperature_zero_is_greedy() -> None:
    job = as_job(CHAT_COMPLETIONS, {**CHAT, "temperature": 0})
    assert job.parameters.do_sample is False
    assert job.parameters.temperature is None


def test_text_parts_are_joined_and_developer_is_system() -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
    ]
    job = as_job(CHAT_COMPLETIONS, {"model": "m", "messages": messages})
    assert job.messages is not None
    assert [(m.role, m.content) for m in job.messages] == [
        ("system", "Be brief."),
        ("user", "a\nb"),
        ("assistant", ""),
    ]
    assert job.messages[2].tool_calls == [{"id": "c1", "type": "function"}]


def test_json_object_and_text_response_formats() -> None:
    json_object = as_job(CHAT_COMPLETIONS, {**CHAT, "response_format": {"type": "json_object"}})
    assert json_object.parameters.grammar is not None
    assert json_object.parameters.grammar.model_dump() == {
        "type": "json",
        "value": {"type": "object"},
    }
    text = as_job(CHAT_COMPLETIONS, {**CHAT, "response_format": {"type": "text"}})
    assert text.parameters.grammar is None


def test_tools_reach_the_template_unless_tool_choice_is_none() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert as_job(CHAT_COMPLETIONS, {**CHAT, "tools": tools}).tools == tools
    assert as_job(CHAT_COMPLETIONS, {**CHAT, "tools": tools, "tool_choice": "none"}).tools is None


@pytest.mark.parametrize(
    ("endpoint", "change", "param"),
    [
        (CHAT_COMPLETIONS, {"n": 2}, "n"),
        (CHAT_COMPLETIONS, {"stream": True}, "stream"),
        (CHAT_COMPLETIONS, {"logit_bias": {"5": 10}}, "logit_bias"),
        (CHAT_COMPLETIONS, {"tool_choice": "required"}, "tool_choice"),
        (CHAT_COMPLETIONS, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT_COMPLETIONS, {"logprobs": 3}, "logprobs"),
        (CHAT_COMPLETIONS, {"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
        (
            CHAT_COMPLETIONS,
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema.schema",
        ),
        (CHAT_COMPLETIONS, {"response_format": {"type": "yaml"}}, "response_format.type"),
        (CHAT_COMPLETIONS, {"audio": {}}, "audio"),
        (CHAT_COMPLETIONS, {"prompt": "x"}, "prompt"),
        (CHAT_COMPLETIONS, {"model": ""}, "model"),
        (CHAT_COMPLETIONS, {"messages": []}, "messages"),
        (
            CHAT_COMPLETIONS,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        (
            CHAT_COMPLETIONS,
            {"messages": [{"role": "user", "content": "x", "audio": 1}]},
            "messages[0].audio",
        ),
        (COMPLETIONS, {"messages": CHAT["messages"]}, "messages"),
        (COMPLETIONS, {"echo": True}, "echo"),
        (COMPLETIONS, {"best_of": 3}, "best_of"),
        (COMPLETIONS, {"suffix": "end"}, "suffix"),
        (COMPLETIONS, {"logprobs": 6}, "logprobs"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
        (COMPLETIONS, {"prompt": ""}, "prompt"),
    ],
)
def test_what_cannot_run_as_asked_is_refused_naming_the_field(
    endpoint: str, change: dict[str, Any], param: str
) -> None:
    base = dict(CHAT) if endpoint == CHAT_COMPLETIONS else {"model": "m", "prompt": "x"}
    with pytest.raises(UnsupportedRequest) as raised:
        job_fields(endpoint, {**base, **change})
    assert raised.value.param == param
    assert str(raised.value).startswith(f"{param}: ")


def test_another_endpoint_is_refused_as_the_url() -> None:
    with pytest.raises(UnsupportedRequest) as raised:
        job_fields("/v1/embeddings", {"model": "m", "input": "x"})
    assert raised.value.param == "url"


def test_the_gateway_may_stream() -> None:
    assert job_fields(CHAT_COMPLETIONS, {**CHAT, "stream": True}, stream=True)["messages"]


def test_ranges_are_the_jobs() -> None:
    """The mapping passes values on; the job's own checks refuse what is out of range
    (a negative seed, top_p 0), naming the job's field."""
    with pytest.raises(ValueError, match=r"parameters\.seed"):
        as_job(CHAT_COMPLETIONS, {**CHAT, "seed": -1})
    with pytest.raises(ValueError, match=r"parameters\.top_p"):
        as_job(CHAT_COMPLETIONS, {**CHAT, "top_p": 0})
