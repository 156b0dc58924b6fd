"""LoRA adapters: what `WORKER_LORA_DIR` holds, read at start (valid and broken
folders, stable ids), the job's `adapter` checked at intake, and the settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.lora_fixtures import write_adapter
from trtllm_worker.config import load_settings
from trtllm_worker.contract.errors import ConfigError, InvalidJob
from trtllm_worker.contract.job import JobLimits, parse_job
from trtllm_worker.engine.lora import Adapters, adapter_id, discover_adapters
from trtllm_worker.pipeline.intake import check_adapter

LIMITS = JobLimits(2048, 256)


def job(**fields: object) -> bytes:
    return json.dumps({"request_id": "r1", "inputs": "abc", **fields}).encode()


def test_adapters_are_the_subfolders_with_rank_modules_and_a_stable_id(tmp_path: Path) -> None:
    write_adapter(tmp_path, "sql", rank=16, target_modules=("q_proj", "k_proj", "v_proj"))
    write_adapter(tmp_path, "chat", rank=4, weights="adapter_model.bin", rank_pattern={"x": 32})
    (tmp_path / ".cache").mkdir()  # hidden: skipped
    (tmp_path / "README.md").write_text("not an adapter")  # a file: skipped
    adapters = discover_adapters(tmp_path)
    assert list(adapters) == ["chat", "sql"]
    assert adapters["sql"].rank == 16
    assert adapters["sql"].target_modules == ("attn_k", "attn_q", "attn_v")
    assert adapters["chat"].rank == 32  # the largest rank of its layers
    assert adapters.max_rank == 32
    assert adapters.target_modules == ["attn_k", "attn_q", "attn_v"]
    assert adapters["sql"].path == tmp_path / "sql"
    assert adapters["sql"].id == adapter_id("sql")


def test_an_adapters_id_depends_on_its_name_only(tmp_path: Path) -> None:
    """Same id after a restart and on another worker, whatever else the folder holds."""
    write_adapter(tmp_path / "one", "sql")
    write_adapter(tmp_path / "two", "aaa")
    write_adapter(tmp_path / "two", "sql")
    first = discover_adapters(tmp_path / "one")["sql"].id
    assert discover_adapters(tmp_path / "two")["sql"].id == first
    assert adapter_id("sql") == first
    assert 1 <= first < 2**31
    assert adapter_id("chat") != first


def test_regex_or_unknown_target_modules_enable_every_module(tmp_path: Path) -> None:
    write_adapter(tmp_path, "a", target_modules="all-linear")
    write_adapter(tmp_path, "b", target_modules=("q_proj", "lm_head"))
    adapters = discover_adapters(tmp_path)
    assert adapters["a"].target_modules is None
    assert adapters["b"].target_modules is None
    assert adapters.target_modules is None


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (lambda root: (root / "x").mkdir(), "no adapter_config.json"),
        (lambda root: write_adapter(root, "x", weights=None), "no weights"),
        (lambda root: write_adapter(root, "x", rank=0), "r (the rank) must be a positive"),
        (lambda root: write_adapter(root, "x", rank="8"), "r (the rank) must be a positive"),
        (lambda root: write_adapter(root, "x", peft_type="IA3"), "not LORA"),
        (lambda root: write_adapter(root, "x", target_modules=3), "target_modules"),
        (lambda root: write_adapter(root, "bad:name"), "not usable as a job's adapter"),
    ],
)
def test_a_folder_that_does_not_load_is_one_line_naming_it(
    tmp_path: Path, build: object, why: str
) -> None:
    write_adapter(tmp_path, "good")
    build(tmp_path)  # type: ignore[operator]
    with pytest.raises(ConfigError) as caught:
        discover_adapters(tmp_path)
    message = str(caught.value)
    assert message.startswith("invalid setting WORKER_LORA_DIR: adapter folder ")
    assert why in message
    assert "\n" not in message


def test_invalid_json_config_is_refused(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path, "x")
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"adapter folder .*x: adapter_config.json is not"):
        discover_adapters(tmp_path)


def test_no_setting_no_adapters_and_a_missing_folder_is_refused(tmp_path: Path) -> None:
    assert len(discover_adapters(None)) == 0
    with pytest.raises(ConfigError, match=r"WORKER_LORA_DIR: .* is not a folder"):
        discover_adapters(tmp_path / "missing")


def test_a_known_adapter_passes_intake_and_an_unknown_one_is_invalid_naming_adapter(
    tmp_path: Path,
) -> None:
    write_adapter(tmp_path, "sql")
    adapters = discover_adapters(tmp_path)
    known = parse_job(job(adapter="sql"), content_type=None, message_id=None, limits=LIMITS)
    assert check_adapter(known, adapters) == adapters["sql"]
    unknown = parse_job(
        job(adapter="chat", tenant="acme"), content_type=None, message_id=None, limits=LIMITS
    )
    with pytest.raises(InvalidJob) as caught:
        check_adapter(unknown, adapters)
    assert caught.value.message.startswith("adapter: unknown adapter 'chat'")
    assert "sql" in caught.value.message
    assert caught.value.tenant == "acme"  # its error entry still counts under the tenant
    with pytest.raises(InvalidJob, match=r"adapter: unknown adapter .sql..*unset"):
        check_adapter(known, Adapters())  # no WORKER_LORA_DIR: every adapter is unknown


def test_a_malformed_adapter_name_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidJob, match=r"^adapter: String should match pattern"):
        parse_job(job(adapter="a:b"), content_type=None, message_id=None, limits=LIMITS)


def test_lora_dir_with_the_executor_stops_the_worker_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(
            _env_file=None,
            engine="trtllm-executor",
            engine_dir=tmp_path,
            tokenizer=tmp_path / "tokenizer.json",
            lora_dir=tmp_path,
        )
    assert str(caught.value).startswith("invalid setting WORKER_LORA_DIR: ")
    assert "WORKER_ENGINE=trtllm" in str(caught.value)
