"""Token ids → text, incrementally, with stop sequences. Pure: no I/O, no clock.

`IncrementalDetokenizer` wraps tokenizers' `DecodeStream`, primed with the prompt's tail
so the first generated word keeps its leading space; it releases text only when a
character is complete. `StopGate` holds back the tail of the text that could still
become a stop sequence, so no part of a stop is ever released."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

log = logging.getLogger(__name__)

PRIME_TOKENS = 16
"""Prompt tokens the decoder is primed with: enough context for any decoder's spacing
rules, few enough that priming costs nothing."""

_FLUSH_CONTEXT = 4
_MAX_CHAR_TOKENS = 4  # a UTF-8 character is at most 4 bytes, so at most 4 byte tokens


def _invalid_prefix(exc: Exception) -> bool:
    return str(exc).startswith("Invalid prefix encountered")


class IncrementalDetokenizer:
    """One request's decoder. `step` returns the text a token completes ('' if none)."""

    __slots__ = ("_pending", "_recent", "_skip", "_stream", "_tokenizer")

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = self._whole_characters(prompt_ids[-PRIME_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._recent: deque[int] = deque(context[-_FLUSH_CONTEXT:], maxlen=_FLUSH_CONTEXT)
        self._pending: list[int] = []

    def _whole_characters(self, ids: Sequence[int]) -> list[int]:
        """`ids` without trailing ids that end inside a character: a context whose text
        ends in U+FFFD would leak into the first released text."""
        context = list(ids)
        for _ in range(_MAX_CHAR_TOKENS):
            if not context:
                break
            if not self._decode(context).endswith("\ufffd"):
                return context
            context.pop()
        return [] if not context or self._ends_unfinished(context) else context

    def _ends_unfinished(self, ids: Sequence[int]) -> bool:
        return self._decode(ids).endswith("\ufffd")

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        try:
            text = self._stream.step(self._tokenizer, token_id)
        except (OverflowError, TypeError):
            log.warning("token id %d cannot be decoded; it adds no text", token_id)
            return ""
        except Exception as exc:
            # tokenizers raises a plain Exception when the stream's prefix no longer
            # decodes as it did (vllm-project/vllm#17448): restart from recent context.
            if not _invalid_prefix(exc):
                raise
            return self._restart(token_id)
        if text is not None and not self._pending:
            self._recent.append(token_id)
            return text
        return self._account(token_id, text)

    def _account(self, token_id: int, text: str | None) -> str:
        if text is None:
            self._pending.append(token_id)
            return ""
        self._recent.extend(self._pending)
        self._recent.append(token_id)
        self._pending.clear()
        return text

    def _restart(self, token_id: int) -> str:
        """Feed the unreleased ids to a fresh stream: primed with recent context, else
        with none, else (never seen, but never fatal) decode them in one piece."""
        ids = [*self._pending, token_id]
        self._pending = []
        for context in (self._whole_characters(self._recent), []):
            stream = DecodeStream(ids=context, skip_special_tokens=self._skip)
            try:
                texts = [stream.step(self._tokenizer, i) for i in ids]
            except Exception as exc:
                if not _invalid_prefix(exc):
                    raise
                continue
            self._stream = stream
            return "".join(self._account(i, text) for i, text in zip(ids, texts, strict=True))
        log.warning("decoder restart failed twice; decoding %d ids in one piece", len(ids))
        self._stream = DecodeStream(ids=[], skip_special_tokens=self._skip)
        self._recent.extend(ids)
        return self._decode(ids)

    def flush(self) -> str:
        """At finish: the text of trailing ids that never formed a whole character,
        decoded with replacement characters, so no generated id is silently lost."""
        if not self._pending:
            return ""
        pending, self._pending = self._pending, []
        context = self._whole_characters(self._recent)
        base = self._decode(context)
        full = self._decode([*context, *pending])
        if full.startswith(base):
            return full[len(base) :]
        return self._decode(pending)


class StopGate:
    """Finds stop sequences in released text and holds back what could begin one.

    A stop counts once at least `min_tokens` tokens were generated; the earliest-ending
    match wins, so several tokens in one batch give the same result as one at a time."""

    __slots__ = ("_held", "_min_tokens", "_stops", "matched")

    def __init__(self, stops: Sequence[str], min_tokens: int = 0) -> None:
        self._stops = tuple(stops)
        self._min_tokens = min_tokens
        self._held = ""
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        """Whether there are stop sequences to look for."""
        return bool(self._stops)

    def push(self, text: str, tokens_generated: int) -> str:
        """Add one token's text; return what may be released now. After a match,
        `matched` is set and the text from the stop on is gone for good."""
        if not self._stops:
            return text
        buffer = self._held + text
        if tokens_generated >= self._min_tokens:
            cut = self._earliest_match(buffer)
            if cut is not None:
                self._held = ""
                return buffer[:cut]
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At finish: the held-back text was not a stop after all."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buffer: str) -> int | None:
        best: tuple[int, int] | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start)
                if best is None or candidate < best:
                    best = candidate
                    self.matched = stop
        return None if best is None else best[1]

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that is a proper prefix of a stop."""
        if not buffer:
            return 0
        last = buffer[-1]
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop[length - 1] == last and buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
