"""OpenAI's response bodies for one job, from its stream entries: the whole answer (a
batch's output line, the gateway's reply when not streamed) and the streamed chunks
(the gateway). One place builds them, so a batch line and a gateway reply agree. Pure:
no connection, no clock."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from trtllm_worker.contract.openai import CHAT_COMPLETIONS

FINISH_REASONS: Final = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}
"""The contract's finish reasons as OpenAI names them (a cancelled job ends `stop`)."""

TokenText = Callable[[int], str]
"""A token id's text (the tokenizer's piece, decoded), for logprobs."""


class Logprob(NamedTuple):
    """One generated token with its log probability and the most likely alternatives."""

    token_id: int
    text: str
    """The text the token released in the stream (used when no tokenizer names it)."""
    logprob: float
    top: Sequence[tuple[int, float]]


def finish_reason(raw: object) -> str:
    return FINISH_REASONS.get(str(raw), "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_id(endpoint: str, suffix: str) -> str:
    """`chatcmpl-…` or `cmpl-…`, as OpenAI prefixes them."""
    return f"{'chatcmpl' if endpoint == CHAT_COMPLETIONS else 'cmpl'}-{suffix}"


def answer_body(
    endpoint: str,
    *,
    answer_id: str,
    created: int,
    model: str,
    done: Mapping[str, Any],
    logprobs: Sequence[Logprob] | None,
    token_text: TokenText | None = None,
) -> dict[str, Any]:
    """The whole answer (`chat.completion` or `text_completion`) from the job's `done`
    entry (`generated_text`, `finish_reason`, token counts); `logprobs` when the request
    asked for them."""
    text = str(done.get("generated_text", ""))
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(done.get("finish_reason"))}
    if endpoint == CHAT_COMPLETIONS:
        body: dict[str, Any] = {"id": answer_id, "object": "chat.completion"}
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = None if logprobs is None else chat_logprobs(logprobs, token_text)
    else:
        body = {"id": answer_id, "object": "text_completion"}
        choice["text"] = text
        choice["logprobs"] = None if logprobs is None else completion_logprobs(logprobs, token_text)
    prompt = int(done.get("input_tokens", 0))
    generated = int(done.get("generated_tokens", 0))
    body.update(created=created, model=model, choices=[choice], usage=usage(prompt, generated))
    return body


def chunk(
    endpoint: str,
    *,
    answer_id: str,
    created: int,
    model: str,
    text: str | None = None,
    first: bool = False,
    finish: str | None = None,
    logprobs: Sequence[Logprob] | None = None,
    text_offset: int = 0,
    with_usage: bool = False,
    token_text: TokenText | None = None,
) -> dict[str, Any]:
    """One streamed chunk (`chat.completion.chunk` or `text_completion`): `text` new
    text, `first` (chat) the one that names the role, `finish` the last choice chunk's
    reason. `with_usage`: the request asked for usage, so every chunk but the usage one
    carries `"usage": null`. `text_offset`: (completions, logprobs) where this chunk's
    text starts in the answer."""
    choice: dict[str, Any] = {"index": 0}
    if endpoint == CHAT_COMPLETIONS:
        body: dict[str, Any] = {"id": answer_id, "object": "chat.completion.chunk"}
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None or first:
            delta["content"] = text or ""
        choice["delta"] = delta
        choice["logprobs"] = chat_logprobs(logprobs, token_text) if logprobs else None
    else:
        body = {"id": answer_id, "object": "text_completion"}
        choice["text"] = text or ""
        choice["logprobs"] = (
            completion_logprobs(logprobs, token_text, text_offset) if logprobs else None
        )
    choice["finish_reason"] = finish
    body.update(created=created, model=model, choices=[choice])
    if with_usage:
        body["usage"] = None
    return body


def usage_chunk(
    endpoint: str, *, answer_id: str, created: int, model: str, done: Mapping[str, Any]
) -> dict[str, Any]:
    """The chunk `stream_options.include_usage` asks for: no choices, the usage."""
    kind = "chat.completion.chunk" if endpoint == CHAT_COMPLETIONS else "text_completion"
    prompt = int(done.get("input_tokens", 0))
    generated = int(done.get("generated_tokens", 0))
    return {
        "id": answer_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt, generated),
    }


def _piece(token_id: int, text: str, token_text: TokenText | None) -> str:
    return token_text(token_id) if token_text is not None else text


def chat_logprobs(tokens: Sequence[Logprob], token_text: TokenText | None = None) -> dict[str, Any]:
    content = []
    for token in tokens:
        piece = _piece(token.token_id, token.text, token_text)
        content.append(
            {
                "token": piece,
                "logprob": token.logprob,
                "bytes": list(piece.encode()),
                "top_logprobs": [
                    {"token": (p := _piece(t, "", token_text)), "logprob": lp,
                     "bytes": list(p.encode())}
                    for t, lp in token.top
                ],
            }
        )  # fmt: skip
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokens: Sequence[Logprob], token_text: TokenText | None = None, offset: int = 0
) -> dict[str, Any]:
    pieces: list[str] = []
    logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
        pieces.append(_piece(token.token_id, token.text, token_text))
        logprobs.append(token.logprob)
        tops.append({_piece(t, "", token_text): lp for t, lp in token.top})
    return {
        "tokens": pieces,
        "token_logprobs": logprobs,
        "top_logprobs": tops if any(tops) else None,
        "text_offset": offsets,
    }
