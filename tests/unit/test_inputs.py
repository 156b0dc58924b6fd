"""Job → prompt ids and budgets: tokenizing, the vocabulary check, truncation and the
input length limit."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from tokenizers import Tokenizer, processors

from trtllm_worker.config import ENV_PREFIX, Settings
from trtllm_worker.contract.errors import InputTooLong, InvalidJob
from trtllm_worker.contract.job import Job, JobLimits, parse_job
from trtllm_worker.engine.base import EngineLimits
from trtllm_worker.pipeline.intake import PreparedInput, prepare_input
from trtllm_worker.tokenizer import TokenizerInfo, builtin_byte_tokenizer, load_tokenizer

REQUEST_ID = "req-1"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings built here must not pick up WORKER_* variables from the outside."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def byte_info() -> TokenizerInfo:
    return load_tokenizer(None, None)


def make_settings(**values: Any) -> Settings:
    return Settings(_env_file=None, **values)


def make_job(settings: Settings, **fields: object) -> Job:
    """A job parsed as the consumer parses it, with the limits of `settings`."""
    data: dict[str, object] = {"request_id": REQUEST_ID}
    data.update(fields)
    limits = JobLimits(settings.max_new_tokens, settings.default_max_new_tokens)
    return parse_job(
        json.dumps(data).encode(),
        content_type="application/json",
        message_id=None,
        limits=limits,
    )


def prepare(
    info: TokenizerInfo, settings: Settings | None = None, **fields: object
) -> PreparedInput:
    settings = settings or make_settings()
    return prepare_input(make_job(settings, **fields), info, settings)


def rejected(info: TokenizerInfo, settings: Settings, **fields: object) -> InvalidJob:
    with pytest.raises(InvalidJob) as raised:
        prepare_input(make_job(settings, **fields), info, settings)
    error = raised.value
    assert "\n" not in error.message
    assert error.request_id == REQUEST_ID
    return error


# --- tokenizing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("abc", id="ascii"),
        pytest.param("日本語 😀 e\u0301", id="unicode"),
        pytest.param(" leading and trailing ", id="spaces"),
    ],
)
def test_inputs_are_tokenized(byte_info: TokenizerInfo, text: str) -> None:
    prepared = prepare(byte_info, inputs=text)
    assert prepared.prompt_ids == list(text.encode("utf-8"))


def test_inputs_use_the_given_tokenizer(bpe_tokenizer: Tokenizer) -> None:
    info = TokenizerInfo(
        tokenizer=bpe_tokenizer,
        eos_ids=frozenset(),
        vocab_size=bpe_tokenizer.get_vocab_size(with_added_tokens=True),
        source="test",
    )
    text = "The quick brown fox jumps over the lazy dog."
    prepared = prepare(info, inputs=text)
    assert prepared.prompt_ids == bpe_tokenizer.encode(text).ids
    assert len(prepared.prompt_ids) < len(text.encode()), "the trained merges should apply"


@pytest.fixture(scope="module")
def bos_info() -> TokenizerInfo:
    """The byte tokenizer with a post-processor that puts `<s>` in front of the prompt."""
    tokenizer = builtin_byte_tokenizer()
    tokenizer.add_special_tokens(["<s>"])
    bos = tokenizer.token_to_id("<s>")
    assert bos is not None
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    return TokenizerInfo(
        tokenizer=tokenizer,
        eos_ids=frozenset(),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        source="test",
    )


def test_special_tokens_added_by_default(bos_info: TokenizerInfo) -> None:
    bos = bos_info.tokenizer.token_to_id("<s>")
    assert prepare(bos_info, inputs="abc").prompt_ids == [bos, *b"abc"]


def test_add_special_tokens_false(bos_info: TokenizerInfo) -> None:
    prepared = prepare(bos_info, inputs="abc", parameters={"add_special_tokens": False})
    assert prepared.prompt_ids == list(b"abc")


def test_special_tokens_count_towards_the_limit(bos_info: TokenizerInfo) -> None:
    settings = make_settings(max_input_tokens=3)
    with pytest.raises(InputTooLong):
        prepare(bos_info, settings, inputs="abc")
    prepared = prepare(bos_info, settings, inputs="abc", parameters={"add_special_tokens": False})
    assert len(prepared.prompt_ids) == 3


# --- input_ids ------------------------------------------------------------------------------


def test_input_ids_pass_through(byte_info: TokenizerInfo) -> None:
    ids = [0, 97, byte_info.vocab_size - 1]
    assert prepare(byte_info, input_ids=ids).prompt_ids == ids


@pytest.mark.parametrize(
    "offset",
    [pytest.param(0, id="vocab_size"), pytest.param(1, id="above"), pytest.param(10**9, id="huge")],
)
def test_input_ids_outside_vocabulary(byte_info: TokenizerInfo, offset: int) -> None:
    bad = byte_info.vocab_size + offset
    error = rejected(byte_info, make_settings(), input_ids=[1, 2, bad, 3])
    assert type(error) is InvalidJob
    assert error.code == "invalid_request"
    assert "input_ids" in error.message
    assert str(bad) in error.message


# --- truncate -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "truncate"),
    [
        pytest.param("abcdefgh", 3, id="keeps-last-3"),
        pytest.param("abcdefgh", 1, id="keeps-last-1"),
        pytest.param("abcdefgh", 8, id="exact-length"),
        pytest.param("abcdefgh", 100, id="longer-than-prompt"),
        pytest.param("xy😀", 2, id="splits-a-character"),
    ],
)
def test_truncate_keeps_the_last_tokens(byte_info: TokenizerInfo, text: str, truncate: int) -> None:
    prepared = prepare(byte_info, inputs=text, parameters={"truncate": truncate})
    assert prepared.prompt_ids == list(text.encode("utf-8"))[-truncate:]


def test_truncate_input_ids(byte_info: TokenizerInfo) -> None:
    ids = list(range(10, 30))
    prepared = prepare(byte_info, input_ids=ids, parameters={"truncate": 5})
    assert prepared.prompt_ids == ids[-5:]


# --- input length limit ---------------------------------------------------------------------


def test_prompt_at_the_limit(byte_info: TokenizerInfo) -> None:
    settings = make_settings(max_input_tokens=8)
    assert len(prepare(byte_info, settings, inputs="a" * 8).prompt_ids) == 8


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param({"inputs": "a" * 9}, id="inputs"),
        pytest.param(
            {"input_ids": [97] * 9},
            id="input_ids",
        ),
    ],
)
def test_prompt_too_long(byte_info: TokenizerInfo, prompt: dict[str, object]) -> None:
    settings = make_settings(max_input_tokens=8)
    error = rejected(byte_info, settings, **prompt)
    assert isinstance(error, InputTooLong)
    assert error.code == "input_too_long"
    assert str(settings.max_input_tokens) in error.message
    (field,) = prompt
    assert f"{field}:" in error.message, "the message must name the field the prompt came in"


def test_prompt_too_long_mentions_truncate(byte_info: TokenizerInfo) -> None:
    error = rejected(byte_info, make_settings(max_input_tokens=8), inputs="a" * 9)
    assert "truncate" in error.message


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param({"inputs": "abcdefghijkl"}, id="inputs"),
        pytest.param({"input_ids": list(range(97, 109))}, id="input_ids"),
    ],
)
def test_truncate_brings_prompt_under_the_limit(
    byte_info: TokenizerInfo, prompt: dict[str, object]
) -> None:
    settings = make_settings(max_input_tokens=8)
    prepared = prepare(byte_info, settings, parameters={"truncate": 8}, **prompt)
    assert prepared.prompt_ids == list(b"abcdefghijkl")[-8:]


@pytest.mark.parametrize(
    ("length", "truncate"),
    [
        pytest.param(12, 10, id="truncated-to-above-limit"),
        pytest.param(9, 10, id="truncate-longer-than-prompt"),
    ],
)
def test_truncate_above_the_limit_is_still_too_long(
    byte_info: TokenizerInfo, length: int, truncate: int
) -> None:
    settings = make_settings(max_input_tokens=8)
    error = rejected(byte_info, settings, inputs="a" * length, parameters={"truncate": truncate})
    assert isinstance(error, InputTooLong)
    assert error.code == "input_too_long"


# --- budgets --------------------------------------------------------------------------------


def test_default_max_new_tokens_from_settings(byte_info: TokenizerInfo) -> None:
    settings = make_settings(default_max_new_tokens=17)
    prepared = prepare(byte_info, settings, inputs="abc")
    assert prepared.max_new_tokens == settings.default_max_new_tokens
    assert prepared.min_new_tokens == 0


def test_max_and_min_new_tokens_from_job(byte_info: TokenizerInfo) -> None:
    settings = make_settings(default_max_new_tokens=17)
    parameters = {"max_new_tokens": 40, "min_new_tokens": 5}
    prepared = prepare(byte_info, settings, inputs="abc", parameters=parameters)
    assert (prepared.max_new_tokens, prepared.min_new_tokens) == (40, 5)


def test_total_within_the_contract_bound(byte_info: TokenizerInfo) -> None:
    settings = make_settings(max_input_tokens=8, max_new_tokens=16, default_max_new_tokens=4)
    parameters = {"max_new_tokens": settings.max_new_tokens}
    prepared = prepare(byte_info, settings, inputs="a" * 8, parameters=parameters)
    total = len(prepared.prompt_ids) + prepared.max_new_tokens
    assert total <= settings.max_input_tokens + settings.max_new_tokens


# -- the built engine's own limits --------------------------------------------------------


def test_prompt_plus_max_new_tokens_over_the_engines_max_seq_len(byte_info: TokenizerInfo) -> None:
    """TensorRT-LLM would stop at max_seq_len and report `length`: refused instead, with
    both numbers."""
    settings = make_settings()
    job = make_job(settings, inputs="x" * 100, parameters={"max_new_tokens": 60})
    limits = EngineLimits(max_seq_len=150)
    with pytest.raises(InputTooLong) as caught:
        prepare_input(job, byte_info, settings, limits)
    message = caught.value.message
    assert message.startswith("inputs: 100 tokens + max_new_tokens 60 = 160")
    assert "max_seq_len 150" in message
    fits = make_job(settings, inputs="x" * 90, parameters={"max_new_tokens": 60})
    assert len(prepare_input(fits, byte_info, settings, limits).prompt_ids) == 90


def test_truncate_brings_a_prompt_within_the_engines_limits(byte_info: TokenizerInfo) -> None:
    settings = make_settings()
    job = make_job(settings, inputs="x" * 100, parameters={"max_new_tokens": 60, "truncate": 90})
    prepared = prepare_input(job, byte_info, settings, EngineLimits(max_seq_len=150))
    assert len(prepared.prompt_ids) == 90


def test_prompt_over_the_engines_max_num_tokens(byte_info: TokenizerInfo) -> None:
    settings = make_settings()
    job = make_job(settings, input_ids=[1] * 40)
    with pytest.raises(InputTooLong, match=r"input_ids: 40 tokens.*at most 32 \(max_num_tokens\)"):
        prepare_input(job, byte_info, settings, EngineLimits(max_num_tokens=32))


def test_the_longest_resume_must_fit_the_engines_max_num_tokens(
    byte_info: TokenizerInfo,
) -> None:
    """Resumed with all but its last token published, a job submits prompt +
    max_new_tokens - 1 tokens: accepted at 32, refused at 33 naming both numbers."""
    settings = make_settings()
    limits = EngineLimits(max_num_tokens=32)
    fits = make_job(settings, input_ids=[1] * 20, parameters={"max_new_tokens": 13})
    assert prepare_input(fits, byte_info, settings, limits).max_new_tokens == 13
    over = make_job(settings, input_ids=[1] * 20, parameters={"max_new_tokens": 14})
    with pytest.raises(
        InputTooLong,
        match=r"^input_ids: 20 tokens \+ max_new_tokens 14 - 1 = 33, over the engine's "
        r"max_num_tokens 32 .*lower max_new_tokens to 13 or set parameters\.truncate$",
    ):
        prepare_input(over, byte_info, settings, limits)
    unlimited = EngineLimits(max_num_tokens=None)  # chunked prefill: no prompt limit
    assert prepare_input(over, byte_info, settings, unlimited).max_new_tokens == 14


def test_a_parameter_the_engine_would_ignore_is_refused(byte_info: TokenizerInfo) -> None:
    settings = make_settings()
    limits = EngineLimits(ignored_parameters={"seed": "TorchSampler ignores it"})
    job = make_job(settings, inputs="x", parameters={"seed": 3})
    with pytest.raises(InvalidJob, match=r"^parameters\.seed: TorchSampler ignores it$"):
        prepare_input(job, byte_info, settings, limits)
    unseeded = make_job(settings, inputs="x", parameters={"temperature": 0.5})
    assert prepare_input(unseeded, byte_info, settings, limits).prompt_ids == [120]


@pytest.mark.parametrize(
    ("engine", "wanted", "refused"),
    [
        pytest.param(EngineLimits(max_top_logprobs=20), 20, None, id="within"),
        pytest.param(EngineLimits(max_top_logprobs=5), 6, "6 is more than", id="over"),
        pytest.param(
            EngineLimits(top_logprobs_why="the sampler returns one"),
            1,
            "cannot return top logprobs (the sampler returns one)",
            id="none",
        ),
    ],
)
def test_top_logprobs_beyond_what_the_engine_returns_are_refused(
    byte_info: TokenizerInfo, engine: EngineLimits, wanted: int, refused: str | None
) -> None:
    """Fewer top logprobs than asked would look like a model with no other candidates:
    the job is refused at intake, naming the field and why."""
    settings = make_settings()
    params = {"return_logprobs": True, "top_logprobs": wanted}
    job = make_job(settings, inputs="x", parameters=params)
    if refused is None:
        assert prepare_input(job, byte_info, settings, engine).prompt_ids == [120]
        return
    with pytest.raises(InvalidJob) as caught:
        prepare_input(job, byte_info, settings, engine)
    assert caught.value.message.startswith("parameters.top_logprobs: ")
    assert refused in caught.value.message
