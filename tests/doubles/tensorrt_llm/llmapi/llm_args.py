# mirrors tensorrt_llm/llmapi/llm_args.py (1.2.x): KvCacheConfig and the subset of
# TorchLlmArgs the worker passes.  Both are pydantic models that forbid unknown fields.
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class KvCacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enable_block_reuse: bool = True
    max_tokens: int | None = None
    max_attention_window: list[int] | None = None
    sink_token_length: int | None = None
    free_gpu_memory_fraction: float | None = 0.9
    host_cache_size: int | None = None
    onboard_blocks: bool = True
    cross_kv_cache_fraction: float | None = None
    secondary_offload_min_priority: int | None = None
    event_buffer_max_size: int = 0
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    use_uvm: bool = False


class TorchLlmArgs(BaseModel):
    """Subset of the real fields (defaults as in 1.2).  The double rejects every other
    keyword, as the real LLM rejects keywords that are not TorchLlmArgs fields."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: str
    tokenizer: Any | None = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dtype: str = "auto"
    revision: str | None = None
    tokenizer_revision: str | None = None
    backend: str = "pytorch"
    max_batch_size: int | None = 2048
    max_input_len: int | None = 1024
    max_seq_len: int | None = None
    max_beam_width: int | None = 1
    max_num_tokens: int | None = 8192
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    enable_chunked_prefill: bool = False
    gather_generation_logits: bool = False
    enable_iter_perf_stats: bool = False
    enable_iter_req_stats: bool = False
    print_iter_log: bool = False
    return_perf_metrics: bool = False
    stream_interval: int = 1
    # BaseLlmArgs (llm_args.py): "llguidance is supported in PyTorch backend only"; None
    # builds no guided decoder, and a request's guided_decoding is then ignored
    guided_decoding_backend: Literal["xgrammar", "llguidance"] | None = None
    num_postprocess_workers: int = 0
