"""The TensorRT-LLM test double behaves as the 1.2.x sources do (see tests/doubles)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest

from tests.doubles import FakeGpu, install_tensorrt_llm

WAIT = timedelta(seconds=5)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> FakeGpu:
    """The double at the test's `release` mark, else at the level TRTLLM_DOUBLE_RELEASE
    names (`make test` runs this file at both)."""
    marker = request.node.get_closest_marker("release")
    return install_tensorrt_llm(monkeypatch, marker.args[0] if marker else None)


# -- LLM API ---------------------------------------------------------------------------------


async def test_streaming_yields_diffs_and_keeps_the_end_id(gpu: FakeGpu) -> None:
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import KvCacheConfig

    gpu.tokens_per_step = 2  # as with speculative decoding
    with LLM(
        "ckpt", skip_tokenizer_init=True, kv_cache_config=KvCacheConfig(enable_block_reuse=False)
    ) as llm:
        params = SamplingParams(end_id=7, max_tokens=10, detokenize=False)
        out = llm.generate_async([4, 5, 6, 7], params, streaming=True)
        diffs = [o.outputs[0].token_ids_diff async for o in out]
    assert diffs == [[4, 5], [6, 7]]
    assert out.finished
    assert out.outputs[0].token_ids == [4, 5, 6, 7]  # PyTorch backend: EOS stays in
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason is None
    assert gpu.llm_kwargs[0]["kv_cache_config"].enable_block_reuse is False
    assert gpu.sampling_params == [params]


async def test_min_tokens_masks_eos_and_stop_token_ids_are_trimmed(gpu: FakeGpu) -> None:
    from tensorrt_llm import LLM, SamplingParams

    llm = LLM("ckpt", skip_tokenizer_init=True)
    eos_first = await llm.generate_async([2, 5, 2], SamplingParams(end_id=2, max_tokens=9))
    assert eos_first.outputs[0].token_ids == [3, 5, 2]  # EOS masked until min_tokens (1)
    stopped = await llm.generate_async([4, 5, 6], SamplingParams(end_id=-1, stop_token_ids=[6]))
    assert stopped.outputs[0].token_ids == [4, 5]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", 6)
    llm.shutdown()


async def test_logprobs_are_top_k_dicts(gpu: FakeGpu) -> None:
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.executor.result import Logprob

    llm = LLM("ckpt", skip_tokenizer_init=True)
    none = await llm.generate_async([4], SamplingParams(end_id=-1, max_tokens=2, logprobs=0))
    one = await llm.generate_async([4, 5], SamplingParams(end_id=-1, max_tokens=2, logprobs=1))
    assert none.outputs[0].logprobs == []  # logprobs=0 returns nothing in 1.2
    assert one.outputs[0].logprobs == [{4: Logprob(-0.5, rank=1)}, {5: Logprob(-0.5, rank=1)}]
    llm.shutdown()


@pytest.mark.release("1.2.1")
async def test_top_k_logprobs_per_sampler(gpu: FakeGpu) -> None:
    """TorchSampler returns the top K of the log-softmax, ranks 1..K; TRTLLMSampler one
    entry per token, the sampled token's at rank 1, whatever K (sampler.py @ 28edbcdb)."""
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.executor.result import Logprob

    params = SamplingParams(end_id=-1, max_tokens=1, logprobs=3, top_k=1)
    torch = LLM("ckpt", skip_tokenizer_init=True, sampler_type="TorchSampler")
    top = (await torch.generate_async([4], params)).outputs[0].logprobs
    torch.shutdown()
    assert top == [{4: Logprob(-0.5, rank=1), 5: Logprob(-1.5, rank=2), 6: Logprob(-2.5, rank=3)}]
    trtllm = LLM("ckpt", skip_tokenizer_init=True, sampler_type="TRTLLMSampler")
    own = (await trtllm.generate_async([4], params)).outputs[0].logprobs
    trtllm.shutdown()
    assert own == [{4: Logprob(-0.5, rank=1)}]


