"""Chat jobs: `messages` rendered exactly as transformers' `apply_chat_template` renders
them, on real models' templates (tests/fixtures/chat_templates, sources in SOURCES.md),
and tokenized to the same ids; a template that refuses, or a model without one, is an
`invalid_request` carrying the template's own message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest

from tests.real_tokenizers import hf_tokenizer, template
from trtllm_worker.config import Settings
from trtllm_worker.contract.errors import ConfigError, InvalidJob
from trtllm_worker.contract.job import Job
from trtllm_worker.pipeline.chat import check_template, compile_template, render_chat
from trtllm_worker.pipeline.intake import prepare_input
from trtllm_worker.tokenizer import load_tokenizer

TEMPLATES = ["llama-3.1", "qwen2.5", "mistral-7b-instruct-v0.2", "gemma-2", "phi-3.5"]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Paris <b>"}},
            "required": ["city"],
        },
    },
}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one-turn": [{"role": "user", "content": "Hello, who are you?"}],
    "multi-turn": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 please \n with spaces  "},
    ],
    "system": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hi"},
    ],
}


@pytest.fixture(scope="module")
def reference(sentencepiece_model: Path) -> dict[str, Any]:
    return {name: hf_tokenizer(sentencepiece_model, template(name)) for name in TEMPLATES}


def hf_render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str | Exception:
    try:
        text: str = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except jinja2.TemplateError as exc:
        return exc
    return text


def our_render(name: str, messages: list[dict[str, Any]], **kwargs: Any) -> str | Exception:
    try:
        return render_chat(
            template(name),
            messages,
            special_tokens=SPECIAL,
            tools=kwargs.pop("tools", None),
            template_kwargs=kwargs,
        )
    except InvalidJob as exc:
        return exc


def assert_same(ours: str | Exception, theirs: str | Exception) -> None:
    if isinstance(theirs, Exception):
        assert isinstance(ours, InvalidJob), ours
        assert str(theirs) in ours.message  # the template's own message
        assert ours.message.startswith("messages: ")
    else:
        assert ours == theirs


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", TEMPLATES)
def test_rendering_equals_transformers(
    reference: dict[str, Any], name: str, conversation: str
) -> None:
    messages = CONVERSATIONS[conversation]
    assert_same(our_render(name, messages), hf_render(reference[name], messages))


def test_the_fixtures_cover_refusals(reference: dict[str, Any]) -> None:
    """At least one real template refuses a conversation (Gemma: no system role), so
    the equality above covers the error path too."""
    refused = hf_render(reference["gemma-2"], CONVERSATIONS["system"])
    assert isinstance(refused, jinja2.TemplateError)
    assert isinstance(our_render("gemma-2", CONVERSATIONS["system"]), InvalidJob)


@pytest.mark.parametrize("name", ["llama-3.1", "qwen2.5"])
def test_tools_render_as_transformers(reference: dict[str, Any], name: str) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ours = our_render(name, messages, tools=[WEATHER_TOOL])
    assert_same(ours, hf_render(reference[name], messages, tools=[WEATHER_TOOL]))
    assert isinstance(ours, str)
    assert "get_weather" in ours
    assert "Paris <b>" in ours  # tojson does not escape HTML


def test_tool_calls_and_results_render_as_transformers(reference: dict[str, Any]) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1"},
    ]
    ours = our_render("qwen2.5", messages, tools=[WEATHER_TOOL])
    assert_same(ours, hf_render(reference["qwen2.5"], messages, tools=[WEATHER_TOOL]))


def test_template_kwargs_reach_the_template_and_win_over_special_tokens(
    reference: dict[str, Any],
) -> None:
    messages = CONVERSATIONS["one-turn"]
    kwargs = {"date_string": "03 Dec 2026"}
    ours = our_render("llama-3.1", messages, **kwargs)
    assert_same(ours, hf_render(reference["llama-3.1"], messages, **kwargs))
    assert "03 Dec 2026" in str(ours)
    custom = "{{ bos_token }}{{ messages[0]['content'] }}"
    rendered = render_chat(
        custom, messages, special_tokens=SPECIAL, template_kwargs={"bos_token": "<B>"}
    )
    assert rendered == "<B>Hello, who are you?"


def test_strftime_now_and_loop_controls(
    reference: dict[str, Any], sentencepiece_model: Path
) -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m['content'] }}{% endfor %} {{ strftime_now('%Y') }}"
        "{% generation %}!{% endgeneration %}"
    )
    messages = CONVERSATIONS["multi-turn"]
    theirs = hf_render(hf_tokenizer(sentencepiece_model, source), messages)
    assert render_chat(source, messages, special_tokens=SPECIAL) == theirs


def test_the_sandbox_refuses_what_transformers_refuses() -> None:
    escape = "{{ ''.__class__.__mro__ }}"
    with pytest.raises(InvalidJob, match="messages: "):
        render_chat(escape, CONVERSATIONS["one-turn"], special_tokens=SPECIAL)
    namespace = "{% set ns = namespace(_x=1) %}{{ ns }}"
    with pytest.raises(InvalidJob, match="underscore"):
        render_chat(namespace, CONVERSATIONS["one-turn"], special_tokens=SPECIAL)


def test_a_model_without_a_template_refuses_messages() -> None:
    with pytest.raises(InvalidJob, match="messages: the model has no chat template"):
        render_chat(None, CONVERSATIONS["one-turn"], special_tokens=SPECIAL)


def test_templates_are_compiled_once() -> None:
    source = template("qwen2.5")
    assert compile_template(source) is compile_template(source)


def test_a_template_that_does_not_compile_stops_the_worker_at_start() -> None:
    with pytest.raises(ConfigError, match=r"invalid chat template t\.jinja: line 1"):
        check_template("{% for %}", "t.jinja")


def test_intake_tokenizes_as_apply_chat_template(
    sentencepiece_model: Path, reference: dict[str, Any]
) -> None:
    """The prompt ids of a chat job equal transformers' `apply_chat_template(...,
    tokenize=True)`: the template writes `<s>` itself, no second BOS is added."""
    info = load_tokenizer(sentencepiece_model, None)
    settings = Settings(_env_file=None)
    messages = CONVERSATIONS["multi-turn"]
    job = Job.model_validate({"request_id": "c1", "messages": messages})
    prepared = prepare_input(job, info, settings)
    theirs = reference["mistral-7b-instruct-v0.2"].apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True
    )
    ids = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert prepared.prompt_ids == list(ids)
    bos = info.tokenizer.token_to_id("<s>")
    assert bos is not None
    assert prepared.prompt_ids.count(bos) == 1


def test_worker_chat_template_overrides_the_models(
    sentencepiece_model: Path, tmp_path: Path
) -> None:
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    info = load_tokenizer(sentencepiece_model, None, own)
    assert info.chat_template_source == str(own)
    job = Job.model_validate({"request_id": "c2", "messages": CONVERSATIONS["one-turn"]})
    prepared = prepare_input(job, info, Settings(_env_file=None))
    assert info.tokenizer.decode(prepared.prompt_ids) == "[user] Hello, who are you?\n"


def test_chat_template_jinja_file_beats_tokenizer_config(
    sentencepiece_model: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (folder / name).write_bytes((sentencepiece_model / name).read_bytes())
    (folder / "chat_template.jinja").write_text("{{ messages | length }}")
    info = load_tokenizer(folder, None)
    assert info.chat_template == "{{ messages | length }}"
