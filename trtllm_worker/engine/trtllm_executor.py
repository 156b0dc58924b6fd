"""TensorRT-LLM's C++ `Executor` (1.2.x) over a prebuilt engine folder, behind the engine
interface. Legacy: TensorRT-LLM 1.3 removes it; use `trtllm` (the LLM API) for new work.

One GPU: LEADER mode in this process. An engine built for several GPUs (world size > 1 in
its config.json): ORCHESTRATOR mode, spawning the `executorWorker` binary per rank, as
TGI's backend does. `await_responses` is always given a timeout (it can block forever
otherwise) and releases the GIL while it waits."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import tensorrt_llm
import tensorrt_llm.bindings.executor as tle

from trtllm_worker.config import Settings
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.engine import versions
from trtllm_worker.engine.base import (
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    stop_ids,
)
from trtllm_worker.tokenizer import TokenizerInfo

log = logging.getLogger(__name__)

FINISH_REASONS = {
    tle.FinishReason.END_ID: FinishReason.EOS_TOKEN,
    tle.FinishReason.STOP_WORDS: FinishReason.EOS_TOKEN,  # an EOS stop id, or a job's (below)
    tle.FinishReason.LENGTH: FinishReason.LENGTH,
    tle.FinishReason.TIMED_OUT: FinishReason.DEADLINE,
    tle.FinishReason.CANCELLED: FinishReason.CANCELLED,
}

SCHEDULER_POLICIES = {
    "guaranteed_no_evict": tle.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
    "max_utilization": tle.CapacitySchedulerPolicy.MAX_UTILIZATION,
}


def engine_config(engine_dir: Path) -> dict[str, Any]:
    """The engine folder's `config.json`, as `trtllm-build` wrote it."""
    config_file = engine_dir / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"invalid setting WORKER_ENGINE_DIR: cannot read {config_file}: {exc}"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"invalid setting WORKER_ENGINE_DIR: {config_file} is not an object")
    return config


def engine_world_size(engine_dir: Path) -> int:
    """Ranks the engine was built for, from its `config.json` (`pretrained_config.mapping`)."""
    config = engine_config(engine_dir)
    mapping = (config.get("pretrained_config") or {}).get("mapping") or {}
    if "world_size" in mapping:
        return int(mapping["world_size"])
    return int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1))


def executor_config(settings: Settings, world_size: int) -> tle.ExecutorConfig:
    kv_cache = tle.KvCacheConfig(
        enable_block_reuse=settings.kv_cache_block_reuse,
        free_gpu_memory_fraction=settings.kv_cache_free_gpu_memory_fraction,
    )
    scheduler = tle.SchedulerConfig(SCHEDULER_POLICIES[settings.scheduler_policy])
    config = tle.ExecutorConfig(
        max_beam_width=1,
        scheduler_config=scheduler,
        kv_cache_config=kv_cache,
        max_batch_size=settings.max_batch,
        max_num_tokens=settings.max_num_tokens,
    )
    if world_size > 1:
        worker_path = settings.executor_worker_path or (
            Path(tensorrt_llm.__file__).parent / "bin" / "executorWorker"
        )
        config.parallel_config = tle.ParallelConfig(
            tle.CommunicationType.MPI,
            tle.CommunicationMode.ORCHESTRATOR,
            orchestrator_config=tle.OrchestratorConfig(True, str(worker_path)),
        )
    return config


def guided_decoding_params(request: EngineRequest) -> tle.GuidedDecodingParams | None:
    if request.guide is None:
        return None
    kinds = tle.GuidedDecodingParams.GuideType
    kind = kinds.JSON_SCHEMA if request.guide.kind == "json" else kinds.REGEX
    return tle.GuidedDecodingParams(kind, request.guide.text)


