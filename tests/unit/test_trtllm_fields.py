"""The double's configuration classes accept exactly the fields the real ones do, so a
user's valid `WORKER_LLM_EXTRA_OPTIONS` file is valid against the double, and one the
real LLM would refuse is refused by it too. The lists are copied from NVIDIA/TensorRT-LLM:

- `TorchLlmArgs` (with the fields it inherits from `BaseLlmArgs`) and `KvCacheConfig`:
  `tensorrt_llm/llmapi/llm_args.py` at commit c292b9f997d68a6386229cee043c2e8151b1025a,
  the nearest to the 1.2 release whose file could be read here (the v1.2.0 tag's copy
  could not: see the README's GPU section); private attributes left out.
- `SamplingParams`: `tensorrt_llm/sampling_params.py` at the 1.2.0rc2 tag,
  b35ac1b64368513d215c57d2ed01d62d910df8da; its init fields, private ones left out."""

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


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    return install_tensorrt_llm(monkeypatch)


def test_torch_llm_args_fields_are_the_real_ones(gpu: FakeGpu) -> None:
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    assert sorted(TorchLlmArgs.model_fields) == TORCH_LLM_ARGS


def test_kv_cache_config_fields_are_the_real_ones(gpu: FakeGpu) -> None:
    from tensorrt_llm.llmapi import KvCacheConfig

    assert sorted(KvCacheConfig.model_fields) == KV_CACHE_CONFIG


def test_sampling_params_fields_are_the_real_ones(gpu: FakeGpu) -> None:
    from tensorrt_llm import SamplingParams

    fields = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
    assert sorted(f for f in fields if not f.startswith("_")) == SAMPLING_PARAMS


def test_an_extra_options_field_the_worker_does_not_model_is_accepted(gpu: FakeGpu) -> None:
    """`cuda_graph_config`, `sampler_type`, `moe_config`: fields a user's file holds."""
    from tensorrt_llm import LLM

    options: dict[str, Any] = {
        "cuda_graph_config": {"batch_sizes": [1, 2]},
        "sampler_type": "TorchSampler",
    }
    with LLM("ckpt", skip_tokenizer_init=True, **options) as llm:
        assert llm.args.sampler_type == "TorchSampler"
    with pytest.raises(ValueError, match="LLM got invalid argument: cuda_graphs"):
        LLM("ckpt", skip_tokenizer_init=True, cuda_graphs=True)
