"""TensorRT-LLM's LLM API (PyTorch backend, HF checkpoint) behind the engine interface.

Only this module and `trtllm_executor.py` import `tensorrt_llm`, and only when the engine
is chosen. Token ids in and out: the worker tokenizes, detokenizes and matches stop
strings itself (`skip_tokenizer_init=True`, `detokenize=False`).

Threading: `generate_async` binds each result to the event loop running in the calling
thread (tensorrt_llm/executor/result.py), so this engine keeps a private event loop
running on a thread of its own (see `LlmApiEngine`)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import queue
import random
import threading
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import tensorrt_llm
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import (
    GuidedDecodingParams,  # both lines; tensorrt_llm.sampling_params warns on 1.4
    KvCacheConfig,
    LoRARequest,
    RequestError,
    RequestOutput,
)

with warnings.catch_warnings():
    # a compatibility shim on the 1.4 line (PR #17806 moved the PEFT modules under
    # _torch/peft; PR #17857 made the shim warn, a FutureWarning by its thread), the only
    # public path on 1.2: its warning says nothing an operator can act on
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    from tensorrt_llm.lora_helper import LoraConfig

from trtllm_worker.config import Settings
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.job import MAX_TOP_LOGPROBS
from trtllm_worker.engine import versions
from trtllm_worker.engine.base import (
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    TopLogprobs,
    stop_ids,
)
from trtllm_worker.engine.lora import Adapter, Adapters, discover_adapters
from trtllm_worker.tokenizer import TokenizerInfo

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 1.0

FINISH_REASONS = {
    "stop": FinishReason.EOS_TOKEN,  # end_id, an EOS stop id, or (see _finish) a job's stop id
    "length": FinishReason.LENGTH,
    "timeout": FinishReason.DEADLINE,
    "cancelled": FinishReason.CANCELLED,
}


CONFLICTS = {
    "max_batch_size": "max_batch",
    "tensor_parallel_size": "tensor_parallel_size",
    "max_seq_len": "max_seq_len",
    "max_num_tokens": "max_num_tokens",
    "sampler_type": "sampler",
}
"""Extra options that a worker setting also decides: both may not say different things."""


TORCH_SAMPLER_IGNORES = ("seed", "repetition_penalty", "presence_penalty", "frequency_penalty")
"""What 1.2's TorchSampler accepts and ignores: one generator seeded once for every
request, no penalties (`_torch/pyexecutor/sampler.py`)."""

TORCH_SAMPLER_IGNORES_1_4 = ("seed",)
"""The 1.4 line's TorchSampler applies the three penalties per request (PR #16485, merged
2026-07-16: `_torch/pyexecutor/sampler/penalties.py` @ 0a0ceb0c). Per-request seeds
(PR #17172, `sampler/seed_manager.py` @ 2341856e) are "only partially effective": the
pinned FlashInfer reads one seed per sampling call, so a seeded request is reproducible
only when sampled alone. A job's seed is therefore still refused there."""


def ignored_parameters(sampler: str, line: tuple[int, int] = (1, 2)) -> dict[str, str]:
    """The job parameters the configured sampler would silently ignore on this line,
    with why."""
    if sampler == "TRTLLMSampler":
        return {}
    if line >= (1, 4):
        why = (
            f"TensorRT-LLM {tensorrt_llm.__version__}'s TorchSampler honours a per-request "
            "seed only for a request sampled alone (its FlashInfer reads one seed per call)"
        )
        return dict.fromkeys(TORCH_SAMPLER_IGNORES_1_4, why)
    why = (
        f"TensorRT-LLM 1.2's TorchSampler (WORKER_SAMPLER={sampler}) ignores it; "
        "set WORKER_SAMPLER=TRTLLMSampler to use it"
    )
    return dict.fromkeys(TORCH_SAMPLER_IGNORES, why)


def top_logprobs_limit(sampler: str) -> tuple[int, str]:
    """How many top logprobs per token the sampler returns, and the refusal's reason.

    1.2's TorchSampler (also what "auto" picks for beam width 1) returns the top K of the
    log-softmax of the logits, before temperature and top-k/top-p, ranked 1..K
    (`_torch/pyexecutor/sampler.py` @ 28edbcdb, `_process_requests` and
    `handle_logprobs`); TRTLLMSampler returns one entry per token, the sampled token's
    own log probability at rank 1, whatever K was asked (`update_requests_single_beam_
    single_step` there)."""
    if sampler == "TRTLLMSampler":
        return 0, (
            f"TensorRT-LLM 1.2's TRTLLMSampler (WORKER_SAMPLER={sampler}) returns only the "
            "sampled token's log probability; set WORKER_SAMPLER=TorchSampler for them"
        )
    return MAX_TOP_LOGPROBS, f"at most {MAX_TOP_LOGPROBS}"


SamplerSupport = Literal["selectable", "deprecated", "removed"]


def sampler_support() -> SamplerSupport:
    """How the installed LLM API takes `sampler_type`: a field that picks TRTLLMSampler or
    TorchSampler (1.2); a deprecated one ("will be removed in release 1.4",
    `llmapi/llm_args.py` @ 1f064c46, the 1.3.0rc2x main); or none: PR #18232 (merged
    2026-08-26; the 1.3.0rc26 and 1.4.0rc docs describe it) removed TRTLLMSampler and the
    field, TorchSampler being the only sampler, and PR #18513 made the LLM accept
    `sampler_type` "auto" and "TorchSampler" again, ignored, and reject "TRTLLMSampler"."""
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    field = TorchLlmArgs.model_fields.get("sampler_type")
    if field is None:
        return "removed"
    return "deprecated" if getattr(field, "deprecated", None) else "selectable"


def effective_sampler(args: Any) -> str:
    """The sampler the built LLM uses, as `WORKER_SAMPLER` names them: its
    `sampler_type`, or TorchSampler where the field is gone (the only sampler there)."""
    value = _field(args, "sampler_type")
    value = getattr(value, "value", value)  # a StrEnum in the real config
    return "TorchSampler" if value is None else str(value)


def sampler_options(settings: Settings, support: SamplerSupport) -> dict[str, Any]:
    """The `sampler_type` to build the LLM with, if any. 1.2: `WORKER_SAMPLER` (default
    TRTLLMSampler, which honours per-request seed and penalties there). Deprecated: only
    when the operator set it. Removed: never; an explicit TRTLLMSampler is one line at
    start rather than the LLM's refusal."""
    explicit = "sampler" in settings.model_fields_set
    version = tensorrt_llm.__version__
    if support == "selectable":
        return {"sampler_type": settings.sampler}
    if support == "deprecated":
        if not explicit:
            return {}
        log.warning(
            "TensorRT-LLM %s: sampler_type is deprecated (TorchSampler is the default); "
            "WORKER_SAMPLER=%s is passed on as the operator set it",
            version,
            settings.sampler,
        )
        return {"sampler_type": settings.sampler}
    if explicit and settings.sampler == "TRTLLMSampler":
        raise ConfigError(
            f"invalid setting WORKER_SAMPLER=TRTLLMSampler: TensorRT-LLM {version} has no "
            "TRTLLMSampler (PR #18232 removed it and sampler_type; TorchSampler is the only "
            "sampler); unset WORKER_SAMPLER"
        )
    if explicit:
        log.info(
            "TensorRT-LLM %s has TorchSampler only: WORKER_SAMPLER=%s is not passed",
            version,
            settings.sampler,
        )
    return {}


def _field(args: Any, name: str) -> Any:
    """A field of the built LLM's args, read without the DeprecationWarning pydantic
    gives a deprecated field on attribute access."""
    values = getattr(args, "__dict__", {})
    return values[name] if name in values else getattr(args, name, None)


def check_extra_options(
    settings: Settings, extra: dict[str, Any], support: SamplerSupport = "selectable"
) -> None:
    """An extra option that contradicts a worker setting is refused at start, naming
    both (an engine batch smaller than WORKER_MAX_BATCH would queue the rest unseen).
    Where `sampler_type` is gone, WORKER_SAMPLER decides nothing: the file's value goes
    to the LLM as written, which takes or refuses it."""
    for option, name in CONFLICTS.items():
        if option not in extra or (option == "sampler_type" and support == "removed"):
            continue
        mine = getattr(settings, name)
        if mine is not None and extra[option] != mine:
            raise ConfigError(
                f"invalid setting WORKER_LLM_EXTRA_OPTIONS: it sets {option}: {extra[option]}, "
                f"but WORKER_{name.upper()} is {mine}; set WORKER_{name.upper()} instead"
            )


def lora_config(adapters: Adapters, max_batch: int) -> LoraConfig | None:
    """LoRA sized from the adapters (None: no adapters, LoRA stays off): their largest
    rank, the modules they adapt (TensorRT-LLM's names; empty: every module, which
    TensorRT-LLM fills in itself), as many on the GPU at once as requests in flight can
    use (`max_loras`), and every one of them kept in the CPU cache (`max_cpu_loras`), so
    an adapter evicted from the GPU (LRU) is reloaded from memory, not from disk. No
    `lora_dir`: the adapters are loaded on first use, not all at start
    (tensorrt_llm/lora_helper.py @ 037d4ba1; docs/source/features/lora.md)."""
    if not adapters:
        return None
    return LoraConfig(
        max_lora_rank=adapters.max_rank,
        lora_target_modules=adapters.target_modules or [],
        max_loras=min(len(adapters), max_batch),
        max_cpu_loras=len(adapters),
    )


def check_extra_lora(adapters: Adapters, extra: dict[str, Any]) -> None:
    """A `lora_config` in the extra options is used instead of the worker's (to size the
    caches differently); refused at start when it cannot hold an adapter's rank, which
    would fail that adapter's every job."""
    given = extra.get("lora_config")
    if given is None or not adapters:
        return
    rank = given.get("max_lora_rank", 64) if isinstance(given, dict) else None
    rank = getattr(given, "max_lora_rank", rank)
    if isinstance(rank, int) and rank < adapters.max_rank:
        raise ConfigError(
            "invalid setting WORKER_LLM_EXTRA_OPTIONS: its lora_config has max_lora_rank "
            f"{rank}, below the rank {adapters.max_rank} of an adapter in WORKER_LORA_DIR; "
            "raise it or leave lora_config out (the worker sizes it from the adapters)"
        )


def lora_request(adapter: Adapter) -> LoRARequest:
    """The adapter for `generate_async`: its name, its stable id (TensorRT-LLM caches
    adapters by it) and its folder."""
    return LoRARequest(adapter.name, adapter.id, str(adapter.path))


def create(
    settings: Settings, tokenizer: TokenizerInfo, adapters: Adapters | None = None
) -> LlmApiEngine:
    """Load the model (minutes for a large one) and wrap it."""
    assert settings.model is not None  # the settings validator requires it
    versions.check(tensorrt_llm.__version__)
    if adapters is None:
        adapters = discover_adapters(settings.lora_dir)
    kwargs: dict[str, Any] = {
        "tensor_parallel_size": settings.tensor_parallel_size,
        "max_batch_size": settings.max_batch,
        "max_seq_len": settings.effective_max_seq_len,
        "kv_cache_config": KvCacheConfig(
            free_gpu_memory_fraction=settings.kv_cache_free_gpu_memory_fraction,
            enable_block_reuse=settings.kv_cache_block_reuse,
        ),
        "enable_iter_perf_stats": True,
    }
    if settings.max_num_tokens is not None:
        kwargs["max_num_tokens"] = settings.max_num_tokens
    support = sampler_support()
    kwargs.update(sampler_options(settings, support))
    if settings.guided_decoding != "none":
        # without a backend, 1.2 ignores a request's guided_decoding: output unconstrained
        kwargs["guided_decoding_backend"] = settings.guided_decoding
    lora = lora_config(adapters, settings.max_batch)
    if lora is not None:
        # without a lora_config, TensorRT-LLM ignores a request's lora_request silently
        kwargs["lora_config"] = lora
    extra = read_extra_options(settings.llm_extra_options)
    check_extra_options(settings, extra, support)
    check_extra_lora(adapters, extra)
    kwargs.update(extra)
    if "scheduler_config" not in extra and takes_priority_keyword():
        # a job's priority takes effect only with the priority waiting queue
        # (PriorityWaitingQueue; FCFS ignores it): build the LLM so that it is used
        from tensorrt_llm.llmapi import SchedulerConfig

        kwargs["scheduler_config"] = SchedulerConfig(waiting_queue_policy="priority")
    if lora is not None:
        log.info(
            "LoRA: %d adapters, max rank %d, %d on the GPU at once%s",
            len(adapters),
            adapters.max_rank,
            lora.max_loras,
            " (lora_config from WORKER_LLM_EXTRA_OPTIONS)" if "lora_config" in extra else "",
        )
    log.info("TensorRT-LLM %s: loading %s", tensorrt_llm.__version__, settings.model)
    try:
        llm = LLM(model=str(settings.model), skip_tokenizer_init=True, **kwargs)
    except ValueError as exc:  # pydantic's ValidationError is one
        if not extra:
            raise
        raise ConfigError(
            f"invalid setting WORKER_LLM_EXTRA_OPTIONS: TensorRT-LLM "
            f"{tensorrt_llm.__version__} refuses the LLM arguments: {_one_line(exc)}"
        ) from None
    return LlmApiEngine(llm, cancel_timeout_s=settings.engine_cancel_timeout_s)


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (pydantic's span several)."""
    return " ".join(str(exc).split())


def read_extra_options(path: Path | None) -> dict[str, Any]:
    """Extra `LLM(...)` arguments from a YAML or JSON file, as trtllm-serve's
    `--extra_llm_api_options` takes them; they override the worker's own."""
    if path is None:
        return {}
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml  # a dependency of tensorrt_llm

            data = yaml.safe_load(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"invalid setting WORKER_LLM_EXTRA_OPTIONS: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("invalid setting WORKER_LLM_EXTRA_OPTIONS: the file must hold a mapping")
    return data


def _keywords(generate_async: Any) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(generate_async).parameters)
    except (TypeError, ValueError):  # no signature to read: assume the 1.2 shape
        return frozenset()


def takes_priority(llm: LLM) -> bool:
    """Whether this TensorRT-LLM's `generate_async` has a `priority` keyword (1.3 on,
    TensorRT-LLM PR #12362; 1.2 has none and would raise TypeError). Read from the
    signature rather than the version, as release candidates differ."""
    return "priority" in _keywords(llm.generate_async)


def takes_priority_keyword() -> bool:
    """`takes_priority` before an LLM exists: read from the class."""
    return "priority" in _keywords(LLM.generate_async)


def takes_trace_headers(llm: LLM) -> bool:
    """Whether `generate_async` has `trace_headers` (the 1.4 line, llm.py @ 1f064c46,
    where it sits before `_postproc_params`: the adapter passes keywords only; 1.2.1's
    has none, llm.py @ 4c05a748)."""
    return "trace_headers" in _keywords(llm.generate_async)


def submit_options(
    request: EngineRequest, *, priority: bool, trace_headers: bool = False
) -> dict[str, Any]:
    """The keywords of `generate_async` beyond the prompt and sampling: the tenant as
    `cache_salt` (KV-cache blocks are reused only between requests with the same salt),
    the job's priority where the engine takes one, its LoRA adapter as `lora_request`,
    and the job's W3C trace context as `trace_headers` where it takes them. Unset ones
    are left out, so the engine's defaults apply (no salt; priority 0.5; the base model;
    no trace)."""
    options: dict[str, Any] = {}
    if request.cache_salt is not None:
        options["cache_salt"] = request.cache_salt
    if priority and request.priority is not None:
        options["priority"] = request.priority
    if trace_headers and request.trace_headers:
        options["trace_headers"] = dict(request.trace_headers)
    if request.adapter is not None:
        options["lora_request"] = lora_request(request.adapter)
    return options


def _waiting_queue_policy(args: Any) -> str:
    """The LLM's waiting-queue policy ("fcfs" unless set; 1.2 has no such field)."""
    scheduler = getattr(args, "scheduler_config", None)
    if isinstance(scheduler, dict):
        policy = scheduler.get("waiting_queue_policy")
    else:
        policy = getattr(scheduler, "waiting_queue_policy", None)
    policy = getattr(policy, "value", policy)  # an enum in the real config
    return str(policy).lower() if policy is not None else "fcfs"


def log_priority_support(takes: bool, args: Any) -> None:
    """Say once at start whether job priorities reach the engine, and whether it uses
    them: an operator otherwise cannot tell that the engine queues FCFS."""
    version = tensorrt_llm.__version__
    if not takes:
        log.info(
            "TensorRT-LLM %s: generate_async takes no priority (1.3 on does): job priorities "
            "order jobs in the worker only; tenants reach it as cache_salt",
            version,
        )
        return
    policy = _waiting_queue_policy(args)
    if policy == "priority":
        log.info(
            "TensorRT-LLM %s: job priorities reach it as priority = p/9 (waiting-queue policy "
            "priority); tenants as cache_salt",
            version,
        )
    else:
        log.warning(
            "TensorRT-LLM %s: job priorities reach it as priority = p/9, but its waiting-queue "
            "policy %s ignores them; set scheduler_config: {waiting_queue_policy: priority} in "
            "the WORKER_LLM_EXTRA_OPTIONS file to use them; tenants reach it as cache_salt",
            version,
            policy,
        )


def guided_decoding(request: EngineRequest) -> GuidedDecodingParams | None:
    if request.guide is None:
        return None
    if request.guide.kind == "json":
        return GuidedDecodingParams(json=request.guide.text)
    return GuidedDecodingParams(regex=request.guide.text)


def sampling_params(request: EngineRequest) -> SamplingParams:
    """The job's parameters in the LLM API's names (`tensorrt-llm.md` §5).

    `ignore_eos` is given as `end_id=-1` rather than `ignore_eos=True`: that is all 1.2's
    `ignore_eos` does to the request (`executor/base_worker.py`), while later releases
    also drop every stop word with it, which would lose the job's `stop_token_ids`."""
    sampling = request.sampling
    greedy = sampling.do_sample is False
    stops = stop_ids(request)
    return SamplingParams(
        max_tokens=request.max_new_tokens,
        min_tokens=request.min_new_tokens or None,
        end_id=-1 if request.ignore_eos else request.end_id,
        pad_id=max(request.end_id, 0),
        stop_token_ids=stops or None,
        guided_decoding=guided_decoding(request),
        top_k=1 if greedy else sampling.top_k,
        top_p=None if greedy else sampling.top_p,
        temperature=None if greedy else sampling.temperature,
        # Unset, the engine samples every request with seed 0: draw one, as TGI does.
        seed=sampling.seed if sampling.seed is not None else random.getrandbits(63),
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        # K: TorchSampler's top K per token, which `logprob` is also read from
        logprobs=max(request.top_logprobs, 1) if request.return_logprobs else None,
        detokenize=False,
    )


class LlmApiEngine:
    """The engine interface over `tensorrt_llm.LLM`.

    `generate_async` binds each result to the event loop running in the calling thread,
    and TensorRT-LLM's dispatcher only wakes that loop while it is running (an item that
    arrives otherwise waits unseen). So the adapter keeps a private event loop running
    for good on a thread of its own: requests are submitted, read and aborted there, and
    finished outputs reach the looper through a thread-safe queue."""

    def __init__(self, llm: LLM, *, cancel_timeout_s: float = 5.0) -> None:
        self._llm = llm
        args = llm.args
        # what the built LLM really schedules and accepts, after extra options
        self._capacity = int(args.max_batch_size or 1)
        sampler = effective_sampler(args)
        max_top, top_why = top_logprobs_limit(sampler)
        self._limits = EngineLimits(
            max_seq_len=args.max_seq_len,
            max_num_tokens=None if args.enable_chunked_prefill else args.max_num_tokens,
            ignored_parameters=ignored_parameters(
                sampler, versions.release(tensorrt_llm.__version__)
            ),
            max_top_logprobs=max_top,
            top_logprobs_why=top_why,
        )
        self._takes_priority = takes_priority(llm)
        self._takes_trace_headers = takes_trace_headers(llm)
        log_priority_support(self._takes_priority, args)
        self._cancel_timeout_s = cancel_timeout_s
        self._outputs: queue.SimpleQueue[EngineOutput | None] = queue.SimpleQueue()
        self._results: dict[int, RequestOutput] = {}
        self._readers: dict[int, asyncio.Task[None]] = {}
        self._aborted: set[int] = set()
        """Requests aborted here: their later tokens are dropped (1.2 ends a running
        request only after the iteration that saw the abort, #10879)."""
        self._stats = EngineStats()
        self._fatal: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="trtllm-io", daemon=True)
        self._thread.start()
        self._stats_runner: asyncio.Task[None] | None = None
        self._closing = False
        asyncio.run_coroutine_threadsafe(self._follow_stats(), self._loop)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    # -- the engine interface (called on the looper thread) ---------------------------

    def enqueue(self, request: EngineRequest) -> None:
        self._loop.call_soon_threadsafe(self._submit, request)

    def cancel(self, request_id: int) -> None:
        self._loop.call_soon_threadsafe(self._abort, request_id)

    def wake(self) -> None:
        self._outputs.put(None)

    def wait(self, timeout: float) -> list[EngineOutput]:
        """Block (GIL released) until outputs arrive or `timeout` passes; take them all."""
        outputs: list[EngineOutput] = []
        try:
            item = self._outputs.get(timeout=timeout)
            while True:
                if item is not None:
                    outputs.append(item)
                item = self._outputs.get_nowait()
        except queue.Empty:
            pass
        if self._fatal is not None:
            raise RuntimeError(f"the LLM stopped: {self._fatal}") from self._fatal
        return outputs

    def stats(self) -> EngineStats:
        """The latest iteration statistics (`enable_iter_perf_stats`), kept fresh by a
        task on the private loop: reading them never blocks the engine thread. An idle
        engine runs no iterations and reports none, so idle reads as zero requests."""
        if not self._results:
            return replace(self._stats, active_requests=0, queued_requests=0)
        return self._stats

    def shutdown(self) -> None:
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._loop.is_running():
                self._loop.close()

    # -- on the private loop -----------------------------------------------------------

    def _submit(self, request: EngineRequest) -> None:
        try:
            result = self._llm.generate_async(
                list(request.prompt_ids),
                sampling_params=sampling_params(request),
                streaming=True,
                **submit_options(
                    request,
                    priority=self._takes_priority,
                    trace_headers=self._takes_trace_headers,
                ),
            )
        except (ValueError, TypeError, RequestError) as exc:
            # this request is at fault (e.g. too long: ValueError in 1.2, RequestError,
            # a RuntimeError, on the 1.4 line): it ends alone, the engine goes on
            self._outputs.put(EngineOutput(request.id, [], error=f"rejected by the engine: {exc}"))
            return
        except Exception as exc:
            # The LLM is shutting down or its worker died (a plain RuntimeError on both
            # lines): the engine is gone.
            self._fatal = exc
            self._outputs.put(None)
            return
        self._results[request.id] = result
        reader = self._loop.create_task(self._read(request, result))
        self._readers[request.id] = reader
        reader.add_done_callback(lambda _: self._readers.pop(request.id, None))

    def _abort(self, request_id: int) -> None:
        """Abort, and end the request here if the engine stays silent: 1.2's PyTorch
        executor drops a request it still has queued without any response
        (`_torch/pyexecutor/py_executor.py`); a running one ends `cancelled` after its
        iteration, well within the timeout."""
        result = self._results.get(request_id)
        if result is None:
            return
        result.abort()
        self._aborted.add(request_id)
        self._loop.call_later(self._cancel_timeout_s, self._give_up, request_id)

    def _give_up(self, request_id: int) -> None:
        reader = self._readers.get(request_id)
        if reader is None:
            return  # it ended meanwhile
        log.warning(
            "engine request %d: no final output %.1fs after its abort (it was queued); ended here",
            request_id,
            self._cancel_timeout_s,
        )
        reader.cancel()
        self._results.pop(request_id, None)
        self._outputs.put(EngineOutput(request_id, [], finish=FinishReason.CANCELLED))

    async def _read(self, request: EngineRequest, result: RequestOutput) -> None:
        """Turn one request's stream of RequestOutputs into EngineOutputs."""
        emit = self._outputs.put
        try:
            async for output in result:
                if request.id in self._aborted:  # it stopped at the abort
                    if output.finished:
                        emit(EngineOutput(request.id, [], finish=FinishReason.CANCELLED))
                        return
                    continue
                completion = output.outputs[0]
                tokens = list(completion.token_ids_diff)
                finish = None
                if output.finished:
                    # first: a stop token trimmed from token_ids is put back, and its
                    # log probabilities (never trimmed, result.py) then pair with it
                    finish = _finish(
                        request, completion.finish_reason, completion.stop_reason, tokens
                    )
                logprobs = tops = None
                if request.return_logprobs:
                    logprobs = _logprobs(completion.logprobs_diff, tokens)
                    if request.top_logprobs:
                        tops = _top_logprobs(completion.logprobs_diff, request.top_logprobs)
                if output.finished:
                    emit(
                        EngineOutput(request.id, tokens, logprobs, finish, _no_reason(finish), tops)
                    )
                    return
                if tokens:
                    emit(EngineOutput(request.id, tokens, logprobs, top_logprobs=tops))
            emit(EngineOutput(request.id, [], error="the stream ended without a final output"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # per-request failure: RequestError (a RuntimeError) and kin
            emit(EngineOutput(request.id, [], error=f"{type(exc).__name__}: {exc}"))
        finally:
            self._results.pop(request.id, None)
            self._aborted.discard(request.id)

    async def _follow_stats(self) -> None:
        """Forever: take each iteration's statistics as the engine yields them. The
        iterator ends after `STATS_TIMEOUT_S` without an iteration (an idle engine) and
        is simply started again. Ends by itself once the adapter closes: a cancel can be
        lost in the LLM API's stats queue (see `_cancel`), and while requests run the
        iterator never pauses long enough for a later cancel to land."""
        self._stats_runner = asyncio.current_task()
        while not self._closing:
            try:
                async for sample in self._llm.get_stats_async(timeout=STATS_TIMEOUT_S):
                    if self._closing:
                        return
                    self._stats = _parse_stats(sample)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # statistics are optional: never let them stop serving
                log.debug("engine statistics: %s", exc)
            await asyncio.sleep(STATS_TIMEOUT_S)

    async def _close(self) -> None:
        self._closing = True
        if self._stats_runner is not None:  # cancelled and awaited: none left pending
            await _cancel(self._stats_runner)
        for result in list(self._results.values()):
            result.abort()
        try:
            self._llm.shutdown()
        finally:
            readers = list(self._readers.values())
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)


async def _cancel(task: asyncio.Task[None], attempts: int = 20) -> None:
    """Cancel `task` and wait until it ended, cancelling again while it runs on: Python
    3.11's `asyncio.wait_for` (in the LLM API's stats queue) loses a cancel that meets its
    inner wait finishing (CPython gh-86296), and the task would loop forever. Gives up
    after `attempts` half seconds (the loop is stopped next anyway)."""
    for _ in range(attempts):
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=0.5)
        if done:
            return


def _finish(
    request: EngineRequest, reason: str | None, stop_reason: object, tokens: list[int]
) -> FinishReason | None:
    """Map the finish reason. The end id is in `token_ids`, but a stop token id is
    trimmed from them and given as `stop_reason` (`executor/result.py`): put it back, so
    the stream ends with the token that ended it, as the contract shows it. A job's own
    stop id ends it with `stop_sequence`."""
    finish = FINISH_REASONS.get(reason or "")
    if finish is not FinishReason.EOS_TOKEN:
        return finish
    if isinstance(stop_reason, int):  # a stop id, trimmed from token_ids
        ended_by = stop_reason
        if not tokens or tokens[-1] != ended_by:
            tokens.append(ended_by)
    elif tokens and tokens[-1] in request.eos_ids | request.stop_token_ids:
        ended_by = tokens[-1]  # the end id, kept in token_ids
    else:
        ended_by = request.end_id
        if ended_by >= 0:
            tokens.append(ended_by)
    if ended_by in request.stop_token_ids - request.eos_ids:
        return FinishReason.STOP_SEQUENCE
    return finish


def _no_reason(finish: FinishReason | None) -> str | None:
    return "finished without a known finish reason" if finish is None else None


def _logprobs(diff: Any, tokens: list[int]) -> list[float | None] | None:
    """`logprobs_diff` holds one mapping token id → Logprob (the top k) per new token; the
    sampled token's entry is taken. It can be missing when sampling picked a token outside
    the top k: then None, and that token's entry gets no `logprob` field."""
    if not diff:
        return None
    values: list[float | None] = []
    for token, entry in zip(tokens, diff, strict=False):
        if isinstance(entry, dict):
            chosen = entry.get(token)
            values.append(None if chosen is None else float(chosen.logprob))
        else:
            values.append(float(entry))
    return values


def _top_logprobs(diff: Any, k: int) -> list[TopLogprobs | None] | None:
    """Per new token, its `k` most likely tokens from `logprobs_diff` (one mapping
    token id → Logprob(logprob, rank) per token), ordered by rank (1 first). A mapping
    may hold more than `k` (a release that adds the sampled token at its own rank): the
    `k` best ranks are kept. A stop token trimmed from `token_ids` keeps its mapping
    (result.py trims the ids only, after the log probabilities are taken)."""
    if not diff:
        return None
    tops: list[TopLogprobs | None] = []
    for entry in diff:
        if not isinstance(entry, dict):
            tops.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda item: _rank_key(item[1]))
        tops.append([(int(token), float(lp.logprob)) for token, lp in ranked[:k]])
    return tops


def _rank_key(logprob: Any) -> tuple[float, float]:
    """Sort key: the rank (1 first), then the higher log probability where none is given."""
    rank = getattr(logprob, "rank", None)
    return (float("inf") if rank is None else float(rank), -float(logprob.logprob))


def _parse_stats(sample: Any) -> EngineStats:
    """One `get_stats` sample (a dict, or JSON text of one) → EngineStats."""
    data = json.loads(sample) if isinstance(sample, str) else sample
    if not isinstance(data, dict):
        return EngineStats()
    kv = data.get("kvCacheStats") or {}
    latency_ms = data.get("iterLatencyMS")
    return EngineStats(
        active_requests=data.get("numActiveRequests"),
        queued_requests=data.get("numQueuedRequests"),
        step_time_s=latency_ms / 1000 if isinstance(latency_ms, int | float) else None,
        kv_cache_used_blocks=kv.get("usedNumBlocks"),
        kv_cache_max_blocks=kv.get("maxNumBlocks"),
    )