def guided_decoding_config(
    settings: Settings, tokenizer: TokenizerInfo
) -> tle.GuidedDecodingConfig | None:
    """The engine's grammar backend, with the vocabulary it compiles grammars for, as
    the LLM API's TensorRT backend builds it (`_xgrammar_tokenizer_info`): the tokens in
    id order, the `tokenizer.json` text and the EOS ids. The C++ Executor has xgrammar
    only (llguidance is the PyTorch backend's)."""
    if settings.guided_decoding == "none":
        return None
    if settings.guided_decoding != "xgrammar":
        raise ConfigError(
            f"invalid setting WORKER_GUIDED_DECODING: {settings.guided_decoding!r} is not "
            "available with WORKER_ENGINE=trtllm-executor (xgrammar or none)"
        )
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    return tle.GuidedDecodingConfig(
        tle.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR,
        encoded_vocab=[token for token, _ in sorted(vocab.items(), key=lambda item: item[1])],
        tokenizer_str=tokenizer.tokenizer.to_str(),
        stop_token_ids=sorted(tokenizer.eos_ids) or None,
    )


NO_TOP_LOGPROBS = (
    "the C++ Executor returns only the sampled token's log probability "
    "(OutputConfig.returnLogProbs, cpp/include/tensorrt_llm/executor/executor.h); "
    "use WORKER_ENGINE=trtllm with WORKER_SAMPLER=TorchSampler for them"
)
"""Why the Executor refuses `top_logprobs`: its `OutputConfig` has one switch for log
probabilities, and `Result.logProbs` holds one value per generated token."""


def built_limits(settings: Settings, build: dict[str, Any]) -> tuple[int, EngineLimits]:
    """The engine's capacity and limits as `trtllm-build` fixed them (`build_config` of
    its `config.json`). WORKER_MAX_BATCH above the built batch size is refused: the
    Executor would queue the rest where the worker cannot see them."""
    built_batch = build.get("max_batch_size")
    capacity = settings.max_batch
    if isinstance(built_batch, int) and built_batch < settings.max_batch:
        raise ConfigError(
            f"invalid setting WORKER_MAX_BATCH: {settings.max_batch} is above the engine's "
            f"max_batch_size {built_batch} (WORKER_ENGINE_DIR config.json build_config); "
            f"set WORKER_MAX_BATCH={built_batch}"
        )
    # without chunked context (the worker does not enable it) a prompt must fit both
    prompt_limits = [
        v
        for v in (
            build.get("max_input_len"),
            settings.max_num_tokens or build.get("max_num_tokens"),
        )
        if isinstance(v, int)
    ]
    max_seq_len = build.get("max_seq_len")
    return capacity, EngineLimits(
        max_seq_len=max_seq_len if isinstance(max_seq_len, int) else None,
        max_num_tokens=min(prompt_limits) if prompt_limits else None,
        max_top_logprobs=0,
        top_logprobs_why=NO_TOP_LOGPROBS,
    )


def require_executor() -> None:
    """TensorRT-LLM PR #16369 removed the C++ Executor and its Python binding (absent from
    1.3.0rc22 on, and from the 1.4 line): say so in one line, with what to use instead."""
    if not hasattr(tle, "Executor"):
        raise ConfigError(
            f"invalid setting WORKER_ENGINE=trtllm-executor: TensorRT-LLM "
            f"{tensorrt_llm.__version__} has no C++ Executor (removed from 1.3.0rc22 on); "
            "use WORKER_ENGINE=trtllm with a Hugging Face checkpoint (WORKER_MODEL), or "
            "TensorRT-LLM 1.2 or earlier for a prebuilt engine"
        )


def create(settings: Settings, tokenizer: TokenizerInfo) -> ExecutorEngine:
    assert settings.engine_dir is not None  # the settings validator requires it
    versions.check(tensorrt_llm.__version__)
    require_executor()
    world_size = engine_world_size(settings.engine_dir)
    build = engine_config(settings.engine_dir).get("build_config") or {}
    capacity, limits = built_limits(settings, build)
    log.info(
        "TensorRT-LLM %s: loading the engine in %s (%d rank%s, %s mode)",
        tensorrt_llm.__version__,
        settings.engine_dir,
        world_size,
        "s" * (world_size > 1),
        "orchestrator" if world_size > 1 else "leader",
    )
    log.info(
        "job priorities reach the Executor as Request.priority = p/9 (its queue serves higher "
        "first); tenants as cache_salt_id (no KV-cache blocks shared between tenants)"
    )
    config = executor_config(settings, world_size)
    config.guided_decoding_config = guided_decoding_config(settings, tokenizer)
    executor = tle.Executor(settings.engine_dir, tle.ModelType.DECODER_ONLY, config)
    return ExecutorEngine(
        executor,
        capacity=capacity,
        limits=limits,
        cancel_timeout_s=settings.engine_cancel_timeout_s,
    )


