"""Each job parameter reaches TensorRT-LLM under the right name with the right value,
and each setting reaches the engine's construction."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import trtllm_worker.engine
from tests.doubles import FakeGpu
from tests.engines.conftest import create_trtllm, drive, trtllm_settings
from trtllm_worker.config import Settings
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.engine import engine_factory
from trtllm_worker.engine.base import Engine, EngineRequest, Guide, Sampling
from trtllm_worker.tokenizer import load_tokenizer

FULL = Sampling(
    do_sample=True,
    temperature=0.7,
    top_k=40,
    top_p=0.9,
    repetition_penalty=1.1,
    frequency_penalty=0.5,
    presence_penalty=-0.5,
    seed=1234,
)


@contextlib.contextmanager
def running(settings: Settings) -> Iterator[Engine]:
    engine = create_trtllm(settings)
    try:
        yield engine
    finally:
        engine.shutdown()


def full_request(request_id: int = 1, **overrides: Any) -> EngineRequest:
    values: dict[str, Any] = {
        "id": request_id,
        "prompt_ids": [5, 6, 7],
        "max_new_tokens": 12,
        "min_new_tokens": 3,
        "end_id": 2,
        "eos_ids": frozenset({2, 9}),
        "sampling": FULL,
        "return_logprobs": True,
    }
    values.update(overrides)
    return EngineRequest(**values)


# -- LLM API -------------------------------------------------------------------------------


def test_llm_api_sampling_params(gpu: FakeGpu, tmp_path: Path) -> None:
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        drive(engine, [full_request()])
    params = gpu.sampling_params[-1]
    assert (params.max_tokens, params.min_tokens) == (12, 3)
    assert (params.temperature, params.top_k, params.top_p) == (0.7, 40, 0.9)
    assert params.repetition_penalty == 1.1
    assert (params.frequency_penalty, params.presence_penalty) == (0.5, -0.5)
    assert params.seed == 1234
    assert (params.end_id, params.pad_id) == (2, 2)
    assert params.stop_token_ids == [9]
    assert params.ignore_eos is False
    assert params.logprobs == 1
    assert params.detokenize is False


def test_llm_api_top_logprobs_ask_for_k(gpu: FakeGpu, tmp_path: Path) -> None:
    """`top_logprobs` K is `logprobs=K`: TorchSampler's top K per token, which the
    sampled token's own `logprob` is read from too."""
    settings = trtllm_settings(tmp_path, "trtllm", sampler="TorchSampler")
    with running(settings) as engine:
        drive(engine, [full_request(top_logprobs=4)])
    assert gpu.sampling_params[-1].logprobs == 4


def test_llm_api_greedy_random_seed_and_ignore_eos(gpu: FakeGpu, tmp_path: Path) -> None:
    greedy = Sampling(do_sample=False, temperature=0.7, top_p=0.9)
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        drive(
            engine,
            [
                full_request(1, sampling=greedy, return_logprobs=False),
                full_request(2, sampling=Sampling(), ignore_eos=True, eos_ids=frozenset()),
            ],
        )
    first, second = sorted(gpu.sampling_params[-2:], key=lambda p: -(p.end_id or 0))
    assert (first.top_k, first.top_p, first.temperature) == (1, None, None)
    assert first.logprobs is None
    # ignore_eos is what 1.2's ignore_eos does to the request: end_id -1 (base_worker.py)
    assert (second.end_id, second.ignore_eos) == (-1, False)
    assert second.stop_token_ids is None
    assert first.seed is not None
    assert second.seed is not None
    assert first.seed != second.seed  # no job seed: a random one each, never 0 for all