async def test_abort_ends_with_cancelled(gpu: FakeGpu) -> None:
    from tensorrt_llm import LLM, SamplingParams

    gpu.step_s = 0.01
    llm = LLM("ckpt", skip_tokenizer_init=True)
    out = llm.generate_async([4, 5], SamplingParams(end_id=-1, max_tokens=10_000), streaming=True)
    async for step in out:
        if not step.aborted():
            step.abort()
    assert out.aborted()
    assert out.outputs[0].finish_reason == "cancelled"
    llm.shutdown()


async def test_a_failed_request_raises_request_error_alone(gpu: FakeGpu) -> None:
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import RequestError

    llm = LLM("ckpt", skip_tokenizer_init=True)
    params = SamplingParams(end_id=-1, max_tokens=3)
    good = llm.generate_async([4], params, streaming=True)
    bad = llm.generate_async([4, FakeGpu.POISON_TOKEN], params, streaming=True)
    with pytest.raises(RequestError, match="POISON_TOKEN"):
        async for _ in bad:
            pass
    assert (await good).outputs[0].token_ids == [4, 4, 4]
    llm.shutdown()


def test_result_made_without_a_running_loop_only_iterates_synchronously(gpu: FakeGpu) -> None:
    from tensorrt_llm import LLM, SamplingParams

    llm = LLM("ckpt", skip_tokenizer_init=True)
    out = llm.generate_async([5, 6], SamplingParams(end_id=-1, max_tokens=3), streaming=True)

    async def consume() -> None:
        async for _ in out:
            pass

    with pytest.raises(AssertionError, match="event loop was not present"):
        asyncio.run(consume())
    assert [o.outputs[0].token_ids_diff for o in out] == [[5], [6], [5]]
    llm.shutdown()


async def test_result_made_inside_a_loop_warns_on_sync_use(gpu: FakeGpu) -> None:
    from tensorrt_llm import LLM, SamplingParams

    llm = LLM("ckpt", skip_tokenizer_init=True)
    out = llm.generate_async([5], SamplingParams(end_id=-1, max_tokens=1))
    with pytest.warns(UserWarning, match="running in async mode"):
        out.result(timeout=5)
    llm.shutdown()


@pytest.mark.release("1.2.1")
def test_llm_arguments_are_checked(gpu: FakeGpu) -> None:
    from tensorrt_llm import LLM, SamplingParams

    with pytest.raises(ValueError, match="LLM got invalid argument: max_new_tokens"):
        LLM("ckpt", max_new_tokens=3)
    with pytest.raises(RuntimeError, match="Only 1 GPUs are available"):
        LLM("ckpt", tensor_parallel_size=2)
    llm = LLM("ckpt", skip_tokenizer_init=True, max_batch_size=4, enable_iter_perf_stats=True)
    with pytest.raises(ValueError, match="tokenizer is required to reset end_id"):
        llm.generate_async([1], SamplingParams())
    with pytest.raises(TypeError):
        SamplingParams(1)  # type: ignore[call-arg]  # keyword-only dataclass
    llm.shutdown()
    with pytest.raises(RuntimeError, match="LLM is shutting down"):
        llm.generate_async([1], SamplingParams(end_id=2))


def test_get_stats_needs_iter_perf_stats_and_returns_dicts(gpu: FakeGpu) -> None:
    from tensorrt_llm import LLM, SamplingParams

    llm = LLM("ckpt", skip_tokenizer_init=True, enable_iter_perf_stats=True)
    assert llm.get_stats(timeout=0.05) == []  # nothing submitted yet
    llm.generate_async([4, 5], SamplingParams(end_id=-1, max_tokens=3)).result(timeout=5)
    stats = llm.get_stats(timeout=0.1)
    assert stats
    assert {"iter", "iterLatencyMS", "numActiveRequests", "numQueuedRequests"} <= stats[0].keys()
    assert {"maxNumBlocks", "freeNumBlocks", "usedNumBlocks"} <= stats[0]["kvCacheStats"].keys()
    llm.shutdown()


async def test_engine_death_hangs_pending_results_and_fails_the_next_submit(gpu: FakeGpu) -> None:
    from tensorrt_llm import LLM, SamplingParams

    gpu.step_s = 0.01
    llm = LLM("ckpt", skip_tokenizer_init=True)
    params = SamplingParams(end_id=-1, max_tokens=10_000)
    pending = llm.generate_async([4], params, streaming=True)
    gpu.kill("worker died")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pending.aresult(), 0.1)  # 1.2 has no EngineDeadError
    with pytest.raises(RuntimeError, match="worker died"):
        llm.generate_async([4], params)
    with pytest.raises(RuntimeError, match="LLM is shutting down"):
        llm.generate_async([4], params)


