"""IncrementalDetokenizer and StopGate (worker/detokenize.py).

The reference for every expected text is the tokenizer's own full decode: the text a
continuation adds is `decode(prompt + continuation)` minus `decode(prompt)`. Nothing
here hard-codes what a tokenizer produces."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import cast

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from trtllm_worker.pipeline.detokenize import PRIME_TOKENS, IncrementalDetokenizer, StopGate

REPLACEMENT = "\ufffd"

TOKENIZERS = ["byte_tokenizer", "bpe_tokenizer", "metaspace_tokenizer"]
BYTE_LEVEL_TOKENIZERS = ["byte_tokenizer", "bpe_tokenizer"]

# (id, prompt, continuation). "unseen" cases use characters absent from the training
# CORPUS, so the Metaspace tokenizer spells them with byte-fallback `<0xXX>` tokens.
TEXTS = [
    pytest.param("Hello", " world, hello tokenizers!", id="ascii"),
    pytest.param("The quick", " zebra vexed jolly wizards", id="ascii-new-words"),
    pytest.param("日本語の", "テキストも正しく扱えること。", id="cjk"),
    pytest.param("中文", "繁體字與漢字：龍龜鬱", id="cjk-unseen"),
    pytest.param("Emoji:", " 👨‍👩‍👧‍👦 👍🏽 and 🇫🇷 🎉", id="emoji-zwj-flag"),
    pytest.param("Flags", " 🇺🇦🇧🇷🏳️‍🌈 🏴‍☠️ 🧑🏿‍🦱", id="emoji-unseen"),
    pytest.param("Combining marks:", " e\u0301 n\u0303 A\u030a ḍ̇ Z̤͔ͧ̑̓", id="combining"),
    pytest.param("Marks", " q\u0307\u0323 x\u0334\u0301 ǘ", id="combining-unseen"),
    pytest.param("Numbers", " 0123 Ωmega ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🧬", id="symbols-unseen"),
    pytest.param("Line one.", "\n\tLine two.\r\n", id="whitespace"),
    pytest.param("", "Hello world", id="empty-prompt"),
    pytest.param(
        "The quick brown fox jumps over the lazy dog. " * 3,
        " 日本語 👨‍👩‍👧‍👦 done",
        id="prompt-longer-than-priming",
    ),
]
UNSEEN_TEXTS = [p for p in TEXTS if "unseen" in str(p.id)]


def _get_tokenizer(request: pytest.FixtureRequest, name: str) -> Tokenizer:
    return cast(Tokenizer, request.getfixturevalue(name))


def _decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def _expected_suffix(tokenizer: Tokenizer, prompt: Sequence[int], ids: Sequence[int]) -> str:
    base = _decode(tokenizer, prompt)
    full = _decode(tokenizer, [*prompt, *ids])
    assert full.startswith(base), "test data: decode(prompt) must be a prefix"
    return full[len(base) :]


def _run(tokenizer: Tokenizer, prompt: Sequence[int], ids: Sequence[int]) -> tuple[list[str], str]:
    """The detokenizer keeping special tokens' text, as `_decode` does (the tests with
    special tokens skipped are in test_real_tokenizers.py)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
    steps = [detok.step(token_id) for token_id in ids]
    return steps, detok.flush()


# -- IncrementalDetokenizer: real text ----------------------------------------------------


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize(("prompt", "continuation"), TEXTS)
def test_deltas_concatenate_to_full_decode_suffix(
    request: pytest.FixtureRequest, tokenizer_name: str, prompt: str, continuation: str
) -> None:
    tokenizer = _get_tokenizer(request, tokenizer_name)
    prompt_ids = tokenizer.encode(prompt).ids
    ids = tokenizer.encode(continuation).ids

    steps, flushed = _run(tokenizer, prompt_ids, ids)

    assert "".join(steps) + flushed == _expected_suffix(tokenizer, prompt_ids, ids)
    assert flushed == ""  # valid text leaves no unfinished character behind


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize(("prompt", "continuation"), TEXTS)
def test_no_step_releases_a_replacement_character_for_valid_text(
    request: pytest.FixtureRequest, tokenizer_name: str, prompt: str, continuation: str
) -> None:
    tokenizer = _get_tokenizer(request, tokenizer_name)
    steps, _ = _run(tokenizer, tokenizer.encode(prompt).ids, tokenizer.encode(continuation).ids)

    assert [text for text in steps if REPLACEMENT in text] == []


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize(("prompt", "continuation"), TEXTS)
def test_each_step_is_final(
    request: pytest.FixtureRequest, tokenizer_name: str, prompt: str, continuation: str
) -> None:
    """Text once released is never revised: after every step the released text is a
    prefix of what the whole continuation decodes to."""
    tokenizer = _get_tokenizer(request, tokenizer_name)
    prompt_ids = tokenizer.encode(prompt).ids
    ids = tokenizer.encode(continuation).ids
    expected = _expected_suffix(tokenizer, prompt_ids, ids)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)

    released = ""
    for position, token_id in enumerate(ids):
        released += detok.step(token_id)
        assert expected.startswith(released), f"after token {position}: {released!r}"


