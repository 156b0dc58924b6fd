"""Double of ``tensorrt_llm.bindings.executor`` (the C++ Executor binding), 1.2.x.

Signatures copied from the nanobind stub committed as tensorrt_llm/executor/__init__.pyi
(commit 2a17ead6) and cpp/tensorrt_llm/nanobind/executor/{executor,request,executorConfig}.cpp;
behaviour from cpp/tensorrt_llm/executor/executorImpl.cpp and responseImpl.h.
nanobind raises ``RuntimeError`` for every TLLM_CHECK / TLLM_THROW, so the double does too.
"""

from __future__ import annotations

import enum
import functools
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, overload

from tests.doubles import fake_gpu
from tests.doubles.fake_gpu import Finish, IterStats, Job, Step


# mirrors cpp/include/tensorrt_llm/executor/types.h enums as bound by nanobind (enum.Enum)
class ModelType(enum.Enum):
    DECODER_ONLY = 0
    ENCODER_ONLY = 1
    ENCODER_DECODER = 2


class CapacitySchedulerPolicy(enum.Enum):
    MAX_UTILIZATION = 0
    GUARANTEED_NO_EVICT = 1
    STATIC_BATCH = 2


class ContextChunkingPolicy(enum.Enum):
    FIRST_COME_FIRST_SERVED = 0
    EQUAL_PROGRESS = 1


class CommunicationType(enum.Enum):
    MPI = 0


class CommunicationMode(enum.Enum):
    LEADER = 0
    ORCHESTRATOR = 1


class BatchingType(enum.Enum):
    STATIC = 0
    INFLIGHT = 1


class RequestType(enum.Enum):
    REQUEST_TYPE_CONTEXT_AND_GENERATION = 0
    REQUEST_TYPE_CONTEXT_ONLY = 1
    REQUEST_TYPE_GENERATION_ONLY = 2


class FinishReason(enum.Enum):
    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


_FINISH: dict[Finish, FinishReason] = {
    "end_id": FinishReason.END_ID,
    "stop_words": FinishReason.STOP_WORDS,
    "length": FinishReason.LENGTH,
    "timed_out": FinishReason.TIMED_OUT,
    "cancelled": FinishReason.CANCELLED,
}


def _check(condition: bool, what: str) -> None:
    """TLLM_CHECK: a failed check surfaces in Python as RuntimeError."""
    if not condition:
        raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: {what}")


def _seconds(value: timedelta | float | None) -> float | None:
    """nanobind's chrono caster: a timedelta, or a float read as SECONDS (not milliseconds)."""
    if value is None or isinstance(value, timedelta):
        return None if value is None else value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"incompatible function arguments: {value!r} is not a duration")
    return float(value)


# mirrors cpp/tensorrt_llm/nanobind/executor/executorConfig.cpp (KvCacheConfig)
class KvCacheConfig:
    def __init__(
        self,
        enable_block_reuse: bool = True,
        max_tokens: int | None = None,
        max_attention_window: Sequence[int] | None = None,
        sink_token_length: int | None = None,
        free_gpu_memory_fraction: float | None = None,
        host_cache_size: int | None = None,
        onboard_blocks: bool = True,
        cross_kv_cache_fraction: float | None = None,
        secondary_offload_min_priority: int | None = None,
        event_buffer_max_size: int = 0,
        *,
        enable_partial_reuse: bool = True,
        copy_on_partial_reuse: bool = True,
        use_uvm: bool = False,
        attention_dp_events_gather_period_ms: int = 5,
        runtime_defaults: Any | None = None,
        max_gpu_total_bytes: int = 0,
    ) -> None:
        self.enable_block_reuse = enable_block_reuse
        self.max_tokens = max_tokens
        self.max_attention_window = (
            None if max_attention_window is None else list(max_attention_window)
        )
        self.sink_token_length = sink_token_length
        self.free_gpu_memory_fraction = free_gpu_memory_fraction  # None means 0.9 in C++
        self.host_cache_size = host_cache_size
        self.onboard_blocks = onboard_blocks
        self.cross_kv_cache_fraction = cross_kv_cache_fraction
        self.secondary_offload_min_priority = secondary_offload_min_priority
        self.event_buffer_max_size = event_buffer_max_size
        self.enable_partial_reuse = enable_partial_reuse
        self.copy_on_partial_reuse = copy_on_partial_reuse
        self.use_uvm = use_uvm
        self.attention_dp_events_gather_period_ms = attention_dp_events_gather_period_ms
        self.max_gpu_total_bytes = max_gpu_total_bytes


