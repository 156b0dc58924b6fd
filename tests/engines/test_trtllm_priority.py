"""A job's priority and tenant reach TensorRT-LLM: `priority` (p/9) where the installed
release takes it, the tenant as `cache_salt` (LLM API) or `cache_salt_id` (Executor), and
nothing where the job sets neither, so the engine's defaults apply."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.doubles import FakeGpu
from tests.engines.conftest import create_trtllm, drive, install_double, trtllm_settings
from tests.engines.test_trtllm_mapping import full_request, running

LOGGER = "trtllm_worker.engine.trtllm"


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    """The double as TensorRT-LLM 1.2.1 whatever TRTLLM_DOUBLE_RELEASE says: the tests
    here that use it are about 1.2 or about the C++ Executor (1.2 and earlier only)."""
    return install_double(monkeypatch, "1.2.1")


@pytest.fixture
def gpu_1_4(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    """The double as TensorRT-LLM 1.4: `generate_async(..., priority=0.5)`."""
    return install_double(monkeypatch, "1.4.0")


# -- LLM API -------------------------------------------------------------------------------


@pytest.mark.parametrize(("amqp_priority", "expected"), [(9, 1.0), (0, 0.0), (5, 5 / 9)])
def test_llm_api_passes_priority_and_tenant_on_1_4(
    gpu_1_4: FakeGpu, tmp_path: Path, amqp_priority: int, expected: float
) -> None:
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        outputs = drive(
            engine, [full_request(1, priority=amqp_priority / 9, cache_salt="tenant-a")]
        )[1]
    assert outputs[-1].error is None
    assert gpu_1_4.submit_options == [{"cache_salt": "tenant-a", "priority": expected}]


def test_llm_api_without_priority_or_tenant_leaves_the_defaults_on_1_4(
    gpu_1_4: FakeGpu, tmp_path: Path
) -> None:
    """Nothing passed: the engine's own default priority (0.5) and no salt."""
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        drive(engine, [full_request(1)])
    assert gpu_1_4.submit_options == [{"cache_salt": None, "priority": 0.5}]


def test_llm_api_on_1_2_passes_the_tenant_but_no_priority(gpu: FakeGpu, tmp_path: Path) -> None:
    """1.2's generate_async has no `priority`: passing one would be a TypeError, and the
    request would fail; the adapter leaves it out and the request runs."""
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        outputs = drive(engine, [full_request(1, priority=1.0, cache_salt="tenant-a")])[1]
    assert outputs[-1].error is None
    assert outputs[-1].finish is not None
    assert gpu.submit_options == [{"cache_salt": "tenant-a"}]


def test_llm_api_tenants_get_their_own_salt(gpu_1_4: FakeGpu, tmp_path: Path) -> None:
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        drive(
            engine,
            [
                full_request(1, cache_salt="tenant-a"),
                full_request(2, cache_salt="tenant-b"),
                full_request(3),
            ],
        )
    assert sorted(str(o["cache_salt"]) for o in gpu_1_4.submit_options) == [
        "None",
        "tenant-a",
        "tenant-b",
    ]


def test_llm_api_says_once_that_1_2_takes_no_priority(
    gpu: FakeGpu, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO, logger=LOGGER),
        running(trtllm_settings(tmp_path, "trtllm")) as engine,
    ):
        drive(engine, [full_request(1, priority=1.0), full_request(2, priority=0.0)])
    said = [r.getMessage() for r in caplog.records if "job priorities" in r.getMessage()]
    assert len(said) == 1
    assert "takes no priority" in said[0]


