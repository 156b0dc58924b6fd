"""Loading the tokenizer and its end-of-sequence ids: a `tokenizer.json`, a model folder,
or the built-in byte-level tokenizer that needs no file and no download."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from worker.contract.errors import ConfigError

BUILTIN_SPECIAL_TOKENS = ("</s>",)


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """The tokenizer with what the worker needs to know about it."""

    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    vocab_size: int
    source: str

    @property
    def end_id(self) -> int:
        """The id engines use as end id (the smallest EOS id), -1 when there is none."""
        return min(self.eos_ids) if self.eos_ids else -1


def builtin_byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: token id k is byte k, so any text round-trips
    and the prompt `abc` is ids [97, 98, 99]. `</s>` (id 256) is a special token."""
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in BUILTIN_SPECIAL_TOKENS])
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table (what ByteLevel expects)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_tokenizer(path: Path | None, eos_token: str | None) -> TokenizerInfo:
    """Load as the settings say; raise `ConfigError` with one line on any problem."""
    eos_ids: set[int] = set()
    if path is None:
        tokenizer = builtin_byte_tokenizer()
        source = "built-in byte-level"
    elif path.is_dir():
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"invalid setting WORKER_TOKENIZER: {path} holds no tokenizer.json")
        tokenizer = _read(file)
        eos_ids = _folder_eos_ids(path, tokenizer)
        source = str(path)
    elif path.is_file():
        tokenizer = _read(path)
        source = str(path)
    else:
        raise ConfigError(f"invalid setting WORKER_TOKENIZER: {path} does not exist")
    if eos_token is not None:
        token_id = tokenizer.token_to_id(eos_token)
        if token_id is None:
            raise ConfigError(
                f"invalid setting WORKER_EOS_TOKEN: {eos_token!r} is not in the vocabulary"
            )
        eos_ids = {token_id}
    return TokenizerInfo(
        tokenizer=tokenizer,
        eos_ids=frozenset(eos_ids),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        source=source,
    )


def _read(file: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"invalid setting WORKER_TOKENIZER: cannot load {file}: {reason}"
        ) from None


def _folder_eos_ids(folder: Path, tokenizer: Tokenizer) -> set[int]:
    """EOS ids from `generation_config.json` (`eos_token_id`, int or list), else from
    `tokenizer_config.json` (`eos_token`, string or AddedToken dict)."""
    generation = _read_json(folder / "generation_config.json")
    value = generation.get("eos_token_id")
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return set(value)
    config = _read_json(folder / "tokenizer_config.json")
    token = config.get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str):
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return {token_id}
    return set()


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"invalid setting WORKER_TOKENIZER: cannot read {file}: {exc}") from None
    return data if isinstance(data, dict) else {}
