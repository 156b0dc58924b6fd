"""OpenAI request bodies (chat completions and completions) as job fields: the one mapping
that batch lines and the gateway share, so both accept and refuse the same requests.

Every body field OpenAI defines for these endpoints is mapped to a job field, accepted
because it changes no output (`user`, `metadata`, `store`, `service_tier`, `stream_options`
…), or refused with the field's name: none is dropped silently. The result is checked
once more as a job (`Job`), whose ranges (temperature above 0 after the mapping, seeds of
0 or more, …) apply as they do to any job."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

CHAT_COMPLETIONS: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
ENDPOINTS: Final = (CHAT_COMPLETIONS, COMPLETIONS)

NO_OUTPUT_EFFECT: Final = frozenset(
    {"model", "user", "metadata", "store", "service_tier", "stream_options", "safety_identifier",
     "prompt_cache_key", "parallel_tool_calls"}
)  # fmt: skip
"""Fields that change nothing a job generates: accepted and not passed on (`model` is
checked by the caller against the served model, where it has one)."""

_SHARED: Final = frozenset(
    {"max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty",
     "frequency_penalty", "logprobs", "n", "stream", "logit_bias"}
)  # fmt: skip
_CHAT_ONLY: Final = frozenset(
    {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
     "tool_choice"}
)  # fmt: skip
_COMPLETIONS_ONLY: Final = frozenset({"prompt", "echo", "best_of", "suffix"})

MAX_COMPLETIONS_LOGPROBS: Final = 5
"""OpenAI's bound on the completions endpoint's `logprobs` (a count there)."""


class UnsupportedRequest(ValueError):
    """A body the worker cannot run as asked: `param` names the OpenAI field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def job_fields(endpoint: str, body: Mapping[str, Any], *, stream: bool = False) -> dict[str, Any]:
    """The job message's fields (all but `request_id`) for one request `body` to
    `endpoint`. `stream`: whether the caller streams the answer (the gateway may; a batch
    line may not). Raises `UnsupportedRequest` naming the field."""
    if endpoint not in ENDPOINTS:
        raise UnsupportedRequest("url", f"must be {CHAT_COMPLETIONS} or {COMPLETIONS}")
    chat = endpoint == CHAT_COMPLETIONS
    known = NO_OUTPUT_EFFECT | _SHARED | (_CHAT_ONLY if chat else _COMPLETIONS_ONLY)
    for name in body:
        if name not in known:
            raise UnsupportedRequest(name, f"not supported on {endpoint}")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise UnsupportedRequest("model", "required, a string")
    if body.get("n") not in (None, 1):
        raise UnsupportedRequest("n", "only 1 is supported (one job per request)")
    if body.get("stream") and not stream:
        raise UnsupportedRequest("stream", "not here: the answer is not streamed")
    if body.get("logit_bias"):
        raise UnsupportedRequest("logit_bias", "not supported by the engines")
    fields = _chat(body) if chat else _completion(body)
    fields["parameters"] = {**_parameters(body, chat), **fields.get("parameters", {})}
    return fields


def _chat(body: Mapping[str, Any]) -> dict[str, Any]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UnsupportedRequest("messages", "required, a non-empty list")
    fields: dict[str, Any] = {"messages": [_message(i, m) for i, m in enumerate(messages)]}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise UnsupportedRequest("tools", "must be a list")
        fields["tools"] = tools
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        # forcing a call (or a named function) needs constrained decoding on the tool
        # schema, which the worker does not build: refused rather than ignored
        raise UnsupportedRequest("tool_choice", 'only "auto" or "none"')
    if choice == "none":
        fields.pop("tools", None)  # the model is told of no tools, so it calls none
    grammar = _response_format(body.get("response_format"))
    if grammar is not None:
        fields["parameters"] = {"grammar": grammar}
    return fields


def _message(index: int, message: object) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise UnsupportedRequest(where, "must be an object")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise UnsupportedRequest(f"{where}.role", "required, a string")
    out: dict[str, Any] = {
        # OpenAI's `developer` messages are its newer name for system messages; chat
        # templates know `system`
        "role": "system" if role == "developer" else role,
        "content": _content(f"{where}.content", message.get("content")),
    }
    for name in ("name", "tool_calls", "tool_call_id"):
        if message.get(name) is not None:
            out[name] = message[name]
    for name in message:
        if name not in {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}:
            raise UnsupportedRequest(f"{where}.{name}", "not supported")
    return out


def _content(where: str, content: object) -> str:
    """A message's text: a string, or text parts joined by newlines (as vLLM joins them);
    none (an assistant message with tool calls) is empty text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UnsupportedRequest(where, "must be a string or a list of text parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UnsupportedRequest(f"{where}[{i}]", f"only text parts are supported, not {kind}")
        text = part.get("text")
        if not isinstance(text, str):
            raise UnsupportedRequest(f"{where}[{i}].text", "required, a string")
        texts.append(text)
    return "\n".join(texts)


def _response_format(value: object) -> dict[str, Any] | None:
    """`json_schema` → the job's JSON grammar with that schema; `json_object` → any JSON
    object; `text` (or none) → unconstrained."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise UnsupportedRequest("response_format", "must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json", "value": {"type": "object"}}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise UnsupportedRequest("response_format.json_schema.schema", "required, an object")
        return {"type": "json", "value": schema}
    raise UnsupportedRequest(
        "response_format.type", 'must be "text", "json_object" or "json_schema"'
    )


def _completion(body: Mapping[str, Any]) -> dict[str, Any]:
    for name, neutral in (("echo", False), ("best_of", 1), ("suffix", None)):
        if body.get(name) not in (None, neutral):
            raise UnsupportedRequest(name, "not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        return {"inputs": prompt}
    if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        return {"input_ids": prompt}
    raise UnsupportedRequest(
        "prompt", "required: one non-empty string or one list of token ids (one prompt per line)"
    )


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parameters(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    params: dict[str, Any] = {}
    max_tokens = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        newer = body["max_completion_tokens"]
        if max_tokens is not None and max_tokens != newer:
            raise UnsupportedRequest("max_tokens", "differs from max_completion_tokens: give one")
        max_tokens = newer
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    temperature = body.get("temperature")
    if temperature is not None:
        if _is_number(temperature) and temperature == 0:
            params["do_sample"] = False  # OpenAI's 0: the most likely token every time
        else:
            params["temperature"] = temperature
    for name in ("top_p", "seed", "presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            params[name] = body[name]
    stop = body.get("stop")
    if isinstance(stop, str):
        params["stop"] = [stop]
    elif stop is not None:
        params["stop"] = stop
    params.update(_logprobs(body, chat))
    return params


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _logprobs(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """Chat: `logprobs` true asks for them, `top_logprobs` K (0-20) for the K most likely
    too. Completions: `logprobs` N (0-5) asks for them and, above 0, the N most likely."""
    logprobs = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if logprobs is None or logprobs is False:
            if top:
                raise UnsupportedRequest("top_logprobs", "only with logprobs: true")
            return {}
        if logprobs is not True:
            raise UnsupportedRequest("logprobs", "must be true or false")
        out: dict[str, Any] = {"return_logprobs": True}
        if top:
            out["top_logprobs"] = top
        return out
    if logprobs is None:
        return {}
    if not _is_token(logprobs) or not 0 <= logprobs <= MAX_COMPLETIONS_LOGPROBS:
        raise UnsupportedRequest(
            "logprobs", f"must be an integer from 0 to {MAX_COMPLETIONS_LOGPROBS}"
        )
    return {"return_logprobs": True, **({"top_logprobs": logprobs} if logprobs else {})}