# -- Executor binding ------------------------------------------------------------------------


@pytest.mark.release("1.2.1")
def test_executor_streaming_has_error_and_kw_only_request(gpu: FakeGpu) -> None:
    import tensorrt_llm.bindings.executor as tle

    config = tle.ExecutorConfig(1, max_batch_size=2, kv_cache_config=tle.KvCacheConfig(True))
    executor = tle.Executor("engine", tle.ModelType.DECODER_ONLY, config)
    assert gpu.executor_configs == [config]
    with pytest.raises(TypeError):
        tle.Request([4, 5], 3, True)  # type: ignore[call-arg]
    output = tle.OutputConfig(return_log_probs=True)
    req = tle.Request([4, 5, 9], 5, streaming=True, end_id=9, output_config=output, client_id=7)
    bad = tle.Request([FakeGpu.POISON_TOKEN], 5, streaming=True)
    rid, bad_id = executor.enqueue_request(req), executor.enqueue_request(bad)
    tokens: list[int] = []
    last = None
    while last is None or not last.result.is_final:
        for response in executor.await_responses(WAIT):
            if response.has_error():
                assert response.request_id == bad_id
                with pytest.raises(RuntimeError, match="response with an error"):
                    _ = response.result
                continue
            with pytest.raises(RuntimeError, match="without error"):
                _ = response.error_msg
            assert (response.request_id, response.client_id) == (rid, 7)
            tokens += response.result.output_token_ids[0]
            last = response
    assert tokens == [4, 5]  # the end id is excluded
    assert last.result.finish_reasons == [tle.FinishReason.END_ID]
    assert last.result.log_probs == [[-0.5, -0.5]]  # cumulative, not a diff
    assert executor.await_responses(timedelta(milliseconds=20)) == []
    again = executor.await_responses(rid, WAIT)
    assert again[0].error_msg == f"ReqId {rid} has already been processed and was terminated."
    stats = executor.get_latest_iteration_stats()
    assert stats
    assert stats[0].kv_cache_stats is not None
    assert stats[0].max_num_active_requests == 2
    executor.shutdown()
    with pytest.raises(RuntimeError, match="Shutdown called"):
        executor.await_responses(WAIT)


@pytest.mark.release("1.2.1")
def test_executor_cancel_timeout_and_non_streaming_output(gpu: FakeGpu) -> None:
    import tensorrt_llm.bindings.executor as tle

    gpu.step_s = 0.005
    executor = tle.Executor("engine", tle.ModelType.DECODER_ONLY, tle.ExecutorConfig())
    long = tle.Request([4], 100_000, streaming=True)
    timed = tle.Request([4], 100_000, allotted_time_ms=timedelta(milliseconds=30))
    whole = tle.Request([4, 5], 3)
    ids = [executor.enqueue_request(r) for r in (long, timed, whole)]
    time.sleep(0.05)
    executor.cancel_request(ids[0])
    finals: dict[int, tle.Result] = {}
    deadline = time.monotonic() + 5
    while len(finals) < 3 and time.monotonic() < deadline:
        for r in executor.await_responses(timedelta(milliseconds=100)):
            if r.result.is_final:
                finals[r.request_id] = r.result
    assert finals[ids[0]].finish_reasons == [tle.FinishReason.CANCELLED]
    assert finals[ids[1]].finish_reasons == [tle.FinishReason.TIMED_OUT]
    assert finals[ids[2]].output_token_ids == [[4, 5, 4, 5, 4]]  # prompt included by default
    assert finals[ids[2]].finish_reasons == [tle.FinishReason.LENGTH]
    gpu.kill("rank 0 died")
    with pytest.raises(RuntimeError, match="rank 0 died"):
        executor.await_responses(WAIT)


# -- how 1.2 really behaves (shared/reference/tensorrt-llm.md, section 8) ---------------------


