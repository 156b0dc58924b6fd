"""The detokenizer's table of whole pieces (trtllm_worker/pipeline/detokenize.py `piece_table`)
gives, token by token, exactly the text `DecodeStream` gives: checked on the real
checkpoints' tokenizers (Mistral 7B's SentencePiece with byte fallback, Mistral NeMo's
Tekken) and the trained ones, over random ids (byte tokens, control tokens and all), with
special tokens skipped and kept, from a prompt and from none. A decoder that rewrites
across tokens gets no table."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models

from trtllm_worker.pipeline.detokenize import IncrementalDetokenizer, piece_table
from trtllm_worker.tokenizer import load_tokenizer

TOKENIZERS = ["byte_tokenizer", "bpe_tokenizer", "metaspace_tokenizer", "mistral", "nemo"]


@pytest.fixture(scope="module")
def mistral(sentencepiece_model: Path) -> Tokenizer:
    return load_tokenizer(sentencepiece_model, None).tokenizer


@pytest.fixture(scope="module")
def nemo(tekken_model: Path) -> Tokenizer:
    return load_tokenizer(tekken_model, None).tokenizer


def texts(detok: IncrementalDetokenizer, ids: list[int], per_step: int) -> list[str]:
    out: list[str] = []
    for start in range(0, len(ids), per_step):
        detok.extend(ids[start : start + per_step], out)
    return out


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("prompt", ["Hello there, ", ""])
def test_the_table_gives_what_the_decode_stream_gives(
    request: pytest.FixtureRequest, name: str, skip: bool, prompt: str
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    table = piece_table(tokenizer)
    assert table is not None, "every tokenizer here concatenates"
    assert sum(piece is not None for piece in table) > len(table) // 3, "the table is used"
    prompt_ids = tokenizer.encode(prompt).ids if prompt else []
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    rng = random.Random(f"{name}-{skip}-{prompt}")
    partial = [i for i in range(size) if table[i] is None][:2000]  # bytes, specials, ...
    for trial in range(30):
        ids = [rng.choice(partial) if rng.random() < 0.3 else rng.randrange(size)
               for _ in range(200)]  # fmt: skip
        fast = IncrementalDetokenizer(tokenizer, prompt_ids, skip)
        reference = IncrementalDetokenizer(tokenizer, prompt_ids, skip, use_table=False)
        per_step = 1 + trial % 4
        assert texts(fast, ids, per_step) == texts(reference, ids, per_step), (trial, ids)
        assert fast.flush() == reference.flush()


def test_a_decoder_that_rewrites_across_tokens_gets_no_table() -> None:
    """WordPiece's cleanup joins "do" "n't" as "don't": a token's text depends on its
    neighbour, so only DecodeStream may decode it."""
    vocab = {"[UNK]": 0, "do": 1, "n't": 2, "'": 3, "s": 4, "a": 5, "Z": 6}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece(cleanup=True)
    assert piece_table(tokenizer) is None
    detok = IncrementalDetokenizer(tokenizer, [5])
    out: list[str] = []
    detok.extend([1, 2], out)
    assert "".join(out) == tokenizer.decode([5, 1, 2])[len(tokenizer.decode([5])) :]
