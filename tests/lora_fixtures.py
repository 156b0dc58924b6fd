"""Tiny Hugging Face PEFT adapter folders for tests: an `adapter_config.json` and a
placeholder weights file (the worker only checks that the weights are there;
TensorRT-LLM reads them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_adapter(
    root: Path,
    name: str,
    *,
    rank: Any = 8,
    target_modules: Any = ("q_proj", "v_proj"),
    weights: str | None = "adapter_model.safetensors",
    **config: Any,
) -> Path:
    """`root/name` as a PEFT LoRA adapter; `weights` None leaves the weights out."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    modules = list(target_modules) if isinstance(target_modules, tuple) else target_modules
    values = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": modules,
        "base_model_name_or_path": "base",
        **config,
    }
    (folder / "adapter_config.json").write_text(json.dumps(values))
    if weights is not None:
        (folder / weights).write_bytes(b"\0" * 16)
    return folder
