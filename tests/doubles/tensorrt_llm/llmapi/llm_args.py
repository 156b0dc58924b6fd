# mirrors tensorrt_llm/llmapi/llm_args.py: KvCacheConfig, SchedulerConfig and TorchLlmArgs
# with every field of the real classes, at two API levels (tests/doubles/__init__.py):
# - 1.2: lists as at NVIDIA/TensorRT-LLM c292b9f9;
# - 1.4: lists as at 1f064c467a211b4168555ca06bb9b801c64eae20 (BaseLlmArgs + TorchLlmArgs;
#   KvCacheConfig without onboard_blocks; TorchLlmArgs without enable_sleep,
#   fail_fast_on_attention_window_too_large, disable_flashinfer_sampling; with
#   sleep_config, generation_config, encode_only, ...).
# Both checked by tests/unit/test_trtllm_fields.py; the fields the worker does not use
# are accepted, not modelled.
from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from tests.doubles import fake_gpu

from .._torch.peft.lora.config import LoraConfig

_LINE_1_4 = fake_gpu.line() >= (1, 4)


class WaitingQueuePolicy(StrEnum):
    """llm_args.py @ 1f064c46 (a StrEnum there): "fcfs", or "priority" (higher
    request.priority first, ties FCFS). PR #12362 (1.3) brought it; 1.2 has none."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class SchedulerConfig(BaseModel):
    """llm_args.py @ 1f064c46: capacity_scheduler_policy (GUARANTEED_NO_EVICT),
    context_chunking_policy, dynamic_batch_config, waiting_queue_policy (fcfs),
    use_python_scheduler, enable_prefix_aware_scheduling; extra fields forbidden. The
    1.2 class was not read here: the double gives both lines the 1.4 fields (1.2's
    LLM has no per-request priority, so its policy is never consulted)."""

    model_config = ConfigDict(extra="forbid")

    capacity_scheduler_policy: str = "GUARANTEED_NO_EVICT"
    context_chunking_policy: str | None = None
    dynamic_batch_config: Any = None
    waiting_queue_policy: WaitingQueuePolicy = WaitingQueuePolicy.FCFS
    use_python_scheduler: bool = False
    enable_prefix_aware_scheduling: bool = True


class _KvCacheConfigFields(BaseModel):
    """The fields both lines have (and the double models)."""

    model_config = ConfigDict(extra="forbid")

    enable_block_reuse: bool = True
    max_tokens: int | None = None
    max_attention_window: list[int] | None = None
    sink_token_length: int | None = None
    free_gpu_memory_fraction: float | None = 0.9
    host_cache_size: int | None = None
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


class _KvCacheConfig12(_KvCacheConfigFields):
    onboard_blocks: bool = True


_KV_CACHE_1_4_ONLY = (
    "avg_seq_len",
    "block_reuse_config",
    "disk_cache_path",
    "disk_cache_size",
    "disk_prefetch_num_reqs",
    "enable_kv_pool_rebalance",
    "enable_swa_scratch_reuse",
    "fp8_context_mla_kv_len_cap",
    "iteration_stats_interval",
    "kv_cache_event_hash_algo",
    "mamba_ssm_philox_rounds",
    "mamba_ssm_stochastic_rounding",
    "mamba_state_cache_interval",
    "mamba_state_config",
    "max_util_for_resume",
    "pool_ratio",
    "use_kv_cache_manager_v2",
)
_KvCacheConfig14: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "KvCacheConfig",
    __base__=_KvCacheConfigFields,
    **{name: (Any, None) for name in _KV_CACHE_1_4_ONLY},
)

KvCacheConfig: type[_KvCacheConfigFields] = _KvCacheConfig14 if _LINE_1_4 else _KvCacheConfig12


class _ModelledArgs(BaseModel):
    """The fields of TorchLlmArgs the double models (defaults as in 1.2 and 1.4 alike).
    The double rejects every other keyword, as the real LLM rejects keywords that are
    not TorchLlmArgs fields."""

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


class _TorchLlmArgs12(_ModelledArgs):
    """1.2 (c292b9f9): the rest of its fields, accepted, not modelled."""

    kv_cache_config: _KvCacheConfig12 = Field(default_factory=_KvCacheConfig12)
    sampler_type: Any = "auto"
    scheduler_config: Any = None
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
    sparse_attention_config: Any = None
    speculative_config: Any = None
    torch_compile_config: Any = None


_TORCH_1_4_UNMODELLED = (
    "allreduce_strategy",
    "attention_dp_config",
    "attn_backend",
    "batch_wait_max_tokens_ratio",
    "batch_wait_timeout_iters",
    "batch_wait_timeout_ms",
    "batched_logits_processor",
    "cache_transceiver_config",
    "checkpoint_format",
    "checkpoint_loader",
    "context_parallel_size",
    "cp_config",
    "cuda_graph_config",
    "custom_tokenizer",
    "decoding_config",
    "disable_mm_encoder",
    "disable_overlap_scheduler",
    "dwdp_config",
    "enable_attention_dp",
    "enable_autotuner",
    "enable_early_first_token_response",
    "enable_encoder_decoder_mixed_cuda_graph",
    "enable_energy_metrics",
    "enable_layerwise_nvtx_marker",
    "enable_lm_head_tp_in_adp",
    "enable_lora",
    "enable_low_latency_host_dispatch",
    "enable_min_latency",
    "enable_resource_governor",
    "enable_speculative_beam_history_d2h",
    "encode_only",
    "encoder_cuda_graph_config",
    "encoder_max_batch_size",
    "encoder_max_num_tokens",
    "env_overrides",
    "force_dynamic_quantization",
    "garbage_collection_gen0_threshold",
    "generation_config",
    "gms_config",
    "gpus_per_node",
    "iter_stats_max_iterations",
    "kv_cache_compression_config",
    "kv_connector_config",
    "layer_wise_benchmarks_config",
    "load_format",
    "lora_config",
    "max_stats_len",
    "mm_encoder_only",
    "model_kwargs",
    "moe_cluster_parallel_size",
    "moe_config",
    "moe_expert_parallel_size",
    "moe_tensor_parallel_size",
    "mpi_session",
    "multimodal_config",
    "mx_config",
    "num_serve_frontends",
    "nvfp4_gemm_config",
    "orchestrator_type",
    "otlp_traces_endpoint",
    "peft_cache_config",
    "perf_metrics_max_requests",
    "perf_metrics_output_dir",
    "post_processor_hook",
    "postprocess_tokenizer_dir",
    "pp_partition",
    "prometheus_metrics_config",
    "ray_placement_config",
    "ray_worker_extension_cls",
    "ray_worker_nsight_options",
    "reasoning_parser",
    "reorder_policy_config",
    "request_stats_max_iterations",
    "sampler_force_async_worker",
    "sleep_config",
    "sparse_attention_config",
    "speculative_config",
    "telemetry_config",
    "torch_compile_config",
    "use_cute_dsl_bf16_bmm",
    "use_cute_dsl_bf16_gemm",
    "use_cute_dsl_blockscaling_bmm",
    "use_cute_dsl_blockscaling_mm",
)

_TorchLlmArgs14: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "TorchLlmArgs",
    __base__=_ModelledArgs,
    kv_cache_config=(_KvCacheConfig14, Field(default_factory=_KvCacheConfig14)),
    scheduler_config=(SchedulerConfig, Field(default_factory=SchedulerConfig)),
    **{name: (Any, None) for name in _TORCH_1_4_UNMODELLED},
)
"""The fields of llm_args.py @ 1f064c46 less `sampler_type`, which PR #18232 (merged
2026-08-26, commit 77cc1453) removed with TRTLLMSampler: the 1.3.0rc26 and 1.4.0rc4
docs ("TorchSampler is the only sampler; the sampler_type argument and the TRTLLM Sampler
it selected have been removed"). How the LLM then treats the keyword: `LLM.__init__`."""

TorchLlmArgs: Any = _TorchLlmArgs14 if _LINE_1_4 else _TorchLlmArgs12