async def test_llm_api_abort_of_a_queued_request_is_silent(gpu: FakeGpu) -> None:
    """py_executor.py: a cancelled request still waiting is dropped from the waiting
    queue; only active requests produce responses. Its result never finishes."""
    from tensorrt_llm import LLM, SamplingParams

    gpu.step_s = 0.002
    with LLM("ckpt", skip_tokenizer_init=True, max_batch_size=1) as llm:
        params = SamplingParams(end_id=-1, max_tokens=200, detokenize=False)
        running = llm.generate_async([4], params, streaming=True)
        queued = llm.generate_async([5], params, streaming=True)
        queued.abort()
        assert queued.aborted()
        async for _ in running:
            pass
        assert running.finished
        assert not queued.finished
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(queued.aresult(), 0.3)


async def test_llm_api_generation_stops_at_max_seq_len_reported_as_length(gpu: FakeGpu) -> None:
    """Only a prompt over max_num_tokens is refused; past max_seq_len the sampler stops
    the request and calls it `length` (TorchSampler._meet_max_token_stop_criteria)."""
    from tensorrt_llm import LLM, SamplingParams

    with LLM("ckpt", skip_tokenizer_init=True, max_seq_len=10) as llm:
        params = SamplingParams(end_id=-1, max_tokens=100, detokenize=False)
        out = await llm.generate_async([4, 5, 6], params, streaming=True).aresult()
    assert len(out.outputs[0].token_ids or []) == 7  # 3 + 7 = max_seq_len
    assert out.outputs[0].finish_reason == "length"


async def test_llm_api_stats_go_quiet_when_idle(gpu: FakeGpu) -> None:
    """get_stats_async yields one dict per iteration and ends after `timeout` without
    one; an idle engine runs no iterations, so it then yields nothing."""
    from tensorrt_llm import LLM, SamplingParams

    with LLM("ckpt", skip_tokenizer_init=True, enable_iter_perf_stats=True) as llm:
        params = SamplingParams(end_id=-1, max_tokens=5, detokenize=False)
        await llm.generate_async([4], params).aresult()
        busy = [s async for s in llm.get_stats_async(timeout=0.2)]
        idle = [s async for s in llm.get_stats_async(timeout=0.2)]
    assert busy
    assert all(isinstance(s, dict) for s in busy)
    assert idle == []


@pytest.mark.release("1.2.1")
def test_executor_cancel_of_a_queued_request_waits_for_admission(gpu: FakeGpu) -> None:
    """executorImpl.cpp: cancelRequest records the id; only active requests are
    terminated. A queued request is admitted, runs a step, then ends CANCELLED."""
    import tensorrt_llm.bindings.executor as tle

    gpu.step_s = 0.002
    config = tle.ExecutorConfig(max_batch_size=1)
    with tle.Executor("engine", tle.ModelType.DECODER_ONLY, config) as executor:
        first = executor.enqueue_request(tle.Request([4], 20, streaming=True))
        queued = executor.enqueue_request(tle.Request([5], 20, streaming=True))
        executor.cancel_request(queued)
        responses: list[tle.Response] = []
        while not any(r.result.is_final for r in responses):
            responses += executor.await_responses(queued, timeout=WAIT)
        executor.cancel_request(first)
    tokens = [t for r in responses for t in r.result.output_token_ids[0]]
    assert tokens  # its first step ran once admitted
    assert responses[-1].result.finish_reasons == [tle.FinishReason.CANCELLED]


# -- priorities and tenants (generate_async by release, Request) ------------------------------

GENERATE_ASYNC_1_2 = [
    "inputs",
    "sampling_params",
    "lora_request",
    "prompt_adapter_request",
    "streaming",
    "kv_cache_retention_config",
    "disaggregated_params",
    "_postproc_params",
    "scheduling_params",
    "cache_salt",
]
"""llmapi/llm.py @ 4c05a74891e4df8066f08ed4ce14b0972abe4e25."""

GENERATE_ASYNC_1_4 = [
    "inputs",
    "sampling_params",
    "lora_request",
    "prompt_adapter_request",
    "streaming",
    "kv_cache_retention_config",
    "disaggregated_params",
    "trace_headers",
    "_postproc_params",
    "scheduling_params",
    "conversation_params",
    "cache_salt",
    "priority",
]
"""llmapi/llm.py @ 1f064c467a211b4168555ca06bb9b801c64eae20."""