_GUARANTEED_NO_EVICT = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT


# mirrors executorConfig.cpp (SchedulerConfig); its properties are read-only in the binding
class SchedulerConfig:
    def __init__(
        self,
        capacity_scheduler_policy: CapacitySchedulerPolicy = _GUARANTEED_NO_EVICT,
        context_chunking_policy: ContextChunkingPolicy | None = None,
        dynamic_batch_config: Any | None = None,
    ) -> None:
        self._capacity_scheduler_policy = capacity_scheduler_policy
        self._context_chunking_policy = context_chunking_policy
        self._dynamic_batch_config = dynamic_batch_config

    @property
    def capacity_scheduler_policy(self) -> CapacitySchedulerPolicy:
        return self._capacity_scheduler_policy

    @property
    def context_chunking_policy(self) -> ContextChunkingPolicy | None:
        return self._context_chunking_policy

    @property
    def dynamic_batch_config(self) -> Any | None:
        return self._dynamic_batch_config


# mirrors executorConfig.cpp (OrchestratorConfig)
class OrchestratorConfig:
    def __init__(
        self,
        is_orchestrator: bool = True,
        worker_executable_path: str = "",
        orch_leader_comm: Any | None = None,
        spawn_processes: bool = True,
    ) -> None:
        self.is_orchestrator = is_orchestrator
        self.worker_executable_path = worker_executable_path
        self.orch_leader_comm = orch_leader_comm
        self.spawn_processes = spawn_processes


# mirrors executorConfig.cpp (ParallelConfig): every argument positional-or-keyword
class ParallelConfig:
    def __init__(
        self,
        communication_type: CommunicationType = CommunicationType.MPI,
        communication_mode: CommunicationMode = CommunicationMode.LEADER,
        device_ids: Sequence[int] | None = None,
        participant_ids: Sequence[int] | None = None,
        orchestrator_config: OrchestratorConfig | None = None,
        num_nodes: int | None = None,
    ) -> None:
        self.communication_type = communication_type
        self.communication_mode = communication_mode
        self.device_ids = None if device_ids is None else list(device_ids)
        self.participant_ids = None if participant_ids is None else list(participant_ids)
        self.orchestrator_config = orchestrator_config
        self.num_nodes = num_nodes


_DEFAULT_SCHEDULER = SchedulerConfig()
_DEFAULT_KV_CACHE = KvCacheConfig()


