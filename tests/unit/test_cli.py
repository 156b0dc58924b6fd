"""The CLI's pure parts, and its exit codes for errors found before any connection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trtllm_worker import __version__
from trtllm_worker.app.cli import (
    UsageError,
    build_parser,
    dead_letter_line,
    main,
    parse_metadata,
    parse_params,
    parse_since,
    summary,
)
from trtllm_worker.client import DeadLetter, DoneEvent
from trtllm_worker.config import ENV_PREFIX
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.exits import ExitCode, StartupError, Unavailable
from trtllm_worker.engine import EngineStartTimeout


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No WORKER_* variable from the outside, and a working directory without `.env`;
    services that do not answer, so nothing here can reach a real one."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORKER_AMQP_URL", "amqp://guest:guest@127.0.0.1:1/")
    monkeypatch.setenv("WORKER_REDIS_URL", "redis://127.0.0.1:1/0")


def test_params_are_json_or_bare_words() -> None:
    assert parse_params(
        ["max_new_tokens=32", "temperature=0.5", 'stop=["\\n", "END"]', "do_sample=true"]
    ) == {"max_new_tokens": 32, "temperature": 0.5, "stop": ["\n", "END"], "do_sample": True}
    assert parse_params(["stop=END", "x=a=b"]) == {"stop": "END", "x": "a=b"}
    assert parse_params([]) == {}


@pytest.mark.parametrize("pair", ["max_new_tokens", "=3", ""])
def test_a_param_needs_a_name_and_a_value(pair: str) -> None:
    with pytest.raises(UsageError, match="expected NAME=VALUE"):
        parse_params([pair])


def test_metadata_is_a_json_object() -> None:
    assert parse_metadata(None) is None
    assert parse_metadata('{"user": "u1", "n": 2}') == {"user": "u1", "n": 2}
    with pytest.raises(UsageError, match="not JSON"):
        parse_metadata("{user")
    with pytest.raises(UsageError, match="JSON object"):
        parse_metadata("[1, 2]")


def test_serve_is_the_default_command() -> None:
    parser = build_parser()
    assert parser.parse_args([]).command is None
    assert parser.parse_args(["serve"]).command == "serve"
    args = parser.parse_args(["submit", "hi", "-p", "a=1", "--param", "b=2", "-f"])
    assert (args.command, args.prompt, args.param, args.follow) == (
        "submit",
        "hi",
        ["a=1", "b=2"],
        True,
    )
    args = parser.parse_args(["dead-letters", "--request-id", "a", "b", "--request-id", "c"])
    assert (args.requeue, args.request_ids) == (False, ["a", "b", "c"])
    assert parser.parse_args(["dead-letters"]).request_ids is None


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"trtllm-worker {__version__}"


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == ExitCode.CONFIG
    assert "invalid choice" in capsys.readouterr().err


def test_summary_line() -> None:
    done = DoneEvent(
        entry_id="0-9",
        finish_reason="length",
        generated_tokens=8,
        input_tokens=3,
        generated_text="abcabcab",
    )
    assert summary("r1", done, None, None, 5.0) == "r1: length, 8 tokens (3 in the prompt)"
    line = summary("r1", done, 10.0, 10.025, 12.0)
    assert line == (
        "r1: length, 8 tokens (3 in the prompt), first token after 25 ms, 2.00 s, 4.0 tokens/s"
    )
    assert "first token after -" in summary("r1", done, 10.0, None, 12.0)


def test_dead_letter_line() -> None:
    letter = DeadLetter(
        request_id="r1", code="input_too_long", message="prompt is\n9 tokens", body=b"{}"
    )
    assert dead_letter_line(letter) == "r1 input_too_long: prompt is 9 tokens"
    anonymous = DeadLetter(request_id=None, code="invalid_request", message="", body=b"x")
    assert dead_letter_line(anonymous) == "- invalid_request: (no reason given)"


def test_invalid_job_exits_2_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", "hi", "-p", "top_p=1.5"]) == ExitCode.CONFIG
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "trtllm-worker: invalid job: parameters.top_p: Input should be less than or equal to 1\n"
    )


@pytest.mark.parametrize("since", ["2025-13-01", "yesterday", "20250102", "2025-W01-1", "2025-1-2"])
def test_a_bad_since_exits_2_before_connecting(
    since: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["usage", "--since", since]) == ExitCode.CONFIG
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"trtllm-worker: --since {since!r}: expected a day as YYYY-MM-DD\n")


def test_since_is_a_day() -> None:
    assert parse_since("2025-02-28") is not None
    assert str(parse_since("2025-02-28")) == "2025-02-28"
    assert parse_since(None) is None
    with pytest.raises(UsageError):
        parse_since("2025-02-29")


def test_bad_setting_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORKER_QUEUE_TYPE", "lazy")
    assert main(["check"]) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert err.startswith("trtllm-worker: invalid setting WORKER_QUEUE_TYPE")
    assert err.count("\n") == 1


def test_check_without_services_reports_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check"]) == ExitCode.FAILED
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out if line.startswith("problem")] == [
        "problem RabbitMQ",
        "problem Redis",
    ]
    assert "ok engine echo: CPU, no model, 64 requests at once" in out


def test_check_names_files_that_do_not_exist(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    present = tmp_path / "ca.pem"
    present.write_text("")
    monkeypatch.setenv("WORKER_REDIS_CA_FILE", str(present))
    monkeypatch.setenv("WORKER_LLM_EXTRA_OPTIONS", str(tmp_path / "extra.yaml"))
    assert main(["check"]) == ExitCode.FAILED
    found = [line for line in capsys.readouterr().out.splitlines() if "WORKER_" in line]
    assert found == [f"problem WORKER_LLM_EXTRA_OPTIONS: {tmp_path / 'extra.yaml'} does not exist"]


def test_help_lists_every_exit_code_once() -> None:
    epilog = build_parser().epilog or ""
    assert epilog.startswith("exit codes: 0 ok; 1 job failed")
    listed = [int(part.split()[0]) for part in epilog.removeprefix("exit codes: ").split("; ")]
    assert listed == [code.value for code in ExitCode]


def test_start_up_errors_carry_their_exit_code() -> None:
    assert ConfigError("x").exit_code == ExitCode.CONFIG
    assert Unavailable("x").exit_code == ExitCode.UNAVAILABLE
    assert (ExitCode.CONFIG.value, ExitCode.UNAVAILABLE.value) == (2, 69)
    assert EngineStartTimeout("x").exit_code == ExitCode.UNAVAILABLE
    assert not issubclass(EngineStartTimeout, ConnectionError)
    assert issubclass(ConfigError, StartupError)


@pytest.mark.parametrize("priority", ["10", "-1", "high"])
def test_a_priority_outside_0_to_9_exits_2(
    priority: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["submit", "hi", "--priority", priority])
    assert exited.value.code == 2
    assert "--priority" in capsys.readouterr().err
