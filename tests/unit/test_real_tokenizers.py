"""Detokenizing on real checkpoints' tokenizers (Mistral 7B's SentencePiece with byte
fallback, Mistral NeMo's Tekken byte-level BPE with 1,000 control tokens), through the
output path the worker publishes with: one entry per token, text decoded in the
prompt's context, never a partial UTF-8 character, special tokens skipped unless the
job keeps them, and the entries' text concatenated equal to `generated_text`, also
across a resume."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from trtllm_worker.contract.stream import Fields, FinishReason
from trtllm_worker.engine.base import EngineOutput
from trtllm_worker.pipeline.output import OutputProcessor, RequestState
from trtllm_worker.tokenizer import TokenizerInfo, load_tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def mistral(sentencepiece_model: Path) -> TokenizerInfo:
    return load_tokenizer(sentencepiece_model, None)


@pytest.fixture(scope="module")
def nemo(tekken_model: Path) -> TokenizerInfo:
    return load_tokenizer(tekken_model, None)


def state_for(
    info: TokenizerInfo,
    prompt: str,
    *,
    stops: Sequence[str] = (),
    skip_special_tokens: bool = True,
    eos: bool = True,
    stop_token_ids: frozenset[int] = frozenset(),
) -> RequestState:
    prompt_ids = info.tokenizer.encode(prompt).ids  # with BOS, as a job's prompt has it
    return RequestState(
        request_id="r",
        key="k",
        engine_id=1,
        tokenizer=info.tokenizer,
        prompt_ids=prompt_ids,
        input_tokens=len(prompt_ids),
        stops=stops,
        eos_ids=info.eos_ids if eos else frozenset(),
        stop_token_ids=stop_token_ids,
        skip_special_tokens=skip_special_tokens,
    )


def publish(
    state: RequestState, ids: Sequence[int], finish: FinishReason | None = FinishReason.LENGTH
) -> tuple[list[str], Fields | None]:
    """What the worker stores for these generated ids: each token entry's text, and the
    terminal entry's fields."""
    processor = OutputProcessor()
    processor.add(state)
    batch = processor.process([EngineOutput(state.engine_id, list(ids), finish=finish)])
    texts = [str(f["text"]) for _, _, f in batch.entries if f["event"] == "token"]
    done = next((f for _, _, f in batch.entries if f["event"] == "done"), None)
    return texts, done


def generated(info: TokenizerInfo, prompt: str, continuation: str) -> list[int]:
    """The ids a model would generate to continue `prompt` with `continuation`."""
    prompt_ids = info.tokenizer.encode(prompt).ids
    full = info.tokenizer.encode(prompt + continuation).ids
    assert full[: len(prompt_ids)] == prompt_ids, "test data: the prompt must tokenize alike"
    return full[len(prompt_ids) :]


def test_sentencepiece_leading_space_is_kept_in_the_prompts_context(
    mistral: TokenizerInfo,
) -> None:
    ids = generated(mistral, "Hello", " world")
    assert mistral.tokenizer.id_to_token(ids[0]) == "▁world"
    assert mistral.tokenizer.decode(ids) == "world"  # what a per-token decode would give
    texts, done = publish(state_for(mistral, "Hello"), ids)
    assert texts == [" world"]
    assert done is not None
    assert done["generated_text"] == " world"


@pytest.mark.parametrize("character", ["𝄞", "🦙", "\U0002a6b2"])
def test_sentencepiece_byte_fallback_releases_whole_characters(
    mistral: TokenizerInfo, character: str
) -> None:
    """A character outside the vocabulary is 4 `<0xXX>` byte tokens: the first three
    entries carry no text, the fourth the whole character."""
    ids = generated(mistral, "Clef:", " " + character)
    pieces = [str(mistral.tokenizer.id_to_token(i)) for i in ids]
    assert pieces[0] == "▁"
    assert all(p.startswith("<0x") for p in pieces[1:]), pieces
    texts, done = publish(state_for(mistral, "Clef:"), ids)
    assert texts == [" ", "", "", "", character]
    assert done is not None
    assert done["generated_text"] == " " + character


def test_tekken_splits_multibyte_characters_and_releases_them_whole(nemo: TokenizerInfo) -> None:
    continuation = " 日本語の文章 👨‍👩‍👧 e\u0301 Привет"
    ids = generated(nemo, "Text:", continuation)
    partial = [i for i in ids if REPLACEMENT in nemo.tokenizer.decode([i])]
    assert partial, "test data: some tokens must hold part of a character"
    texts, done = publish(state_for(nemo, "Text:"), ids)
    assert len(texts) == len(ids)
    assert all(REPLACEMENT not in t for t in texts)
    assert "".join(texts) == continuation
    assert done is not None
    assert done["generated_text"] == continuation


