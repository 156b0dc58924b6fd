"""Structured output: a job's `grammar` compiled at intake, so that one the engine
would reject fails there with `invalid_request` naming `grammar`, before it takes an
engine slot. It is compiled by the configured guided-decoding backend's own library
where that is installed (xgrammar comes with TensorRT-LLM's image), otherwise by
llguidance (a small wheel without dependencies). Compiled grammars are cached."""

from __future__ import annotations

import importlib
import json
from functools import lru_cache
from typing import Literal

from trtllm_worker.contract.errors import InvalidJob
from trtllm_worker.contract.job import JsonGrammar, RegexGrammar
from trtllm_worker.engine.base import Guide

GRAMMAR_CACHE = 256
Backend = Literal["xgrammar", "llguidance", "none"]


CompiledGrammar = Guide
"""What the engine is given: the kind and the grammar's text (a JSON Schema as JSON, or
a regular expression). TensorRT-LLM compiles it again for its vocabulary."""


def compiler_name(backend: Backend) -> str:
    """Which library checks grammars for this backend here (for `check` and logs)."""
    if backend == "none":
        return "none"
    if backend == "xgrammar" and _importable("xgrammar"):
        return "xgrammar"
    return "llguidance" if _importable("llguidance") else "none"


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def compile_grammar(
    grammar: JsonGrammar | RegexGrammar, backend: Backend, request_id: str | None = None
) -> CompiledGrammar:
    """Compile (cached) or raise `InvalidJob` naming `parameters.grammar`."""
    if backend == "none":
        raise InvalidJob(
            "parameters.grammar: structured output is off on this worker "
            "(WORKER_GUIDED_DECODING=none)",
            request_id=request_id,
        )
    if isinstance(grammar, JsonGrammar):
        text = json.dumps(grammar.value, sort_keys=True, separators=(",", ":"))
        compiled = CompiledGrammar("json", text)
    else:
        compiled = CompiledGrammar("regex", grammar.value)
    error = _check(compiled, compiler_name(backend))
    if error:
        raise InvalidJob(f"parameters.grammar: {error}", request_id=request_id)
    return compiled


@lru_cache(maxsize=GRAMMAR_CACHE)
def _check(grammar: CompiledGrammar, library: str) -> str:
    """'' when `library` compiles the grammar, else its one-line reason."""
    if library == "xgrammar":
        return _check_xgrammar(grammar)
    if library == "llguidance":
        return _check_llguidance(grammar)
    return "no grammar compiler is installed (install llguidance)"


def _check_llguidance(grammar: CompiledGrammar) -> str:
    import llguidance

    try:
        if grammar.kind == "json":
            definition = llguidance.grammar_from("json_schema", grammar.text)
        else:
            definition = llguidance.grammar_from("regex", grammar.text)
        error: str = llguidance.LLMatcher.validate_grammar(definition)
    except (ValueError, RuntimeError) as exc:
        error = str(exc)
    return " ".join(error.split())


def _check_xgrammar(grammar: CompiledGrammar) -> str:
    import xgrammar

    try:
        if grammar.kind == "json":
            xgrammar.Grammar.from_json_schema(grammar.text)
        else:
            xgrammar.Grammar.from_regex(grammar.text)
    except (RuntimeError, ValueError) as exc:
        return " ".join(str(exc).split())
    return ""
