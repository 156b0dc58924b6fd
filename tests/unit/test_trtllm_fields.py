"""The double's configuration classes accept exactly the fields the real ones do, so a
user's valid `WORKER_LLM_EXTRA_OPTIONS` file is valid against the double, and one the
real LLM would refuse is refused by it too. The lists are copied from NVIDIA/TensorRT-LLM:

- `TorchLlmArgs` (with the fields it inherits from `BaseLlmArgs`) and `KvCacheConfig`:
  `tensorrt_llm/llmapi/llm_args.py` at commit c292b9f997d68a6386229cee043c2e8151b1025a,
  the nearest to the 1.2 release whose file could be read here (the v1.2.0 tag's copy
  could not: see the README's GPU section); private attributes left out.
- `SamplingParams`: `tensorrt_llm/sampling_params.py` at the 1.2.0rc2 tag,
  b35ac1b64368513d215c57d2ed01d62d910df8da; its init fields, private ones left out.
- The 1.4 line: `TorchLlmArgs` (with `BaseLlmArgs`'s fields) and `KvCacheConfig` from
  `tensorrt_llm/llmapi/llm_args.py` at 1f064c467a211b4168555ca06bb9b801c64eae20 (1.4-era
  main, after PRs #15918 and #16369; the 1.4.0rc1 tag could not be read). The 1.4
  `SamplingParams` (executor/params/sampling.py, with `logprobs_mode` and more) is not
  modelled: its test runs on 1.2 only."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.doubles import FakeGpu, install_tensorrt_llm

TORCH_LLM_ARGS = [
    "allreduce_strategy",
    "attention_dp_config",
    "attn_backend",
    "backend",
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
    "decoding_config",
    "disable_flashinfer_sampling",
    "disable_overlap_scheduler",
    "dtype",
    "enable_attention_dp",
    "enable_autotuner",
    "enable_chunked_prefill",
    "enable_iter_perf_stats",
    "enable_iter_req_stats",
    "enable_layerwise_nvtx_marker",
    "enable_lm_head_tp_in_adp",
    "enable_lora",
    "enable_min_latency",
    "enable_sleep",
    "env_overrides",
    "fail_fast_on_attention_window_too_large",
    "force_dynamic_quantization",
    "garbage_collection_gen0_threshold",
    "gather_generation_logits",
    "gpus_per_node",
    "guided_decoding_backend",
    "iter_stats_max_iterations",
    "kv_cache_config",
    "kv_connector_config",
    "load_format",
    "lora_config",
    "max_batch_size",
    "max_beam_width",
    "max_input_len",
    "max_num_tokens",
    "max_seq_len",
    "mm_encoder_only",
    "model",
    "moe_cluster_parallel_size",
    "moe_config",
    "moe_expert_parallel_size",
    "moe_tensor_parallel_size",
    "mpi_session",
    "num_postprocess_workers",
    "nvfp4_gemm_config",
    "orchestrator_type",
    "otlp_traces_endpoint",
    "peft_cache_config",
    "perf_metrics_max_requests",
    "pipeline_parallel_size",
    "postprocess_tokenizer_dir",
    "pp_partition",
    "print_iter_log",
    "ray_placement_config",
    "ray_worker_extension_cls",
    "reasoning_parser",
    "request_stats_max_iterations",
    "return_perf_metrics",
    "revision",
    "sampler_force_async_worker",
    "sampler_type",
    "scheduler_config",
    "skip_tokenizer_init",
    "sparse_attention_config",
    "speculative_config",
    "stream_interval",
    "tensor_parallel_size",
    "tokenizer",
    "tokenizer_mode",
    "tokenizer_revision",
    "torch_compile_config",
    "trust_remote_code",
]

KV_CACHE_CONFIG = [
    "attention_dp_events_gather_period_ms",
    "copy_on_partial_reuse",
    "cross_kv_cache_fraction",
    "dtype",
    "enable_block_reuse",
    "enable_partial_reuse",
    "event_buffer_max_size",
    "free_gpu_memory_fraction",
    "host_cache_size",
    "mamba_ssm_cache_dtype",
    "max_attention_window",
    "max_gpu_total_bytes",
    "max_tokens",
    "onboard_blocks",
    "secondary_offload_min_priority",
    "sink_token_length",
    "tokens_per_block",
    "use_uvm",
]

SAMPLING_PARAMS = [
    "add_special_tokens",
    "additional_model_outputs",
    "apply_batched_logits_processor",
    "bad",
    "bad_token_ids",
    "beam_search_diversity_rate",
    "beam_width_array",
    "best_of",
    "detokenize",
    "early_stopping",
    "embedding_bias",
    "end_id",
    "exclude_input_from_output",
    "frequency_penalty",
    "guided_decoding",
    "ignore_eos",
    "include_stop_str_in_output",
    "length_penalty",
    "logits_processor",
    "logprobs",
    "lookahead_config",
    "max_tokens",
    "min_p",
    "min_tokens",
    "n",
    "no_repeat_ngram_size",
    "pad_id",
    "presence_penalty",
    "prompt_ignore_length",
    "prompt_logprobs",
    "repetition_penalty",
    "return_context_logits",
    "return_encoder_output",
    "return_generation_logits",
    "return_perf_metrics",
    "seed",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_k",
    "top_p",
    "top_p_decay",
    "top_p_min",
    "top_p_reset_ids",
    "truncate_prompt_tokens",
    "use_beam_search",
]


GONE_IN_1_4 = {
    "disable_flashinfer_sampling",
    "enable_sleep",
    "fail_fast_on_attention_window_too_large",
    "sampler_type",  # PR #18232, after 1f064c46 (the 1.4.0rc docs: TorchSampler only)
}
NEW_IN_1_4 = {
    "custom_tokenizer",
    "disable_mm_encoder",
    "dwdp_config",
    "enable_early_first_token_response",
    "enable_encoder_decoder_mixed_cuda_graph",
    "enable_energy_metrics",
    "enable_low_latency_host_dispatch",
    "enable_resource_governor",
    "enable_speculative_beam_history_d2h",
    "encode_only",
    "encoder_cuda_graph_config",
    "encoder_max_batch_size",
    "encoder_max_num_tokens",
    "generation_config",
    "gms_config",
    "kv_cache_compression_config",
    "layer_wise_benchmarks_config",
    "max_stats_len",
    "model_kwargs",
    "multimodal_config",
    "mx_config",
    "num_serve_frontends",
    "perf_metrics_output_dir",
    "post_processor_hook",
    "prometheus_metrics_config",
    "ray_worker_nsight_options",
    "reorder_policy_config",
    "sleep_config",
    "telemetry_config",
    "use_cute_dsl_bf16_bmm",
    "use_cute_dsl_bf16_gemm",
    "use_cute_dsl_blockscaling_bmm",
    "use_cute_dsl_blockscaling_mm",
}
TORCH_LLM_ARGS_1_4 = sorted((set(TORCH_LLM_ARGS) - GONE_IN_1_4) | NEW_IN_1_4)
"""The 1.4 list, written as its difference from 1.2's: 111 fields at 1f064c46, less
`sampler_type` (PR #18232)."""

KV_CACHE_CONFIG_1_4 = sorted(
    (set(KV_CACHE_CONFIG) - {"onboard_blocks"})
    | {
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
    }
)

SCHEDULER_CONFIG_1_4 = [
    "capacity_scheduler_policy",
    "context_chunking_policy",
    "dynamic_batch_config",
    "enable_prefix_aware_scheduling",
    "use_python_scheduler",
    "waiting_queue_policy",
]

LINES = [pytest.param("1.2.1", id="1.2"), pytest.param("1.4.0rc1", id="1.4")]


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    return install_tensorrt_llm(monkeypatch)


@pytest.mark.parametrize("version", LINES)
def test_torch_llm_args_fields_are_the_real_ones(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    install_tensorrt_llm(monkeypatch, version)
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    expected = TORCH_LLM_ARGS if version.startswith("1.2") else TORCH_LLM_ARGS_1_4
    assert sorted(TorchLlmArgs.model_fields) == expected


def test_the_1_4_list_has_as_many_fields_as_the_source() -> None:
    """Counted in llm_args.py @ 1f064c46: 59 BaseLlmArgs fields and 54 of TorchLlmArgs,
    two of which (`load_format`, `backend`) override BaseLlmArgs's; PR #18232 then removed
    `sampler_type`."""
    assert len(TORCH_LLM_ARGS_1_4) == 59 + 54 - 2 - 1
    assert len(KV_CACHE_CONFIG_1_4) == 34


@pytest.mark.parametrize("version", LINES)
def test_kv_cache_config_fields_are_the_real_ones(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    install_tensorrt_llm(monkeypatch, version)
    from tensorrt_llm.llmapi import KvCacheConfig

    expected = KV_CACHE_CONFIG if version.startswith("1.2") else KV_CACHE_CONFIG_1_4
    assert sorted(KvCacheConfig.model_fields) == expected


def test_scheduler_config_fields_are_the_1_4_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    install_tensorrt_llm(monkeypatch, "1.4.0rc1")
    from tensorrt_llm.llmapi import SchedulerConfig

    assert sorted(SchedulerConfig.model_fields) == SCHEDULER_CONFIG_1_4


def test_sampling_params_fields_are_the_real_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    install_tensorrt_llm(monkeypatch, "1.2.1")
    from tensorrt_llm import SamplingParams

    fields = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
    assert sorted(f for f in fields if not f.startswith("_")) == SAMPLING_PARAMS


def test_an_extra_options_field_the_worker_does_not_model_is_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`cuda_graph_config`, `sampler_type`, `moe_config`: fields a user's file holds (1.2:
    the 1.4 refusal message differs, see test_trtllm_double.py)."""
    install_tensorrt_llm(monkeypatch, "1.2.1")
    from tensorrt_llm import LLM

    options: dict[str, Any] = {
        "cuda_graph_config": {"batch_sizes": [1, 2]},
        "sampler_type": "TorchSampler",
    }
    with LLM("ckpt", skip_tokenizer_init=True, **options) as llm:
        assert llm.args.sampler_type == "TorchSampler"
    with pytest.raises(ValueError, match="LLM got invalid argument: cuda_graphs"):
        LLM("ckpt", skip_tokenizer_init=True, cuda_graphs=True)