@pytest.mark.parametrize(("prompt", "continuation"), UNSEEN_TEXTS)
def test_unseen_texts_use_byte_fallback(
    metaspace_tokenizer: Tokenizer, prompt: str, continuation: str
) -> None:
    """Guards the test data: the 'unseen' cases do exercise `<0xXX>` tokens."""
    tokens = metaspace_tokenizer.encode(continuation).tokens

    assert any(token.startswith("<0x") for token in tokens)


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param("Hello", id="short-prompt"),
        pytest.param("Hello world, hello tokenizers! Streaming text one", id="long-prompt"),
    ],
)
def test_first_word_keeps_its_leading_space(
    request: pytest.FixtureRequest, tokenizer_name: str, prompt: str
) -> None:
    tokenizer = _get_tokenizer(request, tokenizer_name)
    prompt_ids = tokenizer.encode(prompt).ids
    ids = tokenizer.encode(" world").ids

    steps, _ = _run(tokenizer, prompt_ids, ids)

    first = next(text for text in steps if text)
    assert first.startswith(" ")
    assert "".join(steps) == _expected_suffix(tokenizer, prompt_ids, ids)


def test_metaspace_decode_alone_drops_the_space_priming_keeps(
    metaspace_tokenizer: Tokenizer,
) -> None:
    """Guards the test above: without context this tokenizer's decoder strips the
    leading space, so the priming is what keeps it."""
    ids = metaspace_tokenizer.encode(" world").ids

    assert not _decode(metaspace_tokenizer, ids).startswith(" ")


def test_priming_window_is_shorter_than_the_long_prompt_case(
    metaspace_tokenizer: Tokenizer, bpe_tokenizer: Tokenizer
) -> None:
    """Guards the 'prompt-longer-than-priming' case: the prompt does exceed the window."""
    prompt = str(TEXTS[-1].values[0])
    for tokenizer in (metaspace_tokenizer, bpe_tokenizer):
        assert len(tokenizer.encode(prompt).ids) > PRIME_TOKENS


# -- IncrementalDetokenizer: random ids (byte-level tokenizers) ----------------------------


@pytest.fixture(scope="module", params=BYTE_LEVEL_TOKENIZERS)
def byte_level_tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return _get_tokenizer(request, str(request.param))


def _draw_ids(data: st.DataObject, tokenizer: Tokenizer, max_size: int) -> list[int]:
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return data.draw(st.lists(st.integers(0, vocab - 1), max_size=max_size))


def _draw_prompt(data: st.DataObject, tokenizer: Tokenizer) -> list[int]:
    prompt = _draw_ids(data, tokenizer, max_size=24)
    # A prompt whose decode ends in U+FFFD (it ends inside a character) leaks prompt
    # text into the first delta: see test_prompt_ending_inside_a_character below.
    assume(not _decode(tokenizer, prompt).endswith(REPLACEMENT))
    return prompt


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_ids_concatenate_to_full_decode_suffix(
    byte_level_tokenizer: Tokenizer, data: st.DataObject
) -> None:
    tokenizer = byte_level_tokenizer
    prompt = _draw_prompt(data, tokenizer)
    ids = _draw_ids(data, tokenizer, max_size=40)
    base = _decode(tokenizer, prompt)
    full = _decode(tokenizer, [*prompt, *ids])
    assume(full.startswith(base))

    steps, flushed = _run(tokenizer, prompt, ids)

    assert "".join(steps) + flushed == full[len(base) :]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_ids_never_release_a_partial_character(
    byte_level_tokenizer: Tokenizer, data: st.DataObject
) -> None:
    """Each step's text is valid UTF-8, does not end in the 'unfinished' marker U+FFFD
    (which would mean bytes of a character still to come were replaced), and is never
    revised by later tokens."""
    tokenizer = byte_level_tokenizer
    prompt = _draw_prompt(data, tokenizer)
    ids = _draw_ids(data, tokenizer, max_size=40)
    base = _decode(tokenizer, prompt)
    full = _decode(tokenizer, [*prompt, *ids])
    assume(full.startswith(base))
    expected = full[len(base) :]
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)

    released = ""
    for token_id in ids:
        text = detok.step(token_id)
        assert text.encode("utf-8").decode("utf-8") == text
        assert not text.endswith(REPLACEMENT)
        released += text
        assert expected.startswith(released)


# -- IncrementalDetokenizer: unfinished characters ------------------------------------------


