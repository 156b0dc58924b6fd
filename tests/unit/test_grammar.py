"""Structured output at intake: a job's grammar is compiled before it takes an engine
slot, by the configured backend's library where installed, else by llguidance; one the
engine would reject fails naming `grammar`, and compiled grammars are cached."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from trtllm_worker.config import Settings
from trtllm_worker.contract.errors import InvalidJob
from trtllm_worker.contract.job import Job, JsonGrammar, RegexGrammar
from trtllm_worker.pipeline import grammar as grammar_module
from trtllm_worker.pipeline.grammar import compile_grammar, compiler_name
from trtllm_worker.pipeline.intake import prepare_input
from trtllm_worker.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name"],
}


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    grammar_module._check.cache_clear()


def test_a_json_schema_compiles_to_its_canonical_text() -> None:
    compiled = compile_grammar(JsonGrammar(type="json", value=SCHEMA), "llguidance")
    assert compiled.kind == "json"
    assert compiled.text.startswith('{"properties":')  # sorted keys, no spaces


def test_a_regex_compiles() -> None:
    compiled = compile_grammar(RegexGrammar(type="regex", value=r"\d{3}-[a-z]+"), "llguidance")
    assert (compiled.kind, compiled.text) == ("regex", r"\d{3}-[a-z]+")


@pytest.mark.parametrize(
    ("grammar", "mentions"),
    [
        (RegexGrammar(type="regex", value="[a-z"), "unclosed character class"),
        (JsonGrammar(type="json", value={"type": "bogus"}), "bogus"),
        (JsonGrammar(type="json", value={"type": "object", "properties": 3}), "properties"),
    ],
)
def test_a_grammar_that_does_not_compile_names_grammar(
    grammar: JsonGrammar | RegexGrammar, mentions: str
) -> None:
    with pytest.raises(InvalidJob) as caught:
        compile_grammar(grammar, "llguidance", "r1")
    assert caught.value.message.startswith("parameters.grammar: ")
    assert mentions in caught.value.message
    assert "\n" not in caught.value.message
    assert caught.value.request_id == "r1"


def test_guided_decoding_none_refuses_a_grammar() -> None:
    with pytest.raises(InvalidJob, match="WORKER_GUIDED_DECODING=none"):
        compile_grammar(RegexGrammar(type="regex", value="a+"), "none")


def test_compiled_grammars_are_cached() -> None:
    grammar = JsonGrammar(type="json", value=SCHEMA)
    compile_grammar(grammar, "llguidance")
    compile_grammar(JsonGrammar(type="json", value=dict(reversed(SCHEMA.items()))), "llguidance")
    info = grammar_module._check.cache_info()
    assert (info.misses, info.hits) == (1, 1)  # the same schema, however its keys are ordered


def test_xgrammar_is_used_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorRT-LLM's image has xgrammar: with the xgrammar backend its own compiler
    decides (a stand-in module here: xgrammar needs torch, which the test environment
    must not pull in), and its message reaches the job."""
    calls: list[tuple[str, str]] = []

    class Grammar:
        @staticmethod
        def from_json_schema(text: str) -> None:
            calls.append(("json", text))

        @staticmethod
        def from_regex(text: str) -> None:
            calls.append(("regex", text))
            raise RuntimeError("xgrammar: bad regex\n at 1")

    fake: Any = types.ModuleType("xgrammar")
    fake.Grammar = Grammar
    monkeypatch.setitem(sys.modules, "xgrammar", fake)
    assert compiler_name("xgrammar") == "xgrammar"
    assert compiler_name("llguidance") == "llguidance"
    compile_grammar(JsonGrammar(type="json", value=SCHEMA), "xgrammar")
    with pytest.raises(InvalidJob, match=r"parameters\.grammar: xgrammar: bad regex at 1"):
        compile_grammar(RegexGrammar(type="regex", value="a+"), "xgrammar")
    assert [kind for kind, _ in calls] == ["json", "regex"]


def test_without_xgrammar_the_xgrammar_backend_is_checked_by_llguidance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import fails
    assert compiler_name("xgrammar") == "llguidance"


def test_intake_compiles_the_jobs_grammar() -> None:
    info = load_tokenizer(None, None)
    job = Job.model_validate(
        {
            "request_id": "g1",
            "inputs": "x",
            "parameters": {"grammar": {"type": "json", "value": SCHEMA}},
        }
    )
    prepared = prepare_input(job, info, Settings(_env_file=None))
    assert prepared.grammar is not None
    assert prepared.grammar.kind == "json"
    bad = Job.model_validate(
        {
            "request_id": "g2",
            "inputs": "x",
            "parameters": {"grammar": {"type": "regex", "value": "("}},
        }
    )
    with pytest.raises(InvalidJob, match=r"^parameters\.grammar: "):
        prepare_input(bad, info, Settings(_env_file=None))