def cache_salt_id(salt: str) -> int:
    """The tenant as the Executor's `cache_salt_id` (an unsigned 64-bit id; KV-cache
    blocks are reused only between requests with the same id, `BlockKey` in
    `kvCacheManager.cpp`). Derived as the LLM API derives it from `cache_salt` (8 bytes
    of a hash of the UTF-8 text, little-endian); TensorRT-LLM hashes with blake3, this
    with the standard library's blake2b: the ids differ, the isolation is the same."""
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def request_options(request: EngineRequest) -> dict[str, Any]:
    """`Request` keywords left out when the job does not set them, so the Executor's
    defaults apply: `priority` (0.5; its queue serves higher first, `insertRequestInOrder`
    in `requestUtils.cpp`) and `cache_salt_id` (none)."""
    options: dict[str, Any] = {}
    if request.priority is not None:
        options["priority"] = request.priority
    if request.cache_salt is not None:
        options["cache_salt_id"] = cache_salt_id(request.cache_salt)
    return options


def make_request(request: EngineRequest) -> tle.Request:
    """The job's parameters in the Executor's names (`tensorrt-llm.md` §5)."""
    sampling = request.sampling
    greedy = sampling.do_sample is False
    stops = stop_ids(request)
    allotted = None
    if request.deadline is not None:
        allotted = timedelta(seconds=max(request.deadline - time.time(), 0.001))
    return tle.Request(
        request.prompt_ids,
        request.max_new_tokens,
        streaming=True,
        sampling_config=tle.SamplingConfig(
            1,
            top_k=1 if greedy else sampling.top_k,
            top_p=None if greedy else sampling.top_p,
            temperature=None if greedy else sampling.temperature,
            # Unset, every request would sample with seed 0: draw one, as TGI does.
            seed=sampling.seed if sampling.seed is not None else random.getrandbits(63),
            min_tokens=request.min_new_tokens or None,
            repetition_penalty=sampling.repetition_penalty,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
        ),
        output_config=tle.OutputConfig(return_log_probs=request.return_logprobs),
        end_id=-1 if request.ignore_eos else request.end_id,
        pad_id=max(request.end_id, 0),
        stop_words=[[i] for i in stops] or None,
        guided_decoding_params=guided_decoding_params(request),
        client_id=request.id,
        allotted_time_ms=allotted,
        **request_options(request),
    )