def _parameters(llm: object) -> list[str]:
    import inspect

    return list(inspect.signature(llm.generate_async).parameters)  # type: ignore[attr-defined]


@pytest.mark.release("1.2.1")
def test_generate_async_1_2_has_no_priority(gpu: FakeGpu) -> None:
    from tensorrt_llm import LLM, SamplingParams

    with LLM("ckpt", skip_tokenizer_init=True) as llm:
        assert _parameters(llm) == GENERATE_ASYNC_1_2
        params = SamplingParams(end_id=2, max_tokens=2)
        with pytest.raises(TypeError, match="priority"):
            llm.generate_async([4], params, priority=0.5)  # type: ignore[call-arg]
        llm.generate_async([4], params, cache_salt="tenant-a").result()
    assert gpu.submit_options == [{"cache_salt": "tenant-a"}]


def test_generate_async_1_4_takes_a_priority_in_0_to_1(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = install_tensorrt_llm(monkeypatch, "1.4.0")
    import tensorrt_llm
    from tensorrt_llm import LLM, SamplingParams

    assert tensorrt_llm.__version__ == "1.4.0"
    with LLM("ckpt", skip_tokenizer_init=True) as llm:
        assert _parameters(llm) == GENERATE_ASYNC_1_4
        generate: Any = llm.generate_async  # the 1.4 shape, which the double's source hides
        params = SamplingParams(end_id=2, max_tokens=2)
        for bad in (1.01, -0.1, float("nan")):
            with pytest.raises(ValueError, match=r"priority must be a float in \[0.0, 1.0\]"):
                generate([4], params, priority=bad)
        generate([4], params).result()
        generate([4], params, priority=1.0, cache_salt="tenant-a").result()
        generate([4], params, priority=0.0).result()
    assert gpu.submit_options == [
        {"cache_salt": None, "priority": 0.5},
        {"cache_salt": "tenant-a", "priority": 1.0},
        {"cache_salt": None, "priority": 0.0},
    ]


@pytest.mark.release("1.2.1")
def test_cache_salt_must_be_a_str(gpu: FakeGpu) -> None:
    """1.2 checks nothing else: `get_cache_salt_id` calls `cache_salt.encode("utf-8")`."""
    from tensorrt_llm import LLM, SamplingParams

    with LLM("ckpt", skip_tokenizer_init=True) as llm:
        with pytest.raises(AttributeError, match="encode"):
            llm.generate_async([4], SamplingParams(end_id=2), cache_salt=7)  # type: ignore[arg-type]
        llm.generate_async([4], SamplingParams(end_id=2, max_tokens=1), cache_salt="t" * 1000)
    assert gpu.submit_options == [{"cache_salt": "t" * 1000}]  # no length limit in 1.2


@pytest.mark.release("1.2.1")
def test_executor_request_priority_and_cache_salt_id(gpu: FakeGpu) -> None:
    """request.cpp: `priority` defaults to 0.5; `cache_salt_id` is an optional uint64."""
    import tensorrt_llm.bindings.executor as tle

    assert tle.Request([4], 3).priority == 0.5
    assert tle.Request([4], 3).cache_salt_id is None
    request = tle.Request([4], 3, priority=1.0, cache_salt_id=(1 << 64) - 1)
    assert (request.priority, request.cache_salt_id) == (1.0, (1 << 64) - 1)
    for bad in (-1, 1 << 64):
        with pytest.raises(TypeError):
            tle.Request([4], 3, cache_salt_id=bad)


@pytest.mark.release("1.4.0rc1")
def test_the_1_4_line_has_torch_sampler_only(gpu: FakeGpu) -> None:
    """PR #18232 removed TRTLLMSampler and the sampler_type field; PR #18513 accepts the
    keyword again, "auto" and "TorchSampler" ignored, "TRTLLMSampler" rejected (docs
    1.4.0rc4, features/sampling)."""
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    assert "sampler_type" not in TorchLlmArgs.model_fields
    with pytest.warns(UserWarning, match="ignored"):
        LLM("ckpt", skip_tokenizer_init=True, sampler_type="TorchSampler").shutdown()
    with pytest.raises(ValueError, match="TRTLLMSampler"):
        LLM("ckpt", skip_tokenizer_init=True, sampler_type="TRTLLMSampler")
