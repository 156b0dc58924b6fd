# mirrors tensorrt_llm/lora_helper.py
# (NVIDIA/TensorRT-LLM @ 037d4ba10931fbb9777d52fba06a9aef4b41acdd): LoraConfig with the
# real fields and defaults, and the HF module mapping TensorRT-LLM uses for HF checkpoints.
# Loading adapters (use_lora, lora_manager.py) is not modelled.
#
# 1.4 line: PR #17806 (merged 2026-08-17) moved the PEFT modules under
# tensorrt_llm/_torch/peft/ and kept this path as a compatibility shim, which PR #17857
# made warn on import with a FutureWarning (as its review thread says; the shim's file was
# not read here). The double warns so at that level.
from __future__ import annotations

import warnings

from tests.doubles import fake_gpu

if fake_gpu.line() >= (1, 4):
    warnings.warn(
        "tensorrt_llm.lora_helper is deprecated; import from tensorrt_llm._torch.peft.lora",
        FutureWarning,
        stacklevel=2,
    )

from ._torch.peft.lora.config import LoraConfig, get_default_trtllm_modules_to_hf_modules

__all__ = ["LoraConfig", "get_default_trtllm_modules_to_hf_modules"]