# mirrors cpp/tensorrt_llm/nanobind/executor/executorConfig.cpp (GuidedDecodingConfig, its
# enum nested in the class; the LLM API's TensorRT backend builds it in llmapi/llm.py as
# GuidedDecodingConfig(backend=GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR, ...))
class GuidedDecodingConfig:
    class GuidedDecodingBackend(enum.Enum):
        XGRAMMAR = 0
        LLGUIDANCE = 1

    def __init__(
        self,
        backend: GuidedDecodingConfig.GuidedDecodingBackend,
        encoded_vocab: Sequence[str] | None = None,
        tokenizer_str: str | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(backend, GuidedDecodingConfig.GuidedDecodingBackend):
            raise TypeError("incompatible function arguments")
        self.backend = backend
        self.encoded_vocab = None if encoded_vocab is None else list(encoded_vocab)
        self.tokenizer_str = tokenizer_str
        self.stop_token_ids = None if stop_token_ids is None else list(stop_token_ids)


# mirrors executorConfig.cpp (ExecutorConfig): every argument positional-or-keyword
class ExecutorConfig:
    def __init__(
        self,
        max_beam_width: int = 1,
        scheduler_config: SchedulerConfig = _DEFAULT_SCHEDULER,
        kv_cache_config: KvCacheConfig = _DEFAULT_KV_CACHE,
        enable_chunked_context: bool = False,
        normalize_log_probs: bool = True,
        iter_stats_max_iterations: int = 1000,
        request_stats_max_iterations: int = 0,
        batching_type: BatchingType = BatchingType.INFLIGHT,
        max_batch_size: int | None = None,
        max_num_tokens: int | None = None,
        parallel_config: ParallelConfig | None = None,
        peft_cache_config: Any | None = None,
        logits_post_processor_config: Any | None = None,
        decoding_config: Any | None = None,
        use_gpu_direct_storage: bool = False,
        gpu_weights_percent: float = 1.0,
        max_queue_size: int | None = None,
        extended_runtime_perf_knob_config: Any | None = None,
        debug_config: Any | None = None,
        recv_poll_period_ms: int = 0,
        max_seq_idle_microseconds: int = 180000000,
        spec_dec_config: Any | None = None,
        guided_decoding_config: Any | None = None,
        additional_model_outputs: Sequence[Any] | None = None,
        cache_transceiver_config: Any | None = None,
        gather_generation_logits: bool = False,
        mm_embedding_offloading: bool = False,
        enable_trt_overlap: bool = False,
        fail_fast_on_attention_window_too_large: bool = False,
    ) -> None:
        self.max_beam_width = max_beam_width
        self.scheduler_config = scheduler_config
        self.kv_cache_config = kv_cache_config
        self.enable_chunked_context = enable_chunked_context
        self.normalize_log_probs = normalize_log_probs
        self.iter_stats_max_iterations = iter_stats_max_iterations
        self.request_stats_max_iterations = request_stats_max_iterations
        self.batching_type = batching_type
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.parallel_config = parallel_config
        self.peft_cache_config = peft_cache_config
        self.decoding_config = decoding_config
        self.gpu_weights_percent = gpu_weights_percent
        self.max_queue_size = max_queue_size
        self.recv_poll_period_ms = recv_poll_period_ms
        self.gather_generation_logits = gather_generation_logits
        self.guided_decoding_config = guided_decoding_config


# mirrors cpp/tensorrt_llm/nanobind/executor/request.cpp + executor/samplingConfig.cpp checks
class SamplingConfig:
    def __init__(
        self,
        beam_width: int = 1,
        *,
        top_k: int | None = None,
        top_p: float | None = None,
        top_p_min: float | None = None,
        top_p_reset_ids: int | None = None,
        top_p_decay: float | None = None,
        seed: int | None = None,
        temperature: float | None = None,
        min_tokens: int | None = None,
        beam_search_diversity_rate: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        length_penalty: float | None = None,
        early_stopping: int | None = None,
        no_repeat_ngram_size: int | None = None,
        num_return_sequences: int | None = None,
        min_p: float | None = None,
        beam_width_array: Sequence[int] | None = None,
    ) -> None:
        _check(beam_width > 0, "beamWidth > 0")
        _check(top_k is None or top_k >= 0, "topK.value() >= 0")
        _check(top_p is None or 0.0 < top_p <= 1.0, "topP.value() > 0.f && topP.value() <= 1.f")
        _check(temperature is None or temperature >= 0.0, "temperature.value() >= 0.f")
        _check(min_tokens is None or min_tokens >= 0, "minTokens.value() >= 0")
        _check(repetition_penalty is None or repetition_penalty > 0.0, "repetitionpenalty > 0.f")
        _check(min_p is None or 0.0 <= min_p <= 1.0, "minP in [0, 1]")
        self.beam_width = beam_width
        self.top_k = top_k
        self.top_p = top_p
        self.top_p_min = top_p_min
        self.top_p_reset_ids = top_p_reset_ids
        self.top_p_decay = top_p_decay
        self.seed = seed
        self.temperature = temperature
        self.min_tokens = min_tokens
        self.beam_search_diversity_rate = beam_search_diversity_rate
        self.repetition_penalty = repetition_penalty
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.no_repeat_ngram_size = no_repeat_ngram_size
        self.num_return_sequences = num_return_sequences
        self.min_p = min_p
        self.beam_width_array = None if beam_width_array is None else list(beam_width_array)


# mirrors request.cpp (OutputConfig): arguments default to None, meaning False in C++
class OutputConfig:
    def __init__(
        self,
        return_log_probs: bool | None = None,
        return_context_logits: bool | None = None,
        return_generation_logits: bool | None = None,
        exclude_input_from_output: bool | None = None,
        return_encoder_output: bool | None = None,
        return_perf_metrics: bool | None = None,
        additional_model_outputs: Sequence[Any] | None = None,
    ) -> None:
        self.return_log_probs = bool(return_log_probs)
        self.return_context_logits = bool(return_context_logits)
        self.return_generation_logits = bool(return_generation_logits)
        self.exclude_input_from_output = bool(exclude_input_from_output)
        self.return_encoder_output = bool(return_encoder_output)
        self.return_perf_metrics = bool(return_perf_metrics)
        self.additional_model_outputs = additional_model_outputs


_DEFAULT_SAMPLING = SamplingConfig()
_DEFAULT_OUTPUT = OutputConfig()


# mirrors request.cpp (Request): everything after max_tokens is keyword-only
class Request:
    BATCHED_POST_PROCESSOR_NAME: str = "batched"

    def __init__(
        self,
        input_token_ids: Sequence[int],
        max_tokens: int,
        *,
        streaming: bool = False,
        sampling_config: SamplingConfig = _DEFAULT_SAMPLING,
        output_config: OutputConfig = _DEFAULT_OUTPUT,
        end_id: int | None = None,
        pad_id: int | None = None,
        position_ids: Sequence[int] | None = None,
        bad_words: Sequence[Sequence[int]] | None = None,
        stop_words: Sequence[Sequence[int]] | None = None,
        embedding_bias: Any | None = None,
        external_draft_tokens_config: Any | None = None,
        prompt_tuning_config: Any | None = None,
        multimodal_input: Any | None = None,
        multimodal_embedding: Any | None = None,
        mrope_config: Any | None = None,
        lora_config: Any | None = None,
        lookahead_config: Any | None = None,
        kv_cache_retention_config: Any | None = None,
        logits_post_processor_name: str | None = None,
        logits_post_processor: Any | None = None,
        encoder_input_token_ids: Sequence[int] | None = None,
        client_id: int | None = None,
        return_all_generated_tokens: bool = False,
        priority: float = 0.5,
        type: RequestType = RequestType.REQUEST_TYPE_CONTEXT_AND_GENERATION,
        context_phase_params: Any | None = None,
        encoder_input_features: Any | None = None,
        encoder_output_length: int | None = None,
        cross_attention_mask: Any | None = None,
        num_return_sequences: int = 1,
        eagle_config: Any | None = None,
        skip_cross_attn_blocks: Any | None = None,
        guided_decoding_params: Any | None = None,
        language_adapter_uid: int | None = None,
        allotted_time_ms: timedelta | float | None = None,
        cache_salt_id: int | None = None,
    ) -> None:
        self._input_token_ids = list(input_token_ids)
        self._max_tokens = max_tokens
        self.streaming = streaming
        self.sampling_config = sampling_config
        self.output_config = output_config
        self.end_id = end_id
        self.pad_id = pad_id
        self.bad_words = None if bad_words is None else [list(w) for w in bad_words]
        self.stop_words = None if stop_words is None else [list(w) for w in stop_words]
        self.client_id = client_id
        self.return_all_generated_tokens = return_all_generated_tokens
        self.priority = priority
        self.request_type = type
        self.guided_decoding_params = guided_decoding_params
        self.kv_cache_retention_config = kv_cache_retention_config
        seconds = _seconds(allotted_time_ms)
        self.allotted_time_ms = None if seconds is None else timedelta(seconds=seconds)
        # request.cpp @ ac456dcad7e63b0ee6387ebb2ee2ef330d142ebe: `cache_salt_id` is
        # std::optional<CacheSaltIDType> (uint64), and nanobind refuses an int it cannot
        # convert with TypeError. priority (PriorityType, a float) defaults to
        # Request::kDefaultPriority, 0.5; the double does not reorder its queue by it
        # (the real one does: insertRequestInOrder, requestUtils.cpp).
        if cache_salt_id is not None and not (
            isinstance(cache_salt_id, int) and 0 <= cache_salt_id < 1 << 64
        ):
            raise TypeError("__init__(): incompatible function arguments (cache_salt_id)")
        self.cache_salt_id = cache_salt_id

    @property
    def input_token_ids(self) -> list[int]:
        return self._input_token_ids

    @property
    def max_tokens(self) -> int:
        return self._max_tokens


# mirrors request.cpp (Result): plain read-write fields
class Result:
    def __init__(self) -> None:
        self.is_final = False
        self.output_token_ids: list[list[int]] = []
        self.cum_log_probs: list[float] | None = None
        self.log_probs: list[list[float]] | None = None
        self.context_logits: Any | None = None
        self.generation_logits: Any | None = None
        self.encoder_output: Any | None = None
        self.finish_reasons: list[FinishReason] = []
        self.sequence_index = 0
        self.is_sequence_final = False
        self.decoding_iter = 0
        self.avg_decoded_tokens_per_iter = 0.0
        self.context_phase_params: Any | None = None
        self.request_perf_metrics: Any | None = None
        self.additional_outputs: list[Any] = []


# mirrors cpp/tensorrt_llm/nanobind/executor/request.cpp (GuidedDecodingParams(guide_type,
# guide=None), GuideType nested in it); TensorRT-LLM's own callers write
# GuidedDecodingParams(GuidedDecodingParams.GuideType.JSON_SCHEMA, schema_json)
class GuidedDecodingParams:
    class GuideType(enum.Enum):
        JSON = 0
        JSON_SCHEMA = 1
        REGEX = 2
        EBNF_GRAMMAR = 3
        STRUCTURAL_TAG = 4

    def __init__(
        self, guide_type: GuidedDecodingParams.GuideType, guide: str | None = None
    ) -> None:
        if not isinstance(guide_type, GuidedDecodingParams.GuideType):
            raise TypeError("incompatible function arguments")
        self.guide_type = guide_type
        self.guide = guide


# mirrors request.cpp (Response) + cpp/tensorrt_llm/executor/responseImpl.h
class Response:
    @overload
    def __init__(self, request_id: int, error_msg: str, client_id: int | None = None) -> None: ...
    @overload
    def __init__(self, request_id: int, result: Result, client_id: int | None = None) -> None: ...
    def __init__(self, request_id: int, *args: Any, **kwargs: Any) -> None:
        payload = args[0] if args else kwargs.pop("error_msg", kwargs.pop("result", None))
        if not isinstance(payload, str | Result):
            raise TypeError("incompatible function arguments")
        self._request_id = request_id
        self._payload: str | Result = payload
        self._client_id: int | None = args[1] if len(args) > 1 else kwargs.get("client_id")

    @property
    def request_id(self) -> int:
        return self._request_id

    @property
    def client_id(self) -> int | None:
        return self._client_id

    def has_error(self) -> bool:
        return isinstance(self._payload, str)

    @property
    def error_msg(self) -> str:
        if isinstance(self._payload, str):
            return self._payload
        raise RuntimeError("Cannot get the error message for a response without error")

    @property
    def result(self) -> Result:
        if isinstance(self._payload, Result):
            return self._payload
        raise RuntimeError(f"Cannot get the result for a response with an error: {self._payload}")


# mirrors cpp/tensorrt_llm/nanobind/executor/bindings.cpp (stats) and
# cpp/tensorrt_llm/executor/jsonSerialization.cpp (to_json_str keys)
@dataclass
class KvCacheStats:
    max_num_blocks: int = 0
    free_num_blocks: int = 0
    used_num_blocks: int = 0
    tokens_per_block: int = 0
    alloc_total_blocks: int = 0
    alloc_new_blocks: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0
    cache_hit_rate: float = 0.0


@dataclass
class InflightBatchingStats:
    num_scheduled_requests: int = 0
    num_context_requests: int = 0
    num_gen_requests: int = 0
    num_paused_requests: int = 0
    num_ctx_tokens: int = 0
    micro_batch_id: int = 0
    avg_num_decoded_tokens_per_iter: float = 0.0


@dataclass
class IterationStats:
    timestamp: str = ""
    iter: int = 0
    iter_latency_ms: float = 0.0
    new_active_requests_queue_latency_ms: float = 0.0
    num_new_active_requests: int = 0
    num_active_requests: int = 0
    num_queued_requests: int = 0
    num_completed_requests: int = 0
    max_num_active_requests: int = 0
    gpu_mem_usage: int = 0
    cpu_mem_usage: int = 0
    pinned_mem_usage: int = 0
    kv_cache_stats: KvCacheStats | None = None
    cross_kv_cache_stats: KvCacheStats | None = None
    static_batching_stats: Any | None = None
    inflight_batching_stats: InflightBatchingStats | None = None
    specdec_stats: Any | None = None

    def to_json_str(self) -> str:
        def camel(obj: Any) -> Any:
            if not hasattr(obj, "__dataclass_fields__"):
                return obj
            out = {}
            for key, value in vars(obj).items():
                head, *rest = key.replace("_ms", "_MS").split("_")
                out[head + "".join(p[:1].upper() + p[1:] for p in rest)] = camel(value)
            return out

        return json.dumps(camel(self))

    @classmethod
    def _from(cls, s: IterStats) -> IterationStats:
        kv = KvCacheStats(
            max_num_blocks=s.max_num_blocks,
            free_num_blocks=s.max_num_blocks - s.used_num_blocks,
            used_num_blocks=s.used_num_blocks,
            tokens_per_block=s.tokens_per_block,
        )
        ifb = InflightBatchingStats(
            num_scheduled_requests=s.num_active_requests,
            num_context_requests=s.num_context_requests,
            num_gen_requests=s.num_active_requests - s.num_context_requests,
            num_ctx_tokens=s.num_ctx_tokens,
            avg_num_decoded_tokens_per_iter=1.0,
        )
        return cls(
            timestamp=s.timestamp,
            iter=s.iter,
            iter_latency_ms=s.iter_latency_ms,
            num_new_active_requests=s.num_new_active_requests,
            num_active_requests=s.num_active_requests,
            num_queued_requests=s.num_queued_requests,
            num_completed_requests=s.num_completed_requests,
            max_num_active_requests=s.max_num_active_requests,
            gpu_mem_usage=1 << 30,
            kv_cache_stats=kv,
            inflight_batching_stats=ifb,
        )


@dataclass(eq=False)
class _Tracked:
    request: Request
    job: Job
    generated: list[int] = field(default_factory=list)  # without the end id


# mirrors cpp/tensorrt_llm/nanobind/executor/executor.{h,cpp} over executorImpl.cpp
class Executor:
    @overload
    def __init__(
        self,
        model_path: str | os.PathLike[str],
        model_type: ModelType,
        executor_config: ExecutorConfig,
    ) -> None: ...
    @overload
    def __init__(
        self,
        encoder_model_path: str | os.PathLike[str],
        decoder_model_path: str | os.PathLike[str],
        model_type: ModelType,
        executor_config: ExecutorConfig,
    ) -> None: ...
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("executor_config", args[-1] if args else None)
        if not isinstance(config, ExecutorConfig):
            raise TypeError("incompatible function arguments")
        self._gpu = fake_gpu.current()
        self._gpu.executor_configs.append(config)
        self._config = config
        batch = config.max_batch_size or self._gpu.engine_max_batch_size
        # executorImpl.cpp @ b35ac1b6: cancelRequest only records the id and
        # terminateCancelledRequests looks at active requests, so a queued request runs
        # its first step once admitted and is then ended CANCELLED
        self._engine = self._gpu.new_engine(batch, self._on_stats, queued_cancel="after_admission")
        self._gpu.on_kill(self._wake)
        self._cv = threading.Condition()
        self._responses: dict[int, list[Response]] = {}
        self._tracked: dict[int, _Tracked] = {}
        self._terminated: set[int] = set()
        self._stats: list[IterationStats] = []
        self._next_id = 1
        self._shutdown = False

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, type: object | None, value: object | None, traceback: object | None) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        with self._cv:
            self._shutdown = True
            self._engine.close()
            self._cv.notify_all()

    def can_enqueue_requests(self) -> bool:
        return not self._shutdown

    def enqueue_request(self, request: Request) -> int:
        return self.enqueue_requests([request])[0]

    def enqueue_requests(self, requests: Sequence[Request]) -> list[int]:
        _check(not self._shutdown, "Shutdown called, cannot enqueue requests")
        self._check_alive()
        ids = []
        for request in requests:
            self._gpu.requests.append(request)
            with self._cv:
                rid, self._next_id = self._next_id, self._next_id + 1
            if request.guided_decoding_params is not None and (
                self._config.guided_decoding_config is None
            ):
                # executorImpl.cpp (fetchNewRequests, 1.2.0rc2 b35ac1b6): the check fails
                # and is caught into an error response for that request
                self._fail(
                    rid,
                    request,
                    "Encountered an error when fetching new request: Request is specified "
                    "with GuidedDecodingParams, but GuidedDecoder is not setup. Please "
                    "provide a valid GuidedDecodingConfig to setup GuidedDecoder.",
                )
                ids.append(rid)
                continue
            allotted = request.allotted_time_ms
            min_tokens = request.sampling_config.min_tokens
            job = Job(
                prompt=list(request.input_token_ids),
                max_tokens=request.max_tokens,
                emit=functools.partial(self._on_step, rid),
                end_id=request.end_id,
                min_tokens=1 if min_tokens is None else min_tokens,
                stop_words=request.stop_words or [],
                deadline=None if allotted is None else time.monotonic() + allotted.total_seconds(),
            )
            self._tracked[rid] = _Tracked(request, job)
            self._engine.submit(job)
            ids.append(rid)
        return ids

    def cancel_request(self, id: int | None = None) -> None:
        if id is None:
            raise TypeError("cancel_request(): incompatible function arguments (id must be an int)")
        _check(not self._shutdown, "Shutdown called")
        if id not in self._terminated and id in self._tracked:
            self._engine.cancel(self._tracked[id].job)

    @overload
    def await_responses(self, timeout: timedelta | float | None = None) -> list[Response]: ...
    @overload
    def await_responses(
        self, id: int, timeout: timedelta | float | None = None
    ) -> list[Response]: ...
    @overload
    def await_responses(
        self, ids: Sequence[int], timeout: timedelta | float | None = None
    ) -> list[list[Response]]: ...
    def await_responses(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs.pop("ids", kwargs.pop("id", None))
        timeout = args[1] if len(args) > 1 else kwargs.get("timeout")
        if isinstance(first, list | tuple):
            deadline = self._deadline(timeout)
            return [self._await_id(i, deadline) for i in first]
        if isinstance(first, int) and not isinstance(first, bool):
            return self._await_id(first, self._deadline(timeout))
        return self._await_any(self._deadline(first if args else timeout))

    def get_num_responses_ready(self, id: int | None = None) -> int:
        _check(not self._shutdown, "Shutdown called")
        with self._cv:
            if id is not None:
                return len(self._responses.get(id, []))
            return sum(len(r) for r in self._responses.values())

    def get_latest_iteration_stats(self) -> list[IterationStats]:
        _check(not self._shutdown, "Shutdown called")
        with self._cv:
            stats, self._stats = self._stats, []
        return stats

    def get_latest_request_stats(self) -> list[Any]:
        _check(not self._shutdown, "Shutdown called")
        return []

    # -- internals ---------------------------------------------------------------------------

    def _check_alive(self) -> None:
        # Simulation of FakeGpu.kill(): the real binding surfaces no engine death here.
        if self._gpu.dead:
            raise RuntimeError(self._gpu.death_message)

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _deadline(self, timeout: Any) -> float | None:
        seconds = _seconds(timeout)
        return None if seconds is None else time.monotonic() + seconds

    def _wait(self, ready: Any, deadline: float | None) -> bool:
        """Wait under the lock until ready() or the deadline; False on timeout."""
        while not ready():
            self._check_alive()
            if self._shutdown:
                return False
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._cv.wait(remaining)
        return True

    def _take(self, rid: int) -> list[Response]:
        responses = self._responses.pop(rid, [])
        if any(r.has_error() or r.result.is_final for r in responses):
            self._terminated.add(rid)
        return responses

    def _await_any(self, deadline: float | None) -> list[Response]:
        _check(not self._shutdown, "Shutdown called")
        with self._cv:
            if not self._wait(lambda: bool(self._responses), deadline):
                return []
            return [r for rid in list(self._responses) for r in self._take(rid)]

    def _await_id(self, rid: int, deadline: float | None) -> list[Response]:
        _check(not self._shutdown, "Shutdown called")
        with self._cv:
            if rid in self._terminated:
                msg = f"ReqId {rid} has already been processed and was terminated."
                return [Response(rid, msg)]
            if not self._wait(lambda: bool(self._responses.get(rid)), deadline):
                return []
            return self._take(rid)

    def _on_stats(self, stats: IterStats) -> None:
        if self._config.iter_stats_max_iterations > 0:
            with self._cv:
                self._stats.append(IterationStats._from(stats))
                del self._stats[: -self._config.iter_stats_max_iterations]

    def _fail(self, rid: int, request: Request, message: str) -> None:
        with self._cv:
            self._responses.setdefault(rid, []).append(Response(rid, message, request.client_id))
            self._cv.notify_all()

    def _on_step(self, rid: int, step: Step) -> None:
        tracked = self._tracked[rid]
        request = tracked.request
        if step.error is not None:
            response = Response(rid, step.error, request.client_id)
        else:
            new = step.tokens[:-1] if step.finish == "end_id" else step.tokens  # END_ID excluded
            tracked.generated += new
            if not request.streaming and step.finish is None:
                return  # non-streaming: only the final response is sent
            if request.streaming and step.finish is None and not new:
                return
            response = Response(rid, self._result(tracked, new, step), request.client_id)
        with self._cv:
            self._responses.setdefault(rid, []).append(response)
            self._cv.notify_all()

    def _result(self, tracked: _Tracked, new: list[int], step: Step) -> Result:
        request = tracked.request
        result = Result()
        result.is_final = result.is_sequence_final = step.finish is not None
        if request.streaming:
            tokens = tracked.generated if request.return_all_generated_tokens else new
        elif request.output_config.exclude_input_from_output:
            tokens = tracked.generated
        else:
            tokens = request.input_token_ids + tracked.generated
        result.output_token_ids = [list(tokens)]
        if request.output_config.return_log_probs:  # cumulative, even when streaming
            result.log_probs = [[self._gpu.logprob] * len(tracked.generated)]
            result.cum_log_probs = [self._gpu.logprob * len(tracked.generated)]
        finish = FinishReason.NOT_FINISHED if step.finish is None else _FINISH[step.finish]
        result.finish_reasons = [finish]
        result.decoding_iter = tracked.job.steps
        return result


if fake_gpu.line() >= (1, 4):
    # PR #16369 (merged 2026-07-19; absent from 1.3.0rc22 on) removed the C++ Executor and
    # its Python binding; the module keeps ExecutorConfig and the request and config types
    # the PyTorch path uses (llm_args.py @ 1f064c46 still imports ExecutorConfig,
    # KvCacheConfig, SchedulerConfig, ... from it). The binding source itself was not read
    # here: the double removes `Executor` and keeps the rest as it is.
    del Executor
