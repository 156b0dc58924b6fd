# mirrors tensorrt_llm/llmapi/llm_args.py (1.2.x): KvCacheConfig and TorchLlmArgs with every
# field of the real classes (lists as at NVIDIA/TensorRT-LLM c292b9f9, checked by
# tests/unit/test_trtllm_fields.py); the fields the worker does not use are accepted, not
# modelled.
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..lora_helper import LoraConfig


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

    # accepted as the real class accepts them; not modelled
    attention_dp_events_gather_period_ms: Any = None
    dtype: Any = None
    mamba_ssm_cache_dtype: Any = None
    max_gpu_total_bytes: Any = None
    tokens_per_block: Any = None


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
    # BaseLlmArgs: `lora_config: Optional[LoraConfig]` (a dataclass: a YAML mapping is
    # validated into one); a request's lora_request is applied only with it
    lora_config: LoraConfig | None = None

    # accepted as the real class accepts them; the double does not model what they do
    allreduce_strategy: Any = None
    attention_dp_config: Any = None
    attn_backend: Any = None
    batch_wait_max_tokens_ratio: Any = None
    batch_wait_timeout_iters: Any = None
    batch_wait_timeout_ms: Any = None
    batched_logits_processor: Any = None
    cache_transceiver_config: Any = None
    checkpoint_format: Any = None
    checkpoint_loader: Any = None
    context_parallel_size: Any = 1
    cp_config: Any = None
    cuda_graph_config: Any = None
    decoding_config: Any = None
    disable_flashinfer_sampling: Any = None
    disable_overlap_scheduler: Any = False
    enable_attention_dp: Any = False
    enable_autotuner: Any = True
    enable_layerwise_nvtx_marker: Any = None
    enable_lm_head_tp_in_adp: Any = None
    enable_lora: Any = False
    enable_min_latency: Any = None
    enable_sleep: Any = None
    env_overrides: Any = None
    fail_fast_on_attention_window_too_large: Any = None
    force_dynamic_quantization: Any = None
    garbage_collection_gen0_threshold: Any = None
    gpus_per_node: Any = None
    iter_stats_max_iterations: Any = None
    kv_connector_config: Any = None
    load_format: Any = "auto"
    mm_encoder_only: Any = None
    moe_cluster_parallel_size: Any = None
    moe_config: Any = None
    moe_expert_parallel_size: Any = None
    moe_tensor_parallel_size: Any = None
    mpi_session: Any = None
    nvfp4_gemm_config: Any = None
    orchestrator_type: Any = None
    otlp_traces_endpoint: Any = None
    peft_cache_config: Any = None
    perf_metrics_max_requests: Any = None
    postprocess_tokenizer_dir: Any = None
    pp_partition: Any = None
    ray_placement_config: Any = None
    ray_worker_extension_cls: Any = None
    reasoning_parser: Any = None
    request_stats_max_iterations: Any = None
    sampler_force_async_worker: Any = None
    sampler_type: Any = "auto"
    scheduler_config: Any = None
    sparse_attention_config: Any = None
    speculative_config: Any = None
    torch_compile_config: Any = None
