"""A real model on a real GPU through the LLM API adapter. Skipped unless `tensorrt_llm`
imports, a GPU is visible and WORKER_GPU_TEST_MODEL names a small HF checkpoint folder;
the LoRA test also needs WORKER_GPU_TEST_LORA_DIR, a folder of PEFT adapters trained for
that model. How to run it in NVIDIA's container: docs/gpu.md, "The GPU smoke test"."""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from pathlib import Path

import pytest

from trtllm_worker.config import Settings
from trtllm_worker.engine.base import Engine, EngineOutput, EngineRequest, FinishReason, Sampling
from trtllm_worker.pipeline.output import OutputProcessor, RequestState
from trtllm_worker.tokenizer import load_tokenizer

MODEL = os.environ.get("WORKER_GPU_TEST_MODEL")
LORA_DIR = os.environ.get("WORKER_GPU_TEST_LORA_DIR")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("tensorrt_llm") is None, reason="tensorrt_llm is not installed"
    ),
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no NVIDIA GPU visible"),
    pytest.mark.skipif(MODEL is None, reason="WORKER_GPU_TEST_MODEL is not set"),
]


def run_to_end(engine: Engine, ids: set[int], limit_s: float) -> dict[int, list[EngineOutput]]:
    """Drive the engine as the looper does until every request in `ids` is final."""
    outputs: dict[int, list[EngineOutput]] = {i: [] for i in ids}
    deadline = time.monotonic() + limit_s
    while any(not o or not o[-1].final for o in outputs.values()):
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for output in engine.wait(0.1):
            outputs.setdefault(output.id, []).append(output)
    return outputs


@pytest.mark.timeout(900)
def test_llm_api_generates_and_cancels() -> None:
    from trtllm_worker.engine import trtllm

    assert MODEL is not None
    settings = Settings(_env_file=None, engine="trtllm", model=Path(MODEL), max_batch=8)
    tokenizer = load_tokenizer(settings.tokenizer_source, settings.eos_token)
    engine = trtllm.create(settings, tokenizer)
    try:
        prompt = tokenizer.tokenizer.encode("The capital of France is").ids
        greedy = EngineRequest(
            id=1,
            prompt_ids=prompt,
            max_new_tokens=16,
            end_id=tokenizer.end_id,
            eos_ids=tokenizer.eos_ids,
            sampling=Sampling(do_sample=False),
            return_logprobs=True,
        )
        long = EngineRequest(
            id=2,
            prompt_ids=prompt,
            max_new_tokens=1000,
            end_id=tokenizer.end_id,
            eos_ids=frozenset(),
            ignore_eos=True,
        )
        engine.enqueue(long)
        first: list[EngineOutput] = []
        while not first:
            first = [o for o in engine.wait(0.1) if o.id == 2]
        engine.cancel(2)
        engine.enqueue(greedy)
        outputs = run_to_end(engine, {1, 2}, 300)
    finally:
        engine.shutdown()
    assert outputs[2][-1].finish is FinishReason.CANCELLED
    final = outputs[1][-1]
    assert final.finish in (FinishReason.LENGTH, FinishReason.EOS_TOKEN)
    tokens = [t for o in outputs[1] for t in o.token_ids]
    assert 0 < len(tokens) <= 16
    assert all(o.logprobs is None or len(o.logprobs) == len(o.token_ids) for o in outputs[1])
    state = RequestState(
        request_id="gpu",
        key="gpu",
        engine_id=1,
        tokenizer=tokenizer.tokenizer,
        prompt_ids=prompt,
        input_tokens=len(prompt),
        eos_ids=tokenizer.eos_ids,
    )
    processor = OutputProcessor()
    processor.add(state)
    batch = processor.process(outputs[1])
    text = "".join(str(f["text"]) for _, _, f in batch.entries if f["event"] == "token")
    assert "Paris" in text


def _request(request_id: int, prompt: list[int], max_new: int, **fields: object) -> EngineRequest:
    return EngineRequest(id=request_id, prompt_ids=prompt, max_new_tokens=max_new, **fields)  # type: ignore[arg-type]


@pytest.mark.timeout(900)
def test_llm_api_cancel_of_a_queued_request_ends_it() -> None:
    """The engine holds one request at a time (max_batch_size 1 through the settings):
    the second is queued inside TensorRT-LLM, which drops a cancelled queued request
    without a word in 1.2. The adapter must still end it, cancelled, without tokens."""
    from trtllm_worker.engine import trtllm

    assert MODEL is not None
    settings = Settings(
        _env_file=None,
        engine="trtllm",
        model=Path(MODEL),
        max_batch=1,
        engine_cancel_timeout_s=5,
    )
    tokenizer = load_tokenizer(settings.tokenizer_source, settings.eos_token)
    engine = trtllm.create(settings, tokenizer)
    try:
        prompt = tokenizer.tokenizer.encode("Count to a thousand:").ids
        engine.enqueue(_request(1, prompt, 2000, ignore_eos=True))
        engine.enqueue(_request(2, prompt, 2000, ignore_eos=True))
        started: list[EngineOutput] = []
        while not started:
            started = [o for o in engine.wait(0.1) if o.id == 1]
        engine.cancel(2)
        began = time.monotonic()
        outputs = run_to_end(engine, {2}, 60)
        ended_after = time.monotonic() - began
        engine.cancel(1)
        run_to_end(engine, {1}, 60)
    finally:
        engine.shutdown()
    assert outputs[2][-1].finish is FinishReason.CANCELLED
    assert [t for o in outputs[2] for t in o.token_ids] == []
    assert ended_after < settings.engine_cancel_timeout_s + 5


