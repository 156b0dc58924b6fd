# mirrors tensorrt_llm/llmapi/llm.py (1.2.x): BaseLLM/_TorchLLM/LLM folded into LLM,
# plus the GenerationExecutor(Proxy) behaviour from tensorrt_llm/executor/executor.py.
from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from tests.doubles import fake_gpu
from tests.doubles.fake_gpu import IterStats, Job, Step

from ..bindings.executor import FinishReason, IterationStats
from ..executor.params.sampling import SamplingParams
from ..executor.result import (
    GenerationResult,
    IterationResult,
    Logprob,
    TokenLogprobs,
    _LlmResponse,
    _PyResult,
)
from ..executor.utils import RequestError
from ..llmapi.utils import AsyncQueue
from .llm_args import TorchLlmArgs

__all__ = ["LLM", "RequestOutput"]

DEFAULT_REQUEST_PRIORITY = 0.5  # executor/request.py (1.4 era): "Mirrors C++ executor.h"

_FINISH = {
    "end_id": FinishReason.END_ID,
    "stop_words": FinishReason.STOP_WORDS,
    "length": FinishReason.LENGTH,
    "timed_out": FinishReason.TIMED_OUT,
    "cancelled": FinishReason.CANCELLED,
}


class RequestOutput(GenerationResult):
    """The output of one request: request_id, prompt, prompt_token_ids, outputs, finished."""

    _prompt: str | None

    def __init__(self) -> None:
        raise RuntimeError(
            "RequestOutput is designed to be instantiated using "
            "RequestOutput._from_generation_result by GenerationExecutor. "
            "Users are not expected to create RequestOutput directly."
        )

    @classmethod
    def _create(cls, *args: Any) -> RequestOutput:
        inst = cls.__new__(cls)
        GenerationResult.__init__(inst, *args)
        inst._prompt = None
        return inst

    @property
    def prompt(self) -> str | None:
        return self._prompt


async def _empty_async_iterable() -> AsyncIterator[dict[str, Any]]:
    return
    yield


