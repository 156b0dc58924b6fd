"""Real checkpoints' tokenizers, made at test time from files a PyPI package ships (no
model hub): mistral-common holds Mistral's SentencePiece model (Mistral 7B v0.1: the
Llama 2 family's byte-fallback SentencePiece, 32,000 pieces) and its Tekken file
(Mistral NeMo: a tiktoken-style byte-level BPE of 131,072 ids, the first 1,000 of them
control tokens); transformers converts both to `tokenizer.json`, as the Hub's own copies
were made. Each model folder also gets what a real checkpoint has beside its tokenizer:
`tokenizer_config.json` (special tokens, chat template) and `generation_config.json`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mistral_common

DATA = Path(mistral_common.__file__).parent / "data"
SENTENCEPIECE_MODEL = DATA / "tokenizer.model.v1"
TEKKEN_FILE = DATA / "tekken_240911.json"
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def sentencepiece_folder(folder: Path) -> Path:
    """Mistral 7B v0.1's tokenizer as a model folder: `<s>` 1, `</s>` 2, byte fallback,
    `▁` for spaces; the Mistral instruct chat template."""
    from transformers import LlamaTokenizer

    source = folder / "sentencepiece"
    source.mkdir(parents=True)
    shutil.copy(SENTENCEPIECE_MODEL, source / "tokenizer.model")
    slow = LlamaTokenizer.from_pretrained(str(source))
    model = folder / "mistral-7b"
    model.mkdir()
    slow.backend_tokenizer.save(str(model / "tokenizer.json"))
    _configs(
        model,
        bos="<s>",
        eos="</s>",
        eos_ids=[2],
        chat_template=template("mistral-7b-instruct-v0.2"),
    )
    return model


def tekken_folder(folder: Path) -> Path:
    """Mistral NeMo's Tekken tokenizer as a model folder: control tokens `<s>` 1, `</s>`
    2, `[INST]` 3, `[/INST]` 4, ... up to id 999, then byte-level BPE."""
    from transformers.integrations.mistral.tokenizer import MistralConverter

    model = folder / "mistral-nemo"
    model.mkdir(parents=True)
    MistralConverter(str(TEKKEN_FILE)).converted().save(str(model / "tokenizer.json"))
    _configs(model, bos="<s>", eos="</s>", eos_ids=[2], chat_template=None)
    return model


def _configs(
    model: Path, *, bos: str, eos: str, eos_ids: list[int], chat_template: str | None
) -> None:
    config: dict[str, object] = {"bos_token": bos, "eos_token": eos, "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (model / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (model / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": eos_ids}), encoding="utf-8"
    )


def hf_tokenizer(model: Path, chat_template: str | None = None) -> Any:
    """transformers' own tokenizer over the same files: the reference for rendering."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((model / "tokenizer_config.json").read_text(encoding="utf-8"))
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_file=str(model / "tokenizer.json"),
        bos_token=config.get("bos_token"),
        eos_token=config.get("eos_token"),
        unk_token=config.get("unk_token"),
        chat_template=chat_template or config.get("chat_template"),
    )
