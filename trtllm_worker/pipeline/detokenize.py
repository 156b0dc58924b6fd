"""Token ids → text, incrementally, with stop sequences. Pure: no I/O, no clock.

`IncrementalDetokenizer` wraps tokenizers' `DecodeStream`, primed with the prompt's tail
so the first generated word keeps its leading space; it releases text only when a
character is complete. For tokenizers whose decoder just concatenates the tokens' text
(byte-level BPE, SentencePiece's ▁ and byte fallback), a token that is a whole
character sequence on its own is looked up in a table instead (`piece_table`): the same
text `DecodeStream` gives it in any context, at a fraction of a Rust call's cost.
`StopGate` holds back the tail of the text that could still become a stop sequence, so
no part of a stop is ever released."""

from __future__ import annotations

import json
import logging
import re
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

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


_JOINING_DECODERS = frozenset({"ByteLevel", "Metaspace", "ByteFallback", "Fuse"})
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>\Z")
_TABLES: dict[int, tuple[Tokenizer, list[str | None] | None]] = {}


def _concatenates(decoder: dict[str, Any] | None) -> bool:
    """Whether the decoder's text of a sequence is its tokens' texts joined, once the
    first token is past (Strip at the start and Metaspace's first ▁ touch only that):
    no decoder that rewrites across tokens (WordPiece's cleanup, CTC's merges, a
    Replace of more than one character, Strip at the end)."""
    if decoder is None:
        return False
    kind = decoder.get("type")
    if kind == "Sequence":
        return all(_concatenates(d) for d in decoder.get("decoders", []))
    if kind == "Replace":
        pattern = decoder.get("pattern", {})
        return len(pattern.get("String", "")) == 1
    if kind == "Strip":
        return bool(decoder.get("stop", 1) == 0)
    return kind in _JOINING_DECODERS


def piece_table(tokenizer: Tokenizer) -> list[str | None] | None:
    """Per token id the text it adds after any whole-character context, or None where
    only `DecodeStream` can tell (part of a character, no text, an added or special
    token); None for a tokenizer whose decoder does not concatenate. Built once per
    tokenizer (decoding every id after two different anchors, which must agree; under
    a second for a 131k vocabulary)."""
    cached = _TABLES.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    table = _build_table(tokenizer)
    _TABLES[id(tokenizer)] = (tokenizer, table)
    return table


def _build_table(tokenizer: Tokenizer) -> list[str | None] | None:
    decoder = json.loads(tokenizer.to_str()).get("decoder")
    if not _concatenates(decoder):
        return None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    excluded = set(tokenizer.get_added_tokens_decoder())
    if "ByteFallback" in json.dumps(decoder):
        # ByteFallback turns a run of byte tokens that is not UTF-8 into one U+FFFD per
        # token, "<0x41>" included: a byte token's text depends on its neighbours
        excluded |= {i for token, i in tokenizer.get_vocab().items() if _BYTE_TOKEN.match(token)}
    pieces: list[list[str] | None] = []
    for anchor_text in ("a", "Z"):
        ids = tokenizer.encode(anchor_text, add_special_tokens=False).ids
        if not ids:
            return None
        anchor = ids[-1]
        base = tokenizer.decode([anchor], skip_special_tokens=False)
        if not base or "\ufffd" in base:
            return None
        decoded = tokenizer.decode_batch(
            [[anchor, i] for i in range(size)], skip_special_tokens=False
        )
        pieces.append([d[len(base) :] if d.startswith(base) else "\ufffd" for d in decoded])
    first, second = pieces
    assert first is not None
    assert second is not None
    return [
        a if a == b and a and "\ufffd" not in a and i not in excluded else None
        for i, (a, b) in enumerate(zip(first, second, strict=True))
    ]


class IncrementalDetokenizer:
    """One request's decoder. `step` returns the text a token completes ('' if none)."""

    __slots__ = ("_pending", "_recent", "_skip", "_stale", "_stream", "_table", "_tokenizer")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        use_table: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = self._whole_characters(prompt_ids[-PRIME_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._recent: deque[int] = deque(context[-_FLUSH_CONTEXT:], maxlen=_FLUSH_CONTEXT)
        self._pending: list[int] = []
        self._table = piece_table(tokenizer) if use_table else None
        self._stale = False
        """Tokens went through the table since `_stream` last saw one: it is rebuilt
        from recent context before it decodes again."""

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

    def pieces(self, token_ids: Sequence[int]) -> list[str] | None:
        """The texts of these ids from the table, when every one is a whole piece and
        nothing is pending (then they count as decoded); else None, and nothing changed."""
        table = self._table
        if table is None or self._pending or not self._recent:
            return None
        try:
            if len(token_ids) == 1:
                token_id = token_ids[0]
                piece = table[token_id] if token_id >= 0 else None
                if piece is None:
                    return None
                self._recent.append(token_id)
                self._stale = True
                return [piece]
            pieces = [table[i] for i in token_ids]
        except (IndexError, TypeError):
            return None
        if None in pieces or min(token_ids) < 0:
            return None
        self._recent.extend(token_ids)
        self._stale = True
        return cast(list[str], pieces)  # no None among them

    def extend(self, token_ids: Sequence[int], texts: list[str]) -> None:
        """`step` for each id, its text appended to `texts` (also those before a failure):
        in one pass over the table when every id is a whole piece and nothing is pending."""
        pieces = self.pieces(token_ids)
        if pieces is not None:
            texts += pieces
            return
        for token_id in token_ids:
            texts.append(self.step(token_id))

    def step(self, token_id: int) -> str:
        table = self._table
        if table is not None and not self._pending and self._recent:
            try:
                piece = table[token_id] if token_id >= 0 else None
            except (IndexError, TypeError):  # DecodeStream below says why
                piece = None
            if piece is not None:
                self._recent.append(token_id)
                self._stale = True
                return piece
        if self._stale:
            self._stream = DecodeStream(
                ids=self._whole_characters(self._recent), skip_special_tokens=self._skip
            )
            self._stale = False
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
            self._stale = False
            return "".join(self._account(i, text) for i, text in zip(ids, texts, strict=True))
        log.warning("decoder restart failed twice; decoding %d ids in one piece", len(ids))
        self._stream = DecodeStream(ids=[], skip_special_tokens=self._skip)
        self._stale = False
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