def test_flush_releases_an_unfinished_character(byte_tokenizer: Tokenizer) -> None:
    prompt = byte_tokenizer.encode("Hi ").ids
    ids = list("日".encode()[:2])  # 0xE6 0x97: two of the character's three bytes
    detok = IncrementalDetokenizer(byte_tokenizer, prompt)

    steps = [detok.step(token_id) for token_id in ids]
    flushed = detok.flush()

    assert steps == ["", ""]
    assert flushed == _expected_suffix(byte_tokenizer, prompt, ids)
    assert flushed == bytes(ids).decode("utf-8", errors="replace")
    assert detok.flush() == ""  # nothing is released twice


def test_flush_is_empty_when_every_character_is_complete(byte_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, byte_tokenizer.encode("a").ids)

    texts = [detok.step(token_id) for token_id in "日".encode()]

    assert texts == ["", "", "日"]
    assert detok.flush() == ""


def test_unfinished_character_completed_later_is_released_whole(
    byte_tokenizer: Tokenizer,
) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    head, tail = "👍".encode()[:3], "👍".encode()[3:]

    before = [detok.step(token_id) for token_id in head]
    after = [detok.step(token_id) for token_id in tail]

    assert (before, after) == (["", "", ""], ["👍"])
    assert detok.flush() == ""


@pytest.mark.parametrize(
    "prompt_tail",
    [
        pytest.param(bytes([0xFF]), id="invalid-byte"),
        pytest.param("日".encode()[:2], id="unfinished-character"),
    ],
)
def test_prompt_ending_inside_a_character(byte_tokenizer: Tokenizer, prompt_tail: bytes) -> None:
    """`input_ids` prompts may end anywhere, e.g. a client continuing its own output."""
    prompt = [*byte_tokenizer.encode("Hello").ids, *prompt_tail]
    ids = byte_tokenizer.encode("AB").ids

    steps, flushed = _run(byte_tokenizer, prompt, ids)

    assert "Hello" not in "".join(steps)
    assert "".join(steps) + flushed == _expected_suffix(byte_tokenizer, prompt, ids)


def test_invalid_byte_sequence_with_byte_fallback_is_published_as_replacement(
    metaspace_tokenizer: Tokenizer,
) -> None:
    """An invalid byte run from `<0xXX>` tokens (a model can sample one) decodes with
    replacement characters and does not stop the stream."""
    tokenizer = metaspace_tokenizer
    prompt = tokenizer.encode("Hello").ids
    ids = [_byte_token(tokenizer, 0xE6), _byte_token(tokenizer, 0x41), _word_piece(tokenizer)]

    steps, flushed = _run(tokenizer, prompt, ids)

    assert "".join(steps) + flushed == _expected_suffix(tokenizer, prompt, ids)


def test_invalid_prefix_after_released_byte_token_does_not_raise(
    metaspace_tokenizer: Tokenizer,
) -> None:
    """A released byte-fallback token (`<0xC3><0xA9>` = 'é') followed by a stray lead
    byte makes ByteFallback re-decode the whole run as U+FFFD, so the stream's prefix
    no longer matches (vllm-project/vllm#17448). step() must not raise."""
    tokenizer = metaspace_tokenizer
    prompt = tokenizer.encode("Hello").ids
    ids = [
        _byte_token(tokenizer, 0xC3),
        _byte_token(tokenizer, 0xA9),
        _byte_token(tokenizer, 0xE6),
        _word_piece(tokenizer),
    ]
    detok = IncrementalDetokenizer(tokenizer, prompt)

    texts = [detok.step(token_id) for token_id in ids]

    assert texts[:2] == ["", "é"]
    piece = tokenizer.id_to_token(ids[-1])
    assert piece is not None
    assert piece.replace("▁", " ").strip() in "".join(texts) + detok.flush()


def _word_piece(tokenizer: Tokenizer) -> int:
    """A learned (not byte-fallback) token. BPE training breaks ties in no fixed order,
    so which merges exist varies between runs: take one the trained vocabulary has."""
    for token_id in reversed(tokenizer.encode("Hello world").ids):
        token = tokenizer.id_to_token(token_id)
        if token is not None and not token.startswith("<0x") and token.strip("▁"):
            return token_id
    raise AssertionError("test data: no learned token in 'Hello world'")


def _byte_token(tokenizer: Tokenizer, byte: int) -> int:
    token_id = tokenizer.token_to_id(f"<0x{byte:02X}>")
    assert token_id is not None
    return token_id


def test_out_of_range_id_adds_no_text(byte_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, byte_tokenizer.encode("a").ids)
    vocab = byte_tokenizer.get_vocab_size(with_added_tokens=True)

    texts = [detok.step(vocab + 1000), detok.step(ord("b"))]

    assert texts == ["", "b"]


# -- StopGate ---------------------------------------------------------------------------------