class ExecutorEngine:
    """The engine interface over `tensorrt_llm.bindings.executor.Executor`."""

    def __init__(
        self,
        executor: tle.Executor,
        *,
        capacity: int,
        limits: EngineLimits | None = None,
        cancel_timeout_s: float = 5.0,
    ) -> None:
        self._executor = executor
        self._capacity = capacity
        self._limits = limits or EngineLimits(top_logprobs_why=NO_TOP_LOGPROBS)
        self._cancel_timeout_s = cancel_timeout_s
        self._by_executor_id: dict[int, EngineRequest] = {}
        self._executor_ids: dict[int, int] = {}
        self._rejected: list[EngineOutput] = []
        self._aborted: dict[int, float] = {}  # engine id → when to stop waiting for it

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    def enqueue(self, request: EngineRequest) -> None:
        try:
            executor_id = self._executor.enqueue_request(make_request(request))
        except (RuntimeError, ValueError, TypeError) as exc:
            self._rejected.append(
                EngineOutput(request.id, [], error=f"rejected by the engine: {exc}")
            )
            return
        self._by_executor_id[executor_id] = request
        self._executor_ids[request.id] = executor_id

    def cancel(self, request_id: int) -> None:
        """Cancel, and end the request here if the engine stays silent for
        WORKER_ENGINE_CANCEL_TIMEOUT_S, whatever state it had it in."""
        executor_id = self._executor_ids.get(request_id)
        if executor_id is not None:
            self._executor.cancel_request(executor_id)
            self._aborted.setdefault(request_id, time.monotonic() + self._cancel_timeout_s)

    def wake(self) -> None:
        """`await_responses` cannot be interrupted; the looper's short timeout bounds it."""

    def wait(self, timeout: float) -> list[EngineOutput]:
        outputs, self._rejected = self._rejected, []
        wait_for = timedelta(0) if outputs else timedelta(seconds=timeout)
        for response in self._executor.await_responses(timeout=wait_for):
            output = self._convert(response)
            if output is not None:
                outputs.append(output)
        return outputs + self._overdue_aborts()

    def _overdue_aborts(self) -> list[EngineOutput]:
        if not self._aborted:
            return []
        now = time.monotonic()
        overdue = [i for i, due in self._aborted.items() if due <= now]
        ended = []
        for request_id in overdue:
            executor_id = self._executor_ids.get(request_id)
            del self._aborted[request_id]
            if executor_id is None:
                continue  # it ended meanwhile
            log.warning(
                "engine request %d: no final response after its cancel; ended here", request_id
            )
            self._forget(executor_id, self._by_executor_id[executor_id])
            ended.append(EngineOutput(request_id, [], finish=FinishReason.CANCELLED))
        return ended

    def _convert(self, response: Any) -> EngineOutput | None:
        request = self._by_executor_id.get(response.request_id)
        if request is None:
            return None
        if response.has_error():
            self._forget(response.request_id, request)
            return EngineOutput(request.id, [], error=response.error_msg)
        result = response.result
        tokens = list(result.output_token_ids[0]) if result.output_token_ids else []
        logprobs = None
        if request.return_logprobs and result.log_probs:
            logprobs = list(result.log_probs[0][-len(tokens) :]) if tokens else []
        if request.id in self._aborted:
            # a step after the cancel: the request stopped at the cancel (a queued one
            # even runs its first step once admitted, `executorImpl.cpp`)
            if not result.is_final:
                return None
            self._forget(response.request_id, request)
            return EngineOutput(request.id, [], finish=FinishReason.CANCELLED)
        if not result.is_final:
            return EngineOutput(request.id, tokens, logprobs) if tokens else None
        self._forget(response.request_id, request)
        reason = result.finish_reasons[0] if result.finish_reasons else None
        finish = FINISH_REASONS.get(reason) if reason is not None else None
        if finish is None:
            return EngineOutput(request.id, tokens, logprobs, error=f"finished with {reason}")
        if reason == tle.FinishReason.END_ID and (not tokens or tokens[-1] != request.end_id):
            tokens.append(request.end_id)  # the end id is not in the output (TensorRT-LLM #2190)
        elif (
            reason == tle.FinishReason.STOP_WORDS
            and tokens
            and tokens[-1] in request.stop_token_ids - request.eos_ids
        ):
            finish = FinishReason.STOP_SEQUENCE  # a stop word stays in the output
        return EngineOutput(request.id, tokens, logprobs, finish)

    def _forget(self, executor_id: int, request: EngineRequest) -> None:
        del self._by_executor_id[executor_id]
        self._executor_ids.pop(request.id, None)
        self._aborted.pop(request.id, None)

    def stats(self) -> EngineStats:
        samples = self._executor.get_latest_iteration_stats()
        if not samples:
            return EngineStats()
        latest = samples[-1]
        kv = latest.kv_cache_stats
        return EngineStats(
            active_requests=latest.num_active_requests,
            queued_requests=latest.num_queued_requests,
            step_time_s=latest.iter_latency_ms / 1000,
            kv_cache_used_blocks=kv.used_num_blocks if kv is not None else None,
            kv_cache_max_blocks=kv.max_num_blocks if kv is not None else None,
        )

    def shutdown(self) -> None:
        self._executor.shutdown()
