"""`messages` → prompt text, rendered with the model's chat template exactly as Hugging
Face transformers' `apply_chat_template` renders it (`utils/chat_template_utils.py`):
a sandboxed Jinja environment with `trim_blocks`, `lstrip_blocks` and `loopcontrols`,
a `tojson` that does not escape HTML, `raise_exception`, `strftime_now`, the
`{% generation %}` tag, the named special tokens as variables, `add_generation_prompt`
true, `tools`, and the job's `chat_template_kwargs` (which win over special tokens).
Templates come from untrusted model repositories: the sandbox is immutable, and
namespaces refuse underscore names, as transformers' do."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trtllm_worker.contract.errors import ConfigError, InvalidJob

TEMPLATE_CACHE = 16
"""Compiled templates kept per worker (a worker has one model, so one or two)."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` renders its body: transformers uses it to
    mark assistant tokens for training masks; serving needs only the text."""

    tags = {"generation"}  # noqa: RUF012  (jinja's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
            lineno
        )

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without the class's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


@lru_cache(maxsize=TEMPLATE_CACHE)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template, cached. Raises `jinja2.TemplateSyntaxError`."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment.from_string(source)


def check_template(source: str, origin: str) -> None:
    """At start: a template that does not compile stops the worker with one line."""
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(
            f"invalid chat template {origin}: line {exc.lineno}: {exc.message}"
        ) from None


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    special_tokens: Mapping[str, str],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    request_id: str | None = None,
) -> str:
    """The conversation as prompt text. Raises `InvalidJob` naming `messages` with the
    template's own message when the model has no template or the template refuses."""
    if template is None:
        raise InvalidJob(
            "messages: the model has no chat template (set WORKER_CHAT_TEMPLATE, or send inputs)",
            request_id=request_id,
        )
    chat = [{key: value for key, value in m.items() if value is not None} for m in messages]
    variables: dict[str, Any] = {**special_tokens, **(template_kwargs or {})}
    try:
        return compile_template(template).render(
            messages=chat,
            tools=None if tools is None else [dict(t) for t in tools],
            documents=None,
            add_generation_prompt=True,
            **variables,
        )
    except jinja2.TemplateError as exc:
        message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        raise InvalidJob(
            f"messages: the chat template refused: {message}", request_id=request_id
        ) from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as exc:
        raise InvalidJob(
            f"messages: the chat template failed: {type(exc).__name__}: {exc}",
            request_id=request_id,
        ) from None
