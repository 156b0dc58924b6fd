"""LoRA through the LLM API: the LLM is built with a `lora_config` sized from the
adapters of `WORKER_LORA_DIR` (without one TensorRT-LLM ignores a request's adapter
silently), and a job's adapter reaches `generate_async` as a `LoRARequest` with the
adapter's stable id and folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.doubles import FakeGpu
from tests.engines.conftest import create_trtllm, drive, install_double, trtllm_settings
from tests.engines.test_trtllm_mapping import full_request, running
from tests.lora_fixtures import write_adapter
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.engine.lora import adapter_id, discover_adapters


@pytest.fixture
def loras(tmp_path: Path) -> Path:
    root = tmp_path / "loras"
    write_adapter(root, "sql", rank=16, target_modules=("q_proj", "v_proj"))
    write_adapter(root, "chat", rank=8, target_modules=("q_proj", "o_proj"))
    return root


def test_the_llm_is_built_with_lora_sized_from_the_adapters(
    gpu: FakeGpu, tmp_path: Path, loras: Path
) -> None:
    with running(trtllm_settings(tmp_path, "trtllm", lora_dir=loras, max_batch=1)):
        pass
    config = gpu.llm_kwargs[-1]["lora_config"]
    assert config.max_lora_rank == 16
    assert config.lora_target_modules == ["attn_dense", "attn_q", "attn_v"]
    assert config.max_loras == 1  # no more on the GPU than requests in flight
    assert config.max_cpu_loras == 2  # every adapter cached in memory
    assert config.lora_dir == []  # loaded on first use, not all at start


def test_a_jobs_adapter_reaches_the_engine_with_its_stable_id_and_folder(
    gpu: FakeGpu, tmp_path: Path, loras: Path
) -> None:
    adapters = discover_adapters(loras)
    with running(trtllm_settings(tmp_path, "trtllm", lora_dir=loras)) as engine:
        outputs = drive(engine, [full_request(1, adapter=adapters["sql"]), full_request(2)])
    assert all(out[-1].error is None and out[-1].finish is not None for out in outputs.values())
    with_adapter = [o for o in gpu.submit_options if "lora_request" in o]
    assert len(with_adapter) == 1
    request = with_adapter[0]["lora_request"]
    assert (request.lora_name, request.lora_int_id) == ("sql", adapter_id("sql"))
    assert request.lora_path == str(loras / "sql")
    assert not any("lora_request_ignored" in o for o in gpu.submit_options)


def test_without_the_setting_the_llm_has_no_lora_config(gpu: FakeGpu, tmp_path: Path) -> None:
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        drive(engine, [full_request(1)])
    assert "lora_config" not in gpu.llm_kwargs[-1]
    # no adapter reached the engine (1.4 also records its default priority)
    assert len(gpu.submit_options) == 1
    assert not {"lora_request", "lora_request_ignored"} & set(gpu.submit_options[0])


def test_the_double_ignores_an_adapter_without_lora_config_as_tensorrt_llm_does(
    gpu: FakeGpu, tmp_path: Path, loras: Path
) -> None:
    """Why the worker builds the LLM with LoRA: without it the adapter is dropped."""
    adapters = discover_adapters(loras)
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        outputs = drive(engine, [full_request(1, adapter=adapters["sql"])])[1]
    assert outputs[-1].error is None  # no error: silently the base model
    assert "lora_request_ignored" in gpu.submit_options[0]
    assert "lora_request" not in gpu.submit_options[0]


def test_on_1_4_the_adapter_reaches_the_engine_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, loras: Path
) -> None:
    gpu_1_4 = install_double(monkeypatch, "1.4.0")
    adapters = discover_adapters(loras)
    with running(trtllm_settings(tmp_path, "trtllm", lora_dir=loras)) as engine:
        drive(engine, [full_request(1, adapter=adapters["chat"])])
    assert gpu_1_4.submit_options[0]["lora_request"].lora_int_id == adapter_id("chat")


def test_extra_options_lora_config_is_used_unless_it_cannot_hold_the_ranks(
    gpu: FakeGpu, tmp_path: Path, loras: Path
) -> None:
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"lora_config": {"max_lora_rank": 32, "max_loras": 1}}))
    with running(trtllm_settings(tmp_path, "trtllm", lora_dir=loras, llm_extra_options=extra)):
        pass
    assert gpu.llm_kwargs[-1]["lora_config"] == {"max_lora_rank": 32, "max_loras": 1}
    extra.write_text(json.dumps({"lora_config": {"max_lora_rank": 8}}))
    with pytest.raises(ConfigError, match="max_lora_rank 8, below the rank 16"):
        create_trtllm(trtllm_settings(tmp_path, "trtllm", lora_dir=loras, llm_extra_options=extra))
