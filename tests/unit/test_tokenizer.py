"""Loading the tokenizer: built-in byte level, a tokenizer.json, a model folder and the
EOS ids it declares, and one clear line for every problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.tokenizer import load_tokenizer

TEXTS = [
    pytest.param("abc", id="ascii"),
    pytest.param("", id="empty"),
    pytest.param("Hello, world!\n\tTabs  and  spaces ", id="whitespace"),
    pytest.param("日本語のテキスト。中文测试", id="cjk"),
    pytest.param("😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 🎉", id="emoji"),
    pytest.param("e\u0301 n\u0303 A\u030a Z̤͔ͧ̑̓", id="combining"),
    pytest.param("\x00\x01\x7f\u200b\ufeff", id="control-and-invisible"),
    pytest.param("\U0010ffff\U0001f600", id="astral"),
]


def config_error(path: Path | None, eos_token: str | None) -> str:
    """The one-line message of the `ConfigError` load_tokenizer raises."""
    with pytest.raises(ConfigError) as info:
        load_tokenizer(path, eos_token)
    message = str(info.value)
    assert message.strip()
    assert "\n" not in message, "the message must be one line"
    return message


def token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    assert found is not None, token
    return found


# --- built-in byte-level tokenizer ----------------------------------------------------------


def test_builtin_abc() -> None:
    info = load_tokenizer(None, None)
    assert info.tokenizer.encode("abc").ids == [97, 98, 99]


@pytest.mark.parametrize("text", TEXTS)
def test_builtin_ids_are_utf8_bytes(text: str) -> None:
    info = load_tokenizer(None, None)
    assert info.tokenizer.encode(text).ids == list(text.encode("utf-8"))


@pytest.mark.parametrize("text", TEXTS)
def test_builtin_round_trip(text: str) -> None:
    tokenizer = load_tokenizer(None, None).tokenizer
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_builtin_vocabulary() -> None:
    info = load_tokenizer(None, None)
    assert info.vocab_size == 257
    assert info.tokenizer.token_to_id("</s>") == 256
    assert [info.tokenizer.decode([b]) for b in range(128)] == [chr(b) for b in range(128)]


def test_builtin_has_no_eos_by_default() -> None:
    info = load_tokenizer(None, None)
    assert info.eos_ids == frozenset()
    assert info.end_id == -1


def test_builtin_eos_token() -> None:
    info = load_tokenizer(None, "</s>")
    assert info.eos_ids == frozenset({256})
    assert info.end_id == 256


def test_builtin_unknown_eos_token() -> None:
    message = config_error(None, "<|endoftext|>")
    assert "WORKER_EOS_TOKEN" in message
    assert "<|endoftext|>" in message


# --- tokenizer.json -------------------------------------------------------------------------


@pytest.fixture
def tokenizer_file(tmp_path: Path, bpe_tokenizer: Tokenizer) -> Path:
    file = tmp_path / "my-tokenizer.json"
    bpe_tokenizer.save(str(file))
    return file


def test_tokenizer_file(tokenizer_file: Path, bpe_tokenizer: Tokenizer) -> None:
    info = load_tokenizer(tokenizer_file, None)
    assert info.vocab_size == bpe_tokenizer.get_vocab_size(with_added_tokens=True)
    text = "The quick brown fox 日本語 😀"
    assert info.tokenizer.encode(text).ids == bpe_tokenizer.encode(text).ids
    assert info.eos_ids == frozenset()
    assert str(tokenizer_file) in info.source


def test_tokenizer_file_with_eos_token(tokenizer_file: Path, bpe_tokenizer: Tokenizer) -> None:
    info = load_tokenizer(tokenizer_file, "</s>")
    assert info.eos_ids == frozenset({token_id(bpe_tokenizer, "</s>")})


def test_tokenizer_file_ignores_configs_beside_it(
    tokenizer_file: Path, bpe_tokenizer: Tokenizer
) -> None:
    """Only a model folder is searched for special tokens; a file path is just the file."""
    (tokenizer_file.parent / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    assert load_tokenizer(tokenizer_file, None).eos_ids == frozenset()


# --- model folder ---------------------------------------------------------------------------


def test_folder_eos_from_tokenizer_config(tokenizer_dir: Path, bpe_tokenizer: Tokenizer) -> None:
    info = load_tokenizer(tokenizer_dir, None)
    assert info.eos_ids == frozenset({token_id(bpe_tokenizer, "</s>")})
    assert info.end_id == token_id(bpe_tokenizer, "</s>")
    assert info.vocab_size == bpe_tokenizer.get_vocab_size(with_added_tokens=True)
    text = "Hello world, 中文"
    assert info.tokenizer.encode(text).ids == bpe_tokenizer.encode(text).ids


def test_folder_eos_as_added_token_dict(tokenizer_dir: Path, bpe_tokenizer: Tokenizer) -> None:
    config = {
        "eos_token": {
            "__type": "AddedToken",
            "content": "</s>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        }
    }
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    info = load_tokenizer(tokenizer_dir, None)
    assert info.eos_ids == frozenset({token_id(bpe_tokenizer, "</s>")})


def test_generation_config_int_joins_the_tokenizer_eos(
    tokenizer_dir: Path, bpe_tokenizer: Tokenizer
) -> None:
    bos, eos = token_id(bpe_tokenizer, "<s>"), token_id(bpe_tokenizer, "</s>")
    assert bos != eos
    (tokenizer_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": bos}))
    info = load_tokenizer(tokenizer_dir, None)
    assert info.eos_ids == frozenset({bos, eos})
    assert info.end_id == eos  # the tokenizer's own EOS is the engine's end id


def test_generation_config_list_gives_every_eos(
    tokenizer_dir: Path, bpe_tokenizer: Tokenizer
) -> None:
    """Llama 3 lists several EOS ids (`<|end_of_text|>`, `<|eot_id|>`, `<|eom_id|>`)."""
    ids = [token_id(bpe_tokenizer, "<s>"), bpe_tokenizer.encode("fox").ids[-1]]
    (tokenizer_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    info = load_tokenizer(tokenizer_dir, None)
    assert info.eos_ids == frozenset({*ids, token_id(bpe_tokenizer, "</s>")})
    assert info.end_id == token_id(bpe_tokenizer, "</s>")


def test_generation_config_without_eos_falls_back(
    tokenizer_dir: Path, bpe_tokenizer: Tokenizer
) -> None:
    (tokenizer_dir / "generation_config.json").write_text('{"bos_token_id": 0}')
    info = load_tokenizer(tokenizer_dir, None)
    assert info.eos_ids == frozenset({token_id(bpe_tokenizer, "</s>")})


def test_folder_without_configs_has_no_eos(tmp_path: Path, bpe_tokenizer: Tokenizer) -> None:
    bpe_tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path, None).eos_ids == frozenset()


@pytest.mark.parametrize(
    "with_generation_config",
    [pytest.param(False, id="tokenizer-config"), pytest.param(True, id="generation-config")],
)
def test_eos_token_setting_overrides_folder(
    tokenizer_dir: Path, bpe_tokenizer: Tokenizer, with_generation_config: bool
) -> None:
    if with_generation_config:
        config = {"eos_token_id": token_id(bpe_tokenizer, "</s>")}
        (tokenizer_dir / "generation_config.json").write_text(json.dumps(config))
    info = load_tokenizer(tokenizer_dir, "<s>")
    assert info.eos_ids == frozenset({token_id(bpe_tokenizer, "<s>")})


# --- errors ---------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    message = config_error(missing, None)
    assert "WORKER_TOKENIZER" in message
    assert str(missing) in message


def test_folder_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    message = config_error(tmp_path, None)
    assert "WORKER_TOKENIZER" in message
    assert "tokenizer.json" in message


CORRUPT = [
    pytest.param(b"", id="empty"),
    pytest.param(b"{not json", id="not-json"),
    pytest.param(b'{"version": "1.0"}', id="json-not-a-tokenizer"),
    pytest.param(b"[1, 2, 3]", id="json-array"),
    pytest.param(b"\xff\xfe\x00garbage", id="binary"),
]


@pytest.mark.parametrize("content", CORRUPT)
def test_corrupt_tokenizer_file(tmp_path: Path, content: bytes) -> None:
    file = tmp_path / "tokenizer.json"
    file.write_bytes(content)
    message = config_error(file, None)
    assert "WORKER_TOKENIZER" in message
    assert str(file) in message


@pytest.mark.parametrize("content", CORRUPT)
def test_corrupt_tokenizer_in_folder(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "tokenizer.json").write_bytes(content)
    message = config_error(tmp_path, None)
    assert "WORKER_TOKENIZER" in message


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json"])
def test_corrupt_config_in_folder(tokenizer_dir: Path, name: str) -> None:
    (tokenizer_dir / name).write_text("{broken")
    message = config_error(tokenizer_dir, None)
    assert "WORKER_TOKENIZER" in message
    assert name in message


@pytest.mark.parametrize(
    "eos_token",
    [
        pytest.param("<|eot_id|>", id="unknown"),
        pytest.param("</S>", id="wrong-case"),
        pytest.param(" </s>", id="leading-space"),
    ],
)
def test_unknown_eos_token_in_folder(tokenizer_dir: Path, eos_token: str) -> None:
    message = config_error(tokenizer_dir, eos_token)
    assert "WORKER_EOS_TOKEN" in message
    assert repr(eos_token) in message or eos_token in message
