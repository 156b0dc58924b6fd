"""The `trtllm-worker` command's exit codes, one enum (sysexits.h where one fits), and
the errors that stop a command or the worker before it runs, each carrying its code:
the CLI prints the one-line message and exits with `exit_code`."""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar


class ExitCode(IntEnum):
    """What the command's exit status means; `--help` lists them from `MEANINGS`."""

    OK = 0
    FAILED = 1
    """The job ended with an error, `check` found a problem, a dead letter is not there."""
    CONFIG = 2
    """Bad settings, an invalid job or bad arguments (argparse's own code for usage)."""
    ENGINE_DIED = 3
    """`serve`: the engine died; running jobs were handed back."""
    UNAVAILABLE = 69
    """EX_UNAVAILABLE: RabbitMQ, Redis (or, for `serve`, the engine) unavailable, or the
    job queue not declared yet."""
    TASK_DIED = 70
    """EX_SOFTWARE: `serve`: a background task of the worker died."""
    TIMEOUT = 75
    """EX_TEMPFAIL: `--timeout` passed before the job ended."""
    INTERRUPTED = 130
    """Interrupted (SIGINT) in a client command."""


MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "ok",
    ExitCode.FAILED: "job failed, check found problems, dead letter not found",
    ExitCode.CONFIG: "bad settings, invalid job or arguments",
    ExitCode.ENGINE_DIED: "engine died (serve)",
    ExitCode.UNAVAILABLE: "RabbitMQ or Redis unavailable, or the queue not declared",
    ExitCode.TASK_DIED: "a worker task died (serve)",
    ExitCode.TIMEOUT: "--timeout passed",
    ExitCode.INTERRUPTED: "interrupted",
}
"""Each code's meaning in a few words, for `--help`."""


def exit_codes_help() -> str:
    """`exit codes: 0 ok; 1 …; …`: the epilog of `trtllm-worker --help`."""
    return "exit codes: " + "; ".join(f"{code.value} {MEANINGS[code]}" for code in ExitCode)


class StartupError(Exception):
    """What stops the command or the worker before it runs; the message is one line, and
    the class says the exit code. (Errors of a job are `WorkerError`s: they decide what
    becomes of its message, never the process.)"""

    exit_code: ClassVar[ExitCode] = ExitCode.CONFIG


class Unavailable(StartupError):
    """Something the worker needs does not answer, or refuses it: RabbitMQ, Redis, the
    engine (exit 69)."""

    exit_code = ExitCode.UNAVAILABLE