def test_llm_api_construction_from_settings(gpu: FakeGpu, tmp_path: Path) -> None:
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"max_batch_size": 64, "enable_chunked_prefill": True}))
    settings = trtllm_settings(
        tmp_path,
        "trtllm",
        tensor_parallel_size=1,
        max_num_tokens=4096,
        max_seq_len=3000,
        kv_cache_free_gpu_memory_fraction=0.5,
        kv_cache_block_reuse=False,
        llm_extra_options=extra,
    )
    create_trtllm(settings).shutdown()
    kwargs = gpu.llm_kwargs[-1]
    assert kwargs["model"] == str(tmp_path)
    assert kwargs["skip_tokenizer_init"] is True
    assert kwargs["tensor_parallel_size"] == 1
    assert kwargs["max_num_tokens"] == 4096
    assert kwargs["max_seq_len"] == 3000
    assert kwargs["kv_cache_config"].free_gpu_memory_fraction == 0.5
    assert kwargs["kv_cache_config"].enable_block_reuse is False
    assert kwargs["enable_iter_perf_stats"] is True
    # the extra options file adds what the worker does not set (and may repeat it)
    assert kwargs["max_batch_size"] == 64
    assert kwargs["enable_chunked_prefill"] is True


@pytest.mark.parametrize(
    ("option", "value", "setting"),
    [
        ("max_batch_size", 2, "WORKER_MAX_BATCH"),
        ("tensor_parallel_size", 2, "WORKER_TENSOR_PARALLEL_SIZE"),
        ("max_num_tokens", 512, "WORKER_MAX_NUM_TOKENS"),
    ],
)
def test_llm_api_extra_option_contradicting_a_setting_is_refused(
    gpu: FakeGpu, tmp_path: Path, option: str, value: int, setting: str
) -> None:
    """An engine batch smaller than WORKER_MAX_BATCH would queue requests the worker
    counts as running (and a queued abort is silent in 1.2): refused, naming both."""
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({option: value}))
    settings = trtllm_settings(
        tmp_path, "trtllm", llm_extra_options=extra, max_num_tokens=4096, max_batch=4
    )
    with pytest.raises(ConfigError) as caught:
        create_trtllm(settings)
    assert f"WORKER_LLM_EXTRA_OPTIONS: it sets {option}: {value}" in str(caught.value)
    assert setting in str(caught.value)


def test_llm_api_capacity_and_limits_are_the_built_llms(gpu: FakeGpu, tmp_path: Path) -> None:
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"max_seq_len": 1500}))
    settings = trtllm_settings(tmp_path, "trtllm", llm_extra_options=extra, max_batch=8)
    engine = create_trtllm(settings)
    try:
        assert engine.capacity == 8
        assert engine.limits.max_seq_len == 1500
        assert engine.limits.max_num_tokens == 8192  # TorchLlmArgs' default
    finally:
        engine.shutdown()


def test_llm_api_bad_extra_options_is_one_line(gpu: FakeGpu, tmp_path: Path) -> None:
    extra = tmp_path / "extra.json"
    extra.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"^invalid setting WORKER_LLM_EXTRA_OPTIONS:"):
        create_trtllm(trtllm_settings(tmp_path, "trtllm", llm_extra_options=extra))


# -- Executor ------------------------------------------------------------------------------


@pytest.mark.release("1.2.1")  # the C++ Executor: 1.2 and earlier
def test_executor_request(gpu: FakeGpu, tmp_path: Path) -> None:
    deadline = time.time() + 30
    with running(trtllm_settings(tmp_path, "trtllm-executor")) as engine:
        drive(engine, [full_request(deadline=deadline)])
    sent = gpu.requests[-1]
    config = sent.sampling_config
    assert sent.streaming is True
    assert (sent.end_id, sent.pad_id) == (2, 2)
    assert sent.stop_words == [[9]]
    assert sent.client_id == 1
    assert sent.output_config.return_log_probs is True
    assert (config.temperature, config.top_k, config.top_p) == (0.7, 40, 0.9)
    assert (config.min_tokens, config.seed, config.repetition_penalty) == (3, 1234, 1.1)
    assert (config.frequency_penalty, config.presence_penalty) == (0.5, -0.5)
    assert isinstance(sent.allotted_time_ms, timedelta)
    assert timedelta(seconds=25) < sent.allotted_time_ms <= timedelta(seconds=30)