@pytest.mark.timeout(900)
def test_llm_api_seed_reproduces_a_sampled_continuation() -> None:
    """With the default sampler (TRTLLMSampler) the same seed gives the same sampled
    tokens, and another seed (almost surely) others: the seed is honoured."""
    from trtllm_worker.engine import trtllm

    assert MODEL is not None
    settings = Settings(_env_file=None, engine="trtllm", model=Path(MODEL), max_batch=4)
    tokenizer = load_tokenizer(settings.tokenizer_source, settings.eos_token)
    engine = trtllm.create(settings, tokenizer)
    prompt = tokenizer.tokenizer.encode("Once upon a time").ids
    try:
        runs = {}
        for request_id, seed in ((1, 7), (2, 7), (3, 8)):
            request = _request(
                request_id,
                prompt,
                32,
                ignore_eos=True,
                sampling=Sampling(do_sample=True, temperature=1.0, top_k=50, seed=seed),
            )
            engine.enqueue(request)
            runs[request_id] = [
                t for o in run_to_end(engine, {request_id}, 300)[request_id] for t in o.token_ids
            ]
    finally:
        engine.shutdown()
    assert runs[1] == runs[2]
    assert runs[1] != runs[3]


@pytest.mark.timeout(900)
def test_llm_api_top_logprobs_with_torch_sampler() -> None:
    """TorchSampler returns the top K of the log-softmax per token, most likely first
    (1.2's sampler.py); greedy, the generated token is the first of them and its own
    `logprob` is that entry's."""
    from trtllm_worker.engine import trtllm

    assert MODEL is not None
    settings = Settings(
        _env_file=None, engine="trtllm", model=Path(MODEL), max_batch=4, sampler="TorchSampler"
    )
    tokenizer = load_tokenizer(settings.tokenizer_source, settings.eos_token)
    engine = trtllm.create(settings, tokenizer)
    try:
        assert engine.limits.max_top_logprobs >= 5
        prompt = tokenizer.tokenizer.encode("The capital of France is").ids
        request = _request(
            1,
            prompt,
            8,
            end_id=tokenizer.end_id,
            eos_ids=tokenizer.eos_ids,
            sampling=Sampling(do_sample=False),
            return_logprobs=True,
            top_logprobs=5,
        )
        engine.enqueue(request)
        outputs = run_to_end(engine, {1}, 300)[1]
    finally:
        engine.shutdown()
    checked = 0
    for output in outputs:
        assert output.top_logprobs is not None or not output.token_ids
        for index, token in enumerate(output.token_ids):
            assert output.top_logprobs is not None
            top = output.top_logprobs[index]
            assert top is not None
            assert len(top) == 5
            values = [logprob for _, logprob in top]
            assert values == sorted(values, reverse=True)
            assert top[0][0] == token
            assert output.logprobs is not None
            assert output.logprobs[index] == pytest.approx(top[0][1], abs=1e-3)
            checked += 1
    assert checked > 0


@pytest.mark.timeout(900)
@pytest.mark.skipif(LORA_DIR is None, reason="WORKER_GPU_TEST_LORA_DIR is not set")
def test_llm_api_lora_adapter_changes_the_output() -> None:
    """Each adapter of WORKER_GPU_TEST_LORA_DIR, greedy on the same prompt: every job
    ends, and at least one adapter's tokens differ from the base model's (an adapter
    that reached no request would leave them all equal)."""
    from trtllm_worker.engine import trtllm
    from trtllm_worker.engine.lora import discover_adapters

    assert MODEL is not None
    assert LORA_DIR is not None
    settings = Settings(
        _env_file=None, engine="trtllm", model=Path(MODEL), max_batch=4, lora_dir=Path(LORA_DIR)
    )
    adapters = discover_adapters(settings.lora_dir)
    assert len(adapters) > 0, f"no adapter found in {LORA_DIR}"
    tokenizer = load_tokenizer(settings.tokenizer_source, settings.eos_token)
    engine = trtllm.create(settings, tokenizer, adapters)
    prompt = tokenizer.tokenizer.encode("Write one sentence about the sea.").ids
    runs: dict[str | None, list[int]] = {}
    try:
        for request_id, name in enumerate([None, *adapters], start=1):
            engine.enqueue(
                _request(
                    request_id,
                    prompt,
                    24,
                    ignore_eos=True,
                    sampling=Sampling(do_sample=False),
                    adapter=None if name is None else adapters[name],
                )
            )
            outputs = run_to_end(engine, {request_id}, 300)[request_id]
            assert outputs[-1].error is None, outputs[-1].error
            runs[name] = [t for o in outputs for t in o.token_ids]
    finally:
        engine.shutdown()
    assert all(len(tokens) == 24 for tokens in runs.values())
    assert any(runs[name] != runs[None] for name in adapters)