@pytest.mark.parametrize("model", ["mistral", "nemo"])
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_unless_kept(
    request: pytest.FixtureRequest, model: str, skip: bool
) -> None:
    """A generated BOS, and with `ignore_eos` an EOS, are special: their entries carry
    no text by default, and `<s>` / `</s>` with `skip_special_tokens: false`."""
    info: TokenizerInfo = request.getfixturevalue(model)
    bos, eos = info.tokenizer.token_to_id("<s>"), info.tokenizer.token_to_id("</s>")
    assert bos is not None
    assert eos is not None
    assert {bos, eos} <= info.special_ids
    words = generated(info, "Say", " hi")
    ids = [*words, eos, bos, *generated(info, "Say hi", " again")]
    texts, done = publish(state_for(info, "Say", skip_special_tokens=skip, eos=False), ids)
    assert len(texts) == len(ids)
    expected = " hi again" if skip else " hi</s><s> again"
    assert done is not None
    assert done["generated_text"] == "".join(texts)
    assert str(done["generated_text"]).replace(" ", "") == expected.replace(" ", "")
    assert ("</s>" in str(done["generated_text"])) is not skip


@pytest.mark.parametrize("skip", [True, False])
def test_tekken_control_tokens(nemo: TokenizerInfo, skip: bool) -> None:
    inst, end_inst = nemo.tokenizer.token_to_id("[INST]"), nemo.tokenizer.token_to_id("[/INST]")
    assert inst is not None
    assert end_inst is not None
    assert {inst, end_inst} <= nemo.special_ids
    ids = [inst, *generated(nemo, "x", " Hi"), end_inst]
    texts, done = publish(state_for(nemo, "x", skip_special_tokens=skip), ids)
    assert done is not None
    assert done["generated_text"] == ("".join(texts))
    assert done["generated_text"] == (" Hi" if skip else "[INST] Hi[/INST]")


def test_the_eos_that_ends_a_request_has_an_empty_entry(mistral: TokenizerInfo) -> None:
    eos = mistral.end_id
    ids = [*generated(mistral, "Hi", " there"), eos]
    texts, done = publish(
        state_for(mistral, "Hi", skip_special_tokens=False), ids, FinishReason.EOS_TOKEN
    )
    assert texts[-1] == ""
    assert done is not None
    assert (done["finish_reason"], done["generated_text"]) == ("eos_token", " there")


@pytest.mark.parametrize("model", ["mistral", "nemo"])
def test_stop_sequence_straddling_tokens(request: pytest.FixtureRequest, model: str) -> None:
    info: TokenizerInfo = request.getfixturevalue(model)
    continuation = " the quick brown fox jumps"
    ids = generated(info, "Story:", continuation)
    stop = "ck bro"  # ends inside "quick", spans the space and begins "brown"
    pieces = [info.tokenizer.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces), "test data: no single token holds the stop"
    texts, done = publish(state_for(info, "Story:", stops=[stop]), ids, None)
    assert done is not None
    assert done["finish_reason"] == "stop_sequence"
    assert done["generated_text"] == " the qui" == "".join(texts)


@pytest.mark.parametrize("model", ["mistral", "nemo"])
@pytest.mark.parametrize("character", ["𝄞", "\U0002a6b2"])
def test_resume_in_the_middle_of_a_character(
    request: pytest.FixtureRequest, model: str, character: str
) -> None:
    """A worker dies after publishing some of a character's byte tokens; the next one
    replays them and goes on: the stream reads as if one worker had written it."""
    info: TokenizerInfo = request.getfixturevalue(model)
    continuation = f" a{character}b"
    ids = generated(info, "Go:", continuation)
    whole, _ = publish(state_for(info, "Go:"), ids)
    cut = next(
        (
            k
            for k in range(1, len(ids))
            if whole[k - 1] == "" and REPLACEMENT in info.tokenizer.decode(ids[k - 1 : k])
        ),
        None,
    )
    assert cut is not None, f"test data: {model} must split {character!r} over tokens"
    first = state_for(info, "Go:")
    stored, _ = publish(first, ids[:cut], None)
    resumed = state_for(info, "Go:")
    assert resumed.replay(ids[:cut]) is None
    resumed.texts = list(stored)  # what the runner does: the stored stream is the truth
    rest, done = publish(resumed, ids[cut:])
    assert stored + rest == whole
    assert done is not None
    assert done["generated_text"] == "".join(stored + rest) == continuation