def _push_all(gate: StopGate, pieces: Sequence[str], first_token: int = 1) -> list[str]:
    """Push pieces as tokens 1, 2, …; after a match nothing more is pushed."""
    released: list[str] = []
    for n, piece in enumerate(pieces):
        released.append(gate.push(piece, first_token + n))
        if gate.matched is not None:
            break
    return released


def test_no_stops_passes_text_straight_through() -> None:
    gate = StopGate([])
    pieces = ["Hel", "lo", "", " wor", "ld"]

    assert _push_all(gate, pieces) == pieces
    assert gate.flush() == ""
    assert gate.matched is None


def test_stop_inside_one_token() -> None:
    gate = StopGate(["STOP"])

    released = gate.push("hello STOP world", 1)

    assert released == "hello "
    assert gate.matched == "STOP"
    assert gate.flush() == ""


@pytest.mark.parametrize(
    "pieces",
    [
        pytest.param(["ab", "cS", "T", "OP", "xyz"], id="2-1-2"),
        pytest.param(["abcS", "TOPxyz"], id="two-halves"),
        pytest.param(["a", "b", "c", "S", "T", "O", "P", "x"], id="char-by-char"),
        pytest.param(["abc", "", "ST", "", "OPx"], id="empty-tokens"),
        pytest.param(["abcST", "OSTOPx"], id="false-start-then-stop"),
    ],
)
def test_stop_spanning_tokens_is_never_partly_released(pieces: list[str]) -> None:
    text = "".join(pieces)
    before_stop = text[: text.index("STOP")]
    gate = StopGate(["STOP"])

    released = ""
    for n, piece in enumerate(pieces, start=1):
        released += gate.push(piece, n)
        assert before_stop.startswith(released), f"after piece {n}: {released!r}"
        if gate.matched is not None:
            break

    assert released == before_stop
    assert gate.matched == "STOP"


def test_earliest_ending_stop_wins() -> None:
    gate = StopGate(["abcd", "bc"])

    released = gate.push("xxabcd", 1)

    assert released == "xxa"
    assert gate.matched == "bc"


def test_earliest_ending_stop_wins_one_char_at_a_time() -> None:
    gate = StopGate(["abcd", "bc"])

    released = "".join(_push_all(gate, list("xxabcd")))

    assert released == "xxa"
    assert gate.matched == "bc"


def test_same_end_prefers_the_longer_stop() -> None:
    gate = StopGate(["bc", "abc"])

    assert gate.push("xabc", 1) == "x"
    assert gate.matched == "abc"


def test_partial_stop_that_never_completes_is_released_by_flush() -> None:
    gate = StopGate(["abc"])

    released = gate.push("hello ab", 1)

    assert released == "hello "
    assert gate.flush() == "ab"
    assert gate.matched is None


def test_partial_stop_that_diverges_is_released() -> None:
    gate = StopGate(["abc"])

    assert _push_all(gate, ["ab", "x"]) == ["", "abx"]
    assert gate.matched is None


def test_stop_at_the_very_beginning() -> None:
    gate = StopGate(["STOP"])

    assert gate.push("STOP and more", 1) == ""
    assert gate.matched == "STOP"


def test_stop_at_the_very_beginning_across_tokens() -> None:
    gate = StopGate(["STOP"])

    assert _push_all(gate, ["ST", "OP"]) == ["", ""]
    assert gate.matched == "STOP"


def test_stop_completing_before_min_tokens_is_not_honoured() -> None:
    gate = StopGate(["ab"], min_tokens=3)

    early = _push_all(gate, ["xab", "ab"])  # tokens 1 and 2
    late = gate.push("yab", 3)

    assert early == ["xab", "ab"]
    assert late == "y"
    assert gate.matched == "ab"


def test_stop_completing_at_min_tokens_is_honoured() -> None:
    gate = StopGate(["abc"], min_tokens=2)

    assert gate.push("ab", 1) == ""  # held: it may still become the stop
    assert gate.push("c", 2) == ""
    assert gate.matched == "abc"


def _reference_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Text released and stop matched when the text arrives one character at a time."""
    for end in range(1, len(text) + 1):
        ending = [stop for stop in stops if text[:end].endswith(stop)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=24),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    data=st.data(),
)
def test_stop_gate_matches_one_character_at_a_time(
    text: str, stops: list[str], data: st.DataObject
) -> None:
    """However the text is cut into tokens, the released text and the matched stop are
    those of feeding it one character at a time, and nothing released is later taken
    back."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in pairwise(bounds)]
    expected_text, expected_stop = _reference_stop(text, stops)
    gate = StopGate(stops)

    released = ""
    for n, piece in enumerate(pieces, start=1):
        released += gate.push(piece, n)
        assert expected_text.startswith(released)
        if gate.matched is not None:
            break
    else:
        released += gate.flush()

    assert (released, gate.matched) == (expected_text, expected_stop)