def test_llm_api_builds_the_llm_with_the_priority_queue_on_1_4(
    gpu_1_4: FakeGpu, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without it the engine's FCFS queue would ignore every priority the worker passes."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        create_trtllm(trtllm_settings(tmp_path, "trtllm")).shutdown()
    scheduler = gpu_1_4.llm_kwargs[-1]["scheduler_config"]
    assert scheduler.waiting_queue_policy.value == "priority"
    said = [r for r in caplog.records if "job priorities" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelno == logging.INFO
    assert "waiting-queue policy priority" in said[0].getMessage()


def test_llm_api_on_1_2_sets_no_scheduler_config(gpu: FakeGpu, tmp_path: Path) -> None:
    """1.2 takes no priority: its scheduler is left as the operator configured it."""
    create_trtllm(trtllm_settings(tmp_path, "trtllm")).shutdown()
    assert "scheduler_config" not in gpu.llm_kwargs[-1]


def test_llm_api_warns_that_fcfs_ignores_priorities(
    gpu_1_4: FakeGpu, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An extra-options file that sets its own scheduler_config keeps it, FCFS included."""
    extra = tmp_path / "llm.json"
    extra.write_text(json.dumps({"scheduler_config": {"waiting_queue_policy": "fcfs"}}))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        create_trtllm(trtllm_settings(tmp_path, "trtllm", llm_extra_options=extra)).shutdown()
    assert gpu_1_4.llm_kwargs[-1]["scheduler_config"] == {"waiting_queue_policy": "fcfs"}
    said = [r for r in caplog.records if "job priorities" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelno == logging.WARNING
    assert "waiting_queue_policy: priority" in said[0].getMessage()


def test_llm_api_says_priorities_are_used_with_the_priority_policy(
    gpu_1_4: FakeGpu, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The documented extra-options snippet turns the priority queue on."""
    extra = tmp_path / "llm.json"
    extra.write_text(json.dumps({"scheduler_config": {"waiting_queue_policy": "priority"}}))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        create_trtllm(trtllm_settings(tmp_path, "trtllm", llm_extra_options=extra)).shutdown()
    assert gpu_1_4.llm_kwargs[-1]["scheduler_config"] == {"waiting_queue_policy": "priority"}
    said = [r for r in caplog.records if "job priorities" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelno == logging.INFO
    assert "waiting-queue policy priority" in said[0].getMessage()


def test_llm_api_priority_out_of_range_fails_only_that_request(
    gpu_1_4: FakeGpu, tmp_path: Path
) -> None:
    """1.4 refuses a priority outside [0, 1] with ValueError: that request fails, the
    engine serves on (the pipeline never sends one; this guards the mapping)."""
    with running(trtllm_settings(tmp_path, "trtllm")) as engine:
        bad = drive(engine, [full_request(1, priority=10 / 9)])[1]
        good = drive(engine, [full_request(2, priority=1.0)])[2]
    assert bad[-1].error is not None
    assert "priority must be a float in [0.0, 1.0]" in bad[-1].error
    assert good[-1].error is None


# -- Executor ------------------------------------------------------------------------------


@pytest.mark.parametrize(("amqp_priority", "expected"), [(9, 1.0), (0, 0.0)])
def test_executor_request_priority_and_cache_salt_id(
    gpu: FakeGpu, tmp_path: Path, amqp_priority: int, expected: float
) -> None:
    from trtllm_worker.engine.trtllm_executor import cache_salt_id

    with running(trtllm_settings(tmp_path, "trtllm-executor")) as engine:
        drive(
            engine,
            [
                full_request(1, priority=amqp_priority / 9, cache_salt="tenant-a"),
                full_request(2, priority=amqp_priority / 9, cache_salt="tenant-b"),
            ],
        )
    first, second = gpu.requests[-2:]
    assert (first.priority, second.priority) == (expected, expected)
    assert first.cache_salt_id == cache_salt_id("tenant-a")
    assert second.cache_salt_id == cache_salt_id("tenant-b")
    assert first.cache_salt_id != second.cache_salt_id
    assert 0 <= first.cache_salt_id < 1 << 64


def test_executor_request_without_priority_or_tenant_keeps_the_defaults(
    gpu: FakeGpu, tmp_path: Path
) -> None:
    with running(trtllm_settings(tmp_path, "trtllm-executor")) as engine:
        drive(engine, [full_request(1)])
    sent = gpu.requests[-1]
    assert (sent.priority, sent.cache_salt_id) == (0.5, None)


def test_executor_cache_salt_id_is_stable_per_tenant(gpu: FakeGpu) -> None:
    """The same tenant gets the same id in every worker process, so its blocks stay
    reusable across workers and restarts (Python's salted `hash` would not do)."""
    from trtllm_worker.engine.trtllm_executor import cache_salt_id

    assert cache_salt_id("tenant-a") == 0x4FBA221BC5E31261  # blake2b-64 of the UTF-8, LE
