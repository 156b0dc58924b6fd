"""The LLM API adapter on both TensorRT-LLM lines the double imitates (1.2.1 and the 1.4
line), where they differ: how a request at fault is refused, which LLM arguments exist,
trace_headers, and the Executor adapter where there is no Executor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.doubles import FakeGpu
from tests.engines.conftest import create_trtllm, drive, install_double, trtllm_settings
from tests.engines.test_trtllm_mapping import full_request, running
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.engine.base import FinishReason

LINES = [pytest.param("1.2.1", id="1.2"), pytest.param("1.4.0rc1", id="1.4")]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("version", LINES)
def test_an_over_long_prompt_fails_only_that_request(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, version: str
) -> None:
    """1.2 refuses a prompt over max_num_tokens with ValueError, the 1.4 line with
    RequestError (a RuntimeError, like the errors of a dead engine): on both, that one
    request ends with an error and the engine serves the others."""
    install_double(monkeypatch, version)
    settings = trtllm_settings(tmp_path, "trtllm", max_num_tokens=16)
    with running(settings) as engine:
        too_long = full_request(1, prompt_ids=list(range(3, 40)))
        fine = [full_request(2), full_request(3)]
        outputs = drive(engine, [too_long, *fine])
    assert outputs[1][-1].error is not None
    assert "max_num_tokens (16)" in outputs[1][-1].error
    for request_id in (2, 3):
        assert outputs[request_id][-1].error is None
        assert outputs[request_id][-1].finish is not None


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ({"fail_fast_on_attention_window_too_large": True}, "fail_fast_on_attention_window"),
        ({"build_config": {"max_batch_size": 8}}, "build_config"),
        ({"kv_cache_config": {"onboard_blocks": False}}, "onboard_blocks"),
    ],
)
def test_an_extra_option_1_4_no_longer_has_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, option: dict[str, object], named: str
) -> None:
    """1.4 dropped these (llm_args.py @ 1f064c46); a file written for 1.2 gets one line
    naming the option and the installed line, not a traceback."""
    install_double(monkeypatch, "1.4.0rc1")
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps(option))
    with pytest.raises(ConfigError) as raised:
        create_trtllm(trtllm_settings(tmp_path, "trtllm", llm_extra_options=extra))
    message = str(raised.value)
    assert message.startswith("invalid setting WORKER_LLM_EXTRA_OPTIONS: TensorRT-LLM 1.4.0rc1")
    assert named in message
    assert "\n" not in message


def test_an_option_1_2_still_has_is_accepted_there(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gpu = install_double(monkeypatch, "1.2.1")
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"kv_cache_config": {"onboard_blocks": False}}))
    create_trtllm(trtllm_settings(tmp_path, "trtllm", llm_extra_options=extra)).shutdown()
    assert gpu.llm_kwargs[-1]["kv_cache_config"] == {"onboard_blocks": False}


@pytest.mark.parametrize("version", LINES)
def test_the_jobs_trace_context_reaches_the_engine_where_it_takes_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, version: str
) -> None:
    """1.4's generate_async takes trace_headers (llm.py @ 1f064c46); 1.2.1's has none."""
    gpu: FakeGpu = install_double(monkeypatch, version)
    context = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        outputs = drive(engine, [full_request(1, trace_headers=context), full_request(2)])
    assert all(outputs[i][-1].finish is not None for i in (1, 2))
    traced, untraced = gpu.submit_options
    if version.startswith("1.4"):
        assert traced["trace_headers"] == context
    else:
        assert "trace_headers" not in traced
    assert "trace_headers" not in untraced


def test_executor_adapter_stops_without_an_executor(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """PR #16369 removed the C++ Executor (1.3.0rc22 on): one line, and what to use."""
    install_double(monkeypatch, "1.4.0rc1")
    with pytest.raises(ConfigError) as raised:
        create_trtllm(trtllm_settings(tmp_path, "trtllm-executor"))
    message = str(raised.value)
    assert "has no C++ Executor" in message
    assert "WORKER_ENGINE=trtllm" in message
    assert "1.2 or earlier" in message
    assert "\n" not in message


def test_a_request_error_of_a_running_request_ends_only_it_on_1_4(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An error response sets the result done, then raises RequestError (1.4 as 1.2)."""
    gpu = install_double(monkeypatch, "1.4.0rc1")
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        poisoned = full_request(1, prompt_ids=[5, gpu.POISON_TOKEN])
        outputs = drive(engine, [poisoned, full_request(2)])
    assert outputs[1][-1].error is not None
    assert outputs[2][-1].finish in {FinishReason.LENGTH, FinishReason.EOS_TOKEN}


@pytest.mark.parametrize("engine", ["trtllm", "trtllm-executor"])
def test_a_release_older_than_supported_stops_the_start_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine: str
) -> None:
    """Both adapters check the installed release before loading anything (versions.py):
    an older line lacks what they call, so the worker names the supported range instead
    of failing later on a missing keyword."""
    gpu = install_double(monkeypatch, "1.1.0")
    with pytest.raises(ConfigError) as raised:
        create_trtllm(trtllm_settings(tmp_path, engine))
    message = str(raised.value)
    assert message.startswith("TensorRT-LLM 1.1.0 is too old")
    assert "tensorrt-llm>=1.2,<1.5" in message
    assert "\n" not in message
    assert gpu.llm_kwargs == []  # nothing was loaded


def test_a_newer_line_than_tested_starts_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    install_double(monkeypatch, "1.5.0rc0")
    with caplog.at_level("WARNING", logger="trtllm_worker.engine.versions"):
        create_trtllm(trtllm_settings(tmp_path, "trtllm")).shutdown()
    assert "TensorRT-LLM 1.5.0rc0 is newer than the lines the worker is tested on" in caplog.text