@pytest.mark.release("1.2.1")  # the C++ Executor: 1.2 and earlier
def test_executor_greedy_and_ignore_eos(gpu: FakeGpu, tmp_path: Path) -> None:
    greedy = Sampling(do_sample=False, temperature=0.7)
    with running(trtllm_settings(tmp_path, "trtllm-executor")) as engine:
        drive(engine, [full_request(1, sampling=greedy, ignore_eos=True, eos_ids=frozenset())])
    sent = gpu.requests[-1]
    assert (sent.sampling_config.top_k, sent.sampling_config.temperature) == (1, None)
    assert sent.sampling_config.seed is not None
    assert sent.end_id == -1
    assert sent.stop_words is None


@pytest.mark.release("1.2.1")  # the C++ Executor: 1.2 and earlier
@pytest.mark.parametrize(
    ("policy", "expected"),
    [("guaranteed_no_evict", "GUARANTEED_NO_EVICT"), ("max_utilization", "MAX_UTILIZATION")],
)
def test_executor_config_from_settings(
    gpu: FakeGpu, tmp_path: Path, policy: str, expected: str
) -> None:
    settings = trtllm_settings(
        tmp_path,
        "trtllm-executor",
        scheduler_policy=policy,
        kv_cache_free_gpu_memory_fraction=0.6,
        kv_cache_block_reuse=False,
        max_num_tokens=2048,
        max_batch=16,
    )
    create_trtllm(settings).shutdown()
    config = gpu.executor_configs[-1]
    assert config.max_beam_width == 1
    assert config.scheduler_config.capacity_scheduler_policy.name == expected
    assert config.kv_cache_config.free_gpu_memory_fraction == 0.6
    assert config.kv_cache_config.enable_block_reuse is False
    assert (config.max_batch_size, config.max_num_tokens) == (16, 2048)
    assert config.parallel_config is None  # one rank: leader mode in this process


@pytest.mark.release("1.2.1")  # the C++ Executor: 1.2 and earlier
def test_executor_several_ranks_use_orchestrator_mode(gpu: FakeGpu, tmp_path: Path) -> None:
    worker_binary = tmp_path / "executorWorker"
    settings = trtllm_settings(
        tmp_path, "trtllm-executor", world_size=2, executor_worker_path=worker_binary
    )
    gpu.device_count = 2
    create_trtllm(settings).shutdown()
    parallel = gpu.executor_configs[-1].parallel_config
    assert parallel.communication_mode.name == "ORCHESTRATOR"
    assert parallel.orchestrator_config.is_orchestrator is True
    assert parallel.orchestrator_config.worker_executable_path == str(worker_binary)


@pytest.mark.release("1.2.1")  # the C++ Executor: 1.2 and earlier
def test_executor_unreadable_engine_dir_is_one_line(gpu: FakeGpu, tmp_path: Path) -> None:
    settings = trtllm_settings(tmp_path, "trtllm-executor")
    assert settings.engine_dir is not None
    (settings.engine_dir / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"^invalid setting WORKER_ENGINE_DIR: cannot read"):
        create_trtllm(settings)


# -- without TensorRT-LLM ------------------------------------------------------------------


@pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_llm") is not None, reason="tensorrt_llm is installed"
)
@pytest.mark.parametrize("engine", ["trtllm", "trtllm-executor"])
def test_choosing_tensorrt_llm_where_it_is_absent_says_what_to_install(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # forget adapters an earlier test imported against the double
    for name in ("trtllm", "trtllm_executor"):
        monkeypatch.delitem(sys.modules, f"trtllm_worker.engine.{name}", raising=False)
        monkeypatch.delattr(trtllm_worker.engine, name, raising=False)
    settings = trtllm_settings(tmp_path, engine)
    with pytest.raises(ConfigError) as caught:
        engine_factory(settings, load_tokenizer(None, None))
    message = str(caught.value)
    assert message.startswith("invalid setting WORKER_ENGINE:")
    assert "tensorrt_llm" in message
    assert "trtllm" in message
    assert "\n" not in message


# -- stop token ids and guided decoding ------------------------------------------------------

JSON_GUIDE = Guide("json", '{"type":"object"}')


def test_llm_api_end_id_and_stop_token_ids(gpu: FakeGpu, tmp_path: Path) -> None:
    """The tokenizer's EOS is the end id; the model's other EOS ids and the job's stop ids
    are `stop_token_ids`, and stay so with ignore_eos (end id -1 then)."""
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        drive(engine, [full_request(1, stop_token_ids=frozenset({5, 9}))])
        drive(
            engine,
            [full_request(2, ignore_eos=True, eos_ids=frozenset(), stop_token_ids=frozenset({5}))],
        )
    kept, ignoring = gpu.sampling_params[-2:]
    assert (kept.end_id, kept.stop_token_ids) == (2, [9, 5])
    assert (ignoring.end_id, ignoring.stop_token_ids) == (-1, [5])


def test_llm_api_guided_decoding(gpu: FakeGpu, tmp_path: Path) -> None:
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        drive(
            engine,
            [full_request(1, guide=JSON_GUIDE), full_request(2, guide=Guide("regex", "[a-z]+"))],
        )
    guides = [p.guided_decoding for p in gpu.sampling_params[-2:]]
    pairs = sorted((g.json or "", g.regex or "") for g in guides if g is not None)
    assert pairs == [("", "[a-z]+"), ('{"type":"object"}', "")]
    assert gpu.llm_kwargs[-1]["guided_decoding_backend"] == "xgrammar"


@pytest.mark.parametrize("backend", ["llguidance", "none"])
def test_llm_api_guided_decoding_backend_setting(
    gpu: FakeGpu, tmp_path: Path, backend: str
) -> None:
    with running(trtllm_settings(tmp_path, "trtllm", guided_decoding=backend)):
        pass
    kwargs = gpu.llm_kwargs[-1]
    assert kwargs.get("guided_decoding_backend") == (None if backend == "none" else backend)


@pytest.mark.release("1.2.1")  # the C++ Executor: 1.2 and earlier
def test_executor_stop_words_and_guided_decoding(gpu: FakeGpu, tmp_path: Path) -> None:
    with running(trtllm_settings(tmp_path, "trtllm-executor")) as engine:
        drive(engine, [full_request(1, stop_token_ids=frozenset({5}), guide=JSON_GUIDE)])
        drive(
            engine,
            [full_request(2, ignore_eos=True, eos_ids=frozenset(), stop_token_ids=frozenset({5}))],
        )
    guided, ignoring = gpu.requests[-2:]
    assert guided.stop_words == [[9], [5]]
    params = guided.guided_decoding_params
    assert params.guide_type.name == "JSON_SCHEMA"  # (the double is reloaded per test)
    assert params.guide == '{"type":"object"}'
    assert (ignoring.end_id, ignoring.stop_words) == (-1, [[5]])
    config = gpu.executor_configs[-1].guided_decoding_config
    assert config.backend.name == "XGRAMMAR"
    vocab = load_tokenizer(None, None).tokenizer
    assert len(config.encoded_vocab) == vocab.get_vocab_size(with_added_tokens=True)
    assert config.encoded_vocab[97] == "a"  # tokens in id order
    assert json.loads(config.tokenizer_str)["model"]["type"] == "BPE"


@pytest.mark.release("1.2.1")  # the C++ Executor: 1.2 and earlier
def test_executor_refuses_llguidance_at_start(gpu: FakeGpu, tmp_path: Path) -> None:
    settings = trtllm_settings(tmp_path, "trtllm-executor", guided_decoding="llguidance")
    with pytest.raises(ConfigError, match=r"WORKER_GUIDED_DECODING.*trtllm-executor"):
        create_trtllm(settings)


@pytest.mark.release("1.2.1")  # the C++ Executor: 1.2 and earlier
def test_executor_without_guided_decoding_fails_a_guided_request(
    gpu: FakeGpu, tmp_path: Path
) -> None:
    """What the real Executor does (executorImpl.cpp): an error response, not a silent
    unconstrained output; the worker then ends the job with `engine_error`."""
    with running(trtllm_settings(tmp_path, "trtllm-executor", guided_decoding="none")) as engine:
        outputs = drive(engine, [full_request(1, guide=JSON_GUIDE)])[1]
    assert outputs[-1].error is not None
    assert "GuidedDecoder is not setup" in outputs[-1].error