class LLM:
    """The PyTorch-backend LLM (``class LLM(_TorchLLM)`` in 1.2)."""

    def __init__(
        self,
        model: str | Path,
        tokenizer: Any | None = None,
        tokenizer_mode: Literal["auto", "slow"] = "auto",
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        **kwargs: Any,
    ) -> None:
        self._gpu = fake_gpu.current()
        explicit = {
            "model": str(model),
            "tokenizer": tokenizer,
            "tokenizer_mode": tokenizer_mode,
            "skip_tokenizer_init": skip_tokenizer_init,
            "trust_remote_code": trust_remote_code,
            "tensor_parallel_size": tensor_parallel_size,
            "dtype": dtype,
            "revision": revision,
            "tokenizer_revision": tokenizer_revision,
        }
        self._gpu.llm_kwargs.append({**explicit, **kwargs})
        self._shutdown = False  # set first: __del__ runs even when __init__ raises
        valid = set(TorchLlmArgs.model_fields) | {"_mpi_session", "backend"}
        if fake_gpu.line() >= (1, 4) and "sampler_type" in kwargs:
            # PR #18513 (merged 2026-09-01, after #18232 removed the field): the keyword
            # is accepted again, "auto" and "TorchSampler" ignored with a warning,
            # "TRTLLMSampler" rejected (docs 1.4.0rc4 features/sampling; the exception's
            # type and text were not read: a ValueError here, as the argument gates raise)
            value = str(kwargs.pop("sampler_type"))
            if value == "TRTLLMSampler":
                raise ValueError(
                    "sampler_type='TRTLLMSampler' is no longer supported: TorchSampler is "
                    "the only sampler"
                )
            warnings.warn(f"sampler_type={value!r} is ignored", UserWarning, stacklevel=2)
        if fake_gpu.line() >= (1, 4):
            # _TorchLLM._validate_args_for_torch_backend (llmapi/llm.py @ 1f064c46): every
            # keyword that is not a TorchLlmArgs field, as a list, before BaseLLM's check.
            # (1.2's version of it only names TrtLlmArgs-only fields, e.g. build_config,
            # "...specific to TensorRT backend...": not modelled, 1.2's BaseLLM check is.)
            unsupported = [key for key in kwargs if key not in valid]
            if unsupported:
                raise ValueError(
                    "The following arguments are not supported by the PyTorch backend: "
                    f"{unsupported}."
                )
        for key in kwargs:
            if key not in valid:
                raise ValueError(f"{self.__class__.__name__} got invalid argument: {key}")
        self.args = TorchLlmArgs(**explicit, **kwargs)
        if tensor_parallel_size > self._gpu.device_count:
            raise RuntimeError(
                f"Only {self._gpu.device_count} GPUs are available, "
                f"but {tensor_parallel_size} are required."
            )
        on_stats = self._on_stats if self.args.enable_iter_perf_stats else None
        # The PyTorch executor (1.2): a cancel of a request still in the waiting queue
        # drops it with no response (py_executor.py _handle_canceled_requests rebuilds
        # the waiting queue without it; responses come only from active requests;
        # executor_request_queue.py @ 007a7508); generation stops at max_seq_len
        # (TorchSampler._meet_max_token_stop_criteria) and is reported as length.
        self._engine = self._gpu.new_engine(
            self.args.max_batch_size or 2048,
            on_stats,
            queued_cancel="silent",
            max_seq_len=self.args.max_seq_len,
        )
        self._gpu.on_kill(self._on_kill)
        self._ids = itertools.count(1)
        self._jobs: dict[int, Job] = {}
        self._errors: list[BaseException] = []
        self._iter_stats_result: IterationResult | None = None

    # -- public API ------------------------------------------------------------------------

    def generate_async(
        self,
        inputs: list[int] | dict[str, Any] | str,
        sampling_params: SamplingParams | None = None,
        lora_request: Any | None = None,
        prompt_adapter_request: Any | None = None,
        streaming: bool = False,
        kv_cache_retention_config: Any | None = None,
        disaggregated_params: Any | None = None,
        _postproc_params: Any | None = None,
        scheduling_params: Any | None = None,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """Submit one prompt; a plain method returning at once (do not await the call).
        The 1.2 signature (llmapi/llm.py @ 4c05a74891e4df8066f08ed4ce14b0972abe4e25): no
        `priority`, so passing one is a TypeError; installed as 1.4 the double uses
        `_generate_async_1_4` instead."""
        return self._submit(
            inputs, sampling_params, streaming, cache_salt, self._lora_options(lora_request)
        )

    def _generate_async_1_4(
        self,
        inputs: list[int] | dict[str, Any] | str,
        sampling_params: SamplingParams | None = None,
        lora_request: Any | None = None,
        prompt_adapter_request: Any | None = None,
        streaming: bool = False,
        kv_cache_retention_config: Any | None = None,
        disaggregated_params: Any | None = None,
        trace_headers: Any | None = None,
        _postproc_params: Any | None = None,
        scheduling_params: Any | None = None,
        conversation_params: Any | None = None,
        cache_salt: str | None = None,
        priority: float = DEFAULT_REQUEST_PRIORITY,
    ) -> RequestOutput:
        """The 1.4-era signature (llmapi/llm.py @ 1f064c467a211b4168555ca06bb9b801c64eae20:
        `trace_headers` moved before `_postproc_params`, `conversation_params` and
        `priority=DEFAULT_REQUEST_PRIORITY` (0.5) added). `GenerationRequest.__init__`
        (executor/request.py of the same era) refuses a priority outside [0, 1] with
        ValueError while `generate_async` runs, so the call itself raises. The double
        records the priority; it does not reorder its queue by it (the real
        `PriorityWaitingQueue` does so only with waiting_queue_policy "priority")."""
        if not (0.0 <= priority <= 1.0):
            raise ValueError(f"priority must be a float in [0.0, 1.0], got {priority}")
        # trace_headers (Optional[Mapping[str, str]]) goes on to the executor's request
        # as is (llm.py @ 1f064c46); the double records it when given
        options: dict[str, Any] = {"priority": priority, **self._lora_options(lora_request)}
        if trace_headers is not None:
            options["trace_headers"] = dict(trace_headers)
        return self._submit(inputs, sampling_params, streaming, cache_salt, options)

    def _lora_options(self, lora_request: Any | None) -> dict[str, Any]:
        """What the double records of a request's adapter. The real worker applies it only
        when the LLM has a `lora_config` (executor/base_worker.py @ 037d4ba1,
        `_enqueue_request`: `if self._lora_manager is not None and request.lora_request is
        not None`, and the LoRA manager is made only with a lora_config); without one the
        request runs on the base model and nothing says so. Recorded as `lora_request`
        when applied, `lora_request_ignored` when not."""
        if lora_request is None:
            return {}
        if self.args.lora_config is None:
            return {"lora_request_ignored": lora_request}
        return {"lora_request": lora_request}

    def _submit(
        self,
        inputs: list[int] | dict[str, Any] | str,
        sampling_params: SamplingParams | None,
        streaming: bool,
        cache_salt: str | None,
        options: dict[str, Any],
    ) -> RequestOutput:
        if self._shutdown:
            raise RuntimeError("LLM is shutting down")
        params = self._prepare_sampling_params(sampling_params)
        # llm.py @ 4c05a748: `cache_salt_id = get_cache_salt_id(cache_salt) if cache_salt
        # is not None else None`, and get_cache_salt_id (inputs/utils.py @ bab0f2e6)
        # starts with `cache_salt.encode("utf-8")`: no other check (no length limit), so
        # a non-str fails there. The same check is kept for the 1.4 shape.
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise AttributeError(f"'{type(cache_salt).__name__}' object has no attribute 'encode'")
        prompt = self._prompt_token_ids(inputs)
        max_num_tokens = self.args.max_num_tokens
        if not self.args.enable_chunked_prefill and max_num_tokens and len(prompt) > max_num_tokens:
            # BaseLLM._check_arguments: ValueError in 1.2 (llm.py @ 4c05a748), RequestError
            # (a RuntimeError) on the 1.4 line (llm.py @ 1f064c46), same text
            refusal = RequestError if fake_gpu.line() >= (1, 4) else ValueError
            raise refusal(
                f"The sum of prompt length ({float(len(prompt))}), query length (0) should not "
                f"exceed max_num_tokens ({max_num_tokens})"
            )
        self._gpu.sampling_params.append(params)
        self._gpu.submit_options.append({"cache_salt": cache_salt, **options})
        self._maybe_initialize_iteration_results()
        self._handle_background_error()
        stop_words = params._get_stop_words()
        rid = next(self._ids)
        result = RequestOutput._create(rid, prompt, params, streaming, self._abort_request)
        job = Job(
            prompt=prompt,
            max_tokens=params.max_tokens,
            emit=lambda step: None,
            end_id=-1 if params.ignore_eos else params.end_id,
            min_tokens=1 if params.min_tokens is None else params.min_tokens,
            stop_words=stop_words,
        )
        job.emit = functools.partial(self._emit, result, job)
        self._jobs[rid] = job
        self._engine.submit(job)
        return result

    def get_stats(self, timeout: float | None = 2) -> list[dict[str, Any]]:
        """Drain the iteration stats: blocks until none arrive for ``timeout`` seconds."""
        if self._iter_stats_result is None:
            return []
        self._iter_stats_result.set_timeout(timeout)
        return self._iter_stats_result.get_results()

    def get_stats_async(self, timeout: float | None = 2) -> AsyncIterable[dict[str, Any]]:
        """Returns the IterationResult (an async iterable of dicts), or an empty one."""
        if self._iter_stats_result is None:
            return _empty_async_iterable()
        self._iter_stats_result.set_timeout(timeout)
        return self._iter_stats_result

    def shutdown(self) -> None:
        if not self._shutdown:
            self._shutdown = True
            self._engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:
        self.shutdown()
        return False

    # -- internals -------------------------------------------------------------------------

    def _prepare_sampling_params(self, sampling_params: SamplingParams | None) -> SamplingParams:
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(
                "The sampling_params must be type SamplingParams or None, "
                f"but got {type(sampling_params)}"
            )
        if params.end_id is None:
            if self.args.skip_tokenizer_init:
                raise ValueError(
                    "tokenizer is required to reset end_id if it is None, or you can "
                    "explicitly specify the end_id for sampling_params"
                )
            params.end_id = self._gpu.tokenizer_eos_id  # what SamplingParams._setup does
            params.pad_id = params.pad_id if params.pad_id is not None else params.end_id
        return params

    @staticmethod
    def _prompt_token_ids(inputs: list[int] | dict[str, Any] | str) -> list[int]:
        if isinstance(inputs, dict) and "prompt_token_ids" in inputs:
            return list(inputs["prompt_token_ids"])
        if isinstance(inputs, list) and all(isinstance(t, int) for t in inputs):
            return list(inputs)
        if isinstance(inputs, str):
            raise NotImplementedError("the tensorrt_llm double takes token ids, not text")
        raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")

    def _maybe_initialize_iteration_results(self) -> None:
        if self._iter_stats_result is None:
            self._iter_stats_result = IterationResult()  # binds to the caller's loop, if any
        else:
            self._iter_stats_result.mark_undone()

    def _handle_background_error(self) -> None:
        if self._errors:
            error = self._errors.pop(0)
            self.shutdown()
            raise error

    def _on_kill(self) -> None:
        self._errors.append(RuntimeError(self._gpu.death_message))

    def _abort_request(self, request_id: int) -> None:
        job = self._jobs.get(request_id)
        if job is not None:
            self._engine.cancel(job)

    def _on_stats(self, stats: IterStats) -> None:
        if self._iter_stats_result is not None:
            with contextlib.suppress(AsyncQueue.EventLoopShutdownError):
                self._iter_stats_result.queue.put(IterationStats._from(stats).to_json_str())

    def _logprobs(self, tokens: list[int], k: int, params: SamplingParams) -> TokenLogprobs:
        """The top-k per token. TorchSampler (what sampler_type "auto" picks for beam
        width 1) ranks the log-softmax before temperature and top-k/top-p and returns
        its top k (sampler.py, _process_requests / handle_logprobs @ 28edbcdb): under
        sampling the sampled token need not be among them, and the fake model's
        distribution puts another token first (token + 1000). TRTLLMSampler returns
        one entry per token whatever k, the sampled token's own log probability at rank
        1 (sampler.py @ 28edbcdb, TRTLLMSampler.update_requests_single_beam_single_step).
        The 1.4 line gives "the top K plus the sampled token" (`logprobs` docstring,
        executor/params/sampling.py @ 1f064c46): a sampled token outside the top K is
        added at its own rank, below them."""
        lp = self._gpu.logprob
        # read without the DeprecationWarning pydantic gives the 1.4 field on access
        torch_sampler = vars(self.args).get("sampler_type") != "TRTLLMSampler"
        if not torch_sampler:
            return [{t: Logprob(lp, rank=1)} for t in tokens]
        shift = 0 if params._greedy_decoding else 1000
        tops = [{t + shift + i: Logprob(lp - i, rank=i + 1) for i in range(k)} for t in tokens]
        if fake_gpu.line() >= (1, 4):
            for token, top in zip(tokens, tops, strict=True):
                top.setdefault(token, Logprob(lp - k, rank=k + 1))
        return tops

    def _emit(self, result: RequestOutput, job: Job, step: Step) -> None:
        """Engine thread: turn one step into the LlmResponse the PyTorch executor would send."""
        params = result.sampling_params
        if step.error is not None:
            result._deliver((_LlmResponse(result.request_id, step.error), None))
            return
        final = step.finish is not None
        if result._streaming:
            tokens = step.tokens
            if not final and not tokens:
                return
        elif not final:
            return  # non-streaming: only the final response is sent
        elif params.exclude_input_from_output:
            tokens = list(job.generated)
        else:
            tokens = result.prompt_token_ids + job.generated
        payload = _PyResult(
            is_final=final,
            output_token_ids=[tokens],
            finish_reasons=[_FINISH[step.finish] if step.finish else FinishReason.NOT_FINISHED],
            decoding_iter=job.steps,
        )
        if params.logprobs:
            payload.log_probs = [self._logprobs(job.generated, params.logprobs, params)]
            payload.cum_log_probs = [self._gpu.logprob * len(job.generated)]
        result._deliver((_LlmResponse(result.request_id, None, payload), None))


if fake_gpu.line() >= (1, 3):
    # priority came with 1.3 (TensorRT-LLM PR #12362); the adapter reads the signature
    setattr(LLM, "generate_async", LLM._generate_async_1_4)  # noqa: B010
