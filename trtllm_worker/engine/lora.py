"""LoRA adapters: the subfolders of `WORKER_LORA_DIR`, in Hugging Face PEFT layout, read
once at start. No TensorRT-LLM import: intake checks a job's `adapter` against them on
every engine, and `check` lists them.

Each adapter gets an integer id derived from its name (not from the folder's order), so
the id is the same after a restart and on every worker of a fleet that holds the same
folders: TensorRT-LLM caches adapters by that id (`LoRARequest.lora_int_id`)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.job import ADAPTER_PATTERN

SETTING = "WORKER_LORA_DIR"
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_NAME_RE = re.compile(ADAPTER_PATTERN)

HF_TO_TRTLLM_MODULES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_dense",
    "gate_proj": "mlp_h_to_4h",
    "down_proj": "mlp_4h_to_h",
    "up_proj": "mlp_gate",
    "gate_up_proj": "mlp_gate_up",
    "w1": "moe_h_to_4h",
    "w2": "moe_4h_to_h",
    "w3": "moe_gate",
    "gate": "moe_router",
}
"""PEFT's module names → TensorRT-LLM's `lora_target_modules` names: the inverse of
`get_default_trtllm_modules_to_hf_modules()` (tensorrt_llm/lora_helper.py @ 037d4ba1),
the mapping TensorRT-LLM itself uses for HF checkpoints."""


@dataclass(frozen=True, slots=True)
class Adapter:
    """One adapter folder, as its `adapter_config.json` describes it."""

    name: str
    """The folder's name: what a job gives as `adapter`."""
    id: int
    """Stable per name, 1 .. 2^31-1 (`adapter_id`)."""
    path: Path
    rank: int
    """The largest rank of its layers (`r`, or more in `rank_pattern`)."""
    target_modules: tuple[str, ...] | None
    """TensorRT-LLM's names of the modules it adapts; None: not a plain list of known
    module names (a regular expression, `all-linear`, or a module TensorRT-LLM's HF
    mapping lacks), so every module must be enabled."""


class Adapters(Mapping[str, Adapter]):
    """The adapters of one worker by name (empty without `WORKER_LORA_DIR`)."""

    def __init__(self, adapters: list[Adapter] | None = None) -> None:
        self._by_name = {adapter.name: adapter for adapter in adapters or []}

    def __getitem__(self, name: str) -> Adapter:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._by_name))

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def max_rank(self) -> int:
        return max((adapter.rank for adapter in self._by_name.values()), default=0)

    @property
    def target_modules(self) -> list[str] | None:
        """The union of their TensorRT-LLM module names, sorted; None when any adapter
        needs every module."""
        modules: set[str] = set()
        for adapter in self._by_name.values():
            if adapter.target_modules is None:
                return None
            modules.update(adapter.target_modules)
        return sorted(modules)

    def describe(self) -> str:
        """One line for the start log and `check`: `a (id 123, rank 8), b (...)`."""
        if not self._by_name:
            return "none"
        return ", ".join(f"{name} (id {self[name].id}, rank {self[name].rank})" for name in self)


def adapter_id(name: str) -> int:
    """The adapter's integer id: the first 4 bytes of SHA-256 of its name, as 1 .. 2^31-1
    (positive and within a 32-bit signed int, whatever TensorRT-LLM stores it in).
    Depends on the name only: stable across restarts and across workers."""
    value = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") & 0x7FFFFFFF
    return value or 1


def discover_adapters(folder: Path | None) -> Adapters:
    """Every adapter under `folder` (None: none). Hidden entries (`.cache`, …) and plain
    files are skipped; any other subfolder must load, else `ConfigError` naming it and
    why, so a typo in a deployment stops the worker at start rather than failing jobs."""
    if folder is None:
        return Adapters()
    if not folder.is_dir():
        raise ConfigError(f"invalid setting {SETTING}: {folder} is not a folder")
    adapters: list[Adapter] = []
    ids: dict[int, str] = {}
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        adapter = load_adapter(entry)
        other = ids.get(adapter.id)
        if other is not None:  # about one chance in 2^31 per pair: rename one
            raise ConfigError(
                f"invalid setting {SETTING}: adapters {other!r} and {adapter.name!r} hash to "
                f"the same id {adapter.id}; rename one of the folders"
            )
        ids[adapter.id] = adapter.name
        adapters.append(adapter)
    return Adapters(adapters)


def load_adapter(path: Path) -> Adapter:
    """One PEFT adapter folder; `ConfigError` naming the folder and what is wrong."""

    def broken(why: str) -> ConfigError:
        return ConfigError(f"invalid setting {SETTING}: adapter folder {path}: {why}")

    if not _NAME_RE.fullmatch(path.name):
        raise broken(
            "the name is not usable as a job's adapter (letters, digits, '.', '_', '-', "
            "at most 128, starting with a letter or digit)"
        )
    try:
        config: Any = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise broken(f"no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise broken(f"{CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise broken(f"{CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise broken(f"peft_type is {peft_type!r}, not LORA")
    rank = _rank(config, broken)
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise broken(f"no weights ({' or '.join(WEIGHT_FILES)})")
    return Adapter(path.name, adapter_id(path.name), path, rank, _modules(config, broken))


def _rank(config: dict[str, Any], broken: Any) -> int:
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise broken(f"r (the rank) must be a positive integer, not {rank!r}")
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise broken("rank_pattern must be an object")
    for value in pattern.values():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise broken(f"rank_pattern ranks must be positive integers, not {value!r}")
        rank = max(rank, value)
    return rank


def _modules(config: dict[str, Any], broken: Any) -> tuple[str, ...] | None:
    modules = config.get("target_modules")
    if isinstance(modules, str) or modules is None:
        return None  # a regular expression or "all-linear": any module may be adapted
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise broken("target_modules must be a list of module names or a string")
    names = [HF_TO_TRTLLM_MODULES.get(module.rsplit(".", 1)[-1]) for module in modules]
    if not names or any(name is None for name in names):
        return None
    return tuple(sorted({name for name in names if name is not None}))
