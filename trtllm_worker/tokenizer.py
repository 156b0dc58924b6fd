"""Loading the tokenizer and what the worker must know about the model around it: a
`tokenizer.json`, a model folder (its `tokenizer_config.json`, `generation_config.json`
and `chat_template.jinja`), or the built-in byte-level tokenizer that needs no file."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from trtllm_worker.config import Settings
from trtllm_worker.contract.errors import ConfigError

BUILTIN_SPECIAL_TOKENS = ("</s>",)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens a chat template sees as variables (transformers'
`SPECIAL_TOKENS_ATTRIBUTES`)."""


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """The tokenizer with what the worker needs to know about it."""

    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    vocab_size: int
    source: str
    primary_eos_id: int | None = None
    """The tokenizer's own EOS (`eos_token`), the engine's end id; else the smallest."""
    special_ids: frozenset[int] = frozenset()
    """Ids the tokenizer itself marks special (BOS, EOS, pad, control tokens)."""
    special_tokens: dict[str, str] = field(default_factory=dict)
    """`bos_token`, `eos_token`, ... as strings, for the chat template."""
    chat_template: str | None = None
    chat_template_source: str | None = None
    tool_chat_template: str | None = None
    """A model's `tool_use` template (tokenizer_config's named templates), used when a
    job gives `tools`, as transformers does."""

    @property
    def end_id(self) -> int:
        """The id engines use as end id, -1 when there is none."""
        if self.primary_eos_id is not None:
            return self.primary_eos_id
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


def tokenizer_for(settings: Settings) -> TokenizerInfo:
    """The tokenizer the settings name (`WORKER_TOKENIZER`, `WORKER_EOS_TOKEN`,
    `WORKER_CHAT_TEMPLATE`)."""
    return load_tokenizer(settings.tokenizer_source, settings.eos_token, settings.chat_template)


def load_tokenizer(
    path: Path | None, eos_token: str | None, chat_template: Path | None = None
) -> TokenizerInfo:
    """Load as the settings say; raise `ConfigError` with one line on any problem."""
    eos_ids: set[int] = set()
    config: dict[str, Any] = {}
    template: tuple[str, str] | None = None
    if path is None:
        tokenizer = builtin_byte_tokenizer()
        source = "built-in byte-level"
    elif path.is_dir():
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"invalid setting WORKER_TOKENIZER: {path} holds no tokenizer.json")
        tokenizer = _read(file)
        config = _read_json(path / "tokenizer_config.json")
        eos_ids = _generation_eos_ids(path)
        template = _folder_template(path, config)
        source = str(path)
    elif path.is_file():
        tokenizer = _read(path)
        source = str(path)
    else:
        raise ConfigError(f"invalid setting WORKER_TOKENIZER: {path} does not exist")
    special_tokens = _special_tokens(config)
    primary = _token_id(tokenizer, special_tokens.get("eos_token"))
    if eos_token is not None:
        primary = tokenizer.token_to_id(eos_token)
        if primary is None:
            raise ConfigError(
                f"invalid setting WORKER_EOS_TOKEN: {eos_token!r} is not in the vocabulary"
            )
        eos_ids = set()
        special_tokens["eos_token"] = eos_token
    if primary is not None:
        eos_ids.add(primary)
    if chat_template is not None:
        template = (_read_template(chat_template), str(chat_template))
    return TokenizerInfo(
        tokenizer=tokenizer,
        eos_ids=frozenset(eos_ids),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        source=source,
        primary_eos_id=primary,
        special_ids=frozenset(
            token_id
            for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if added.special
        ),
        special_tokens=special_tokens,
        chat_template=None if template is None else template[0],
        chat_template_source=None if template is None else template[1],
        tool_chat_template=None
        if chat_template is not None
        else _named_template(config, "tool_use"),
    )


def _read(file: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"invalid setting WORKER_TOKENIZER: cannot load {file}: {reason}"
        ) from None


def _generation_eos_ids(folder: Path) -> set[int]:
    """Every id of `eos_token_id` in `generation_config.json` (an int, or a list as for
    Llama 3)."""
    value = _read_json(folder / "generation_config.json").get("eos_token_id")
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The named special tokens of `tokenizer_config.json` (a string, or an AddedToken
    object with `content`)."""
    tokens: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _token_id(tokenizer: Tokenizer, token: str | None) -> int | None:
    return None if token is None else tokenizer.token_to_id(token)


def _folder_template(folder: Path, config: dict[str, Any]) -> tuple[str, str] | None:
    """The model's chat template: `chat_template.jinja`, else `tokenizer_config.json`'s
    `chat_template` (a string, or a list of named templates: the `default` one)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return _read_template(jinja), str(jinja)
    value = config.get("chat_template")
    if isinstance(value, list):
        value = _named_template(config, "default")
    if isinstance(value, str) and value:
        return value, str(folder / "tokenizer_config.json")
    return None


def _named_template(config: dict[str, Any], name: str) -> str | None:
    value = config.get("chat_template")
    if not isinstance(value, list):
        return None
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    template = named.get(name)
    return template if isinstance(template, str) else None


def _read_template(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"invalid setting WORKER_CHAT_TEMPLATE: cannot read {file}: {exc}"
        ) from None


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"invalid setting WORKER_TOKENIZER: cannot read {file}: {exc}") from None
    return data if isinstance(data, dict) else {}
