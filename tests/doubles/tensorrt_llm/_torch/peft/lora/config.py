# mirrors tensorrt_llm/_torch/peft/lora/config.py, where PR #17806 (merged 2026-08-17)
# moved LoraConfig and the HF module mapping from tensorrt_llm/lora_helper.py; the
# definitions follow lora_helper.py @ 037d4ba1 (see the double's lora_helper.py). The double
# has this module on both lines (the adapter never imports it: 1.2 has only lora_helper).
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LoraConfig", "get_default_trtllm_modules_to_hf_modules"]


def get_default_trtllm_modules_to_hf_modules() -> dict[str, str]:
    """TensorRT-LLM module name → HF module name (the real function's table)."""
    return {
        "attn_q": "q_proj",
        "attn_k": "k_proj",
        "attn_v": "v_proj",
        "attn_dense": "o_proj",
        "mlp_h_to_4h": "gate_proj",
        "mlp_4h_to_h": "down_proj",
        "mlp_gate": "up_proj",
        "mlp_gate_up": "gate_up_proj",
        "moe_h_to_4h": "w1",
        "moe_4h_to_h": "w2",
        "moe_gate": "w3",
        "moe_router": "gate",
    }


@dataclass
class LoraConfig:
    """The real dataclass's fields; `__post_init__` asserts the checkpoint source."""

    lora_dir: list[str] = field(default_factory=list)
    lora_ckpt_source: str = "hf"
    max_lora_rank: int = 64
    lora_target_modules: list[str] = field(default_factory=list)
    trtllm_modules_to_hf_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    swap_gate_up_proj: bool = True

    def __post_init__(self) -> None:
        assert self.lora_ckpt_source in ["hf", "nemo"], (
            f"lora_ckpt_source must be one of 'hf' or 'nemo', got {self.lora_ckpt_source}"
        )
