"""The `trtllm-worker` command (also `python -m trtllm_worker`). `serve` is the default.

Exit codes: `ExitCode` (trtllm_worker/contract/exits.py), listed by `--help`. An error a
user can act on is one line on stderr and its code, never a traceback."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trtllm_worker import __version__
from trtllm_worker.app.batch_cli import add_batch_parser
from trtllm_worker.config import Settings, load_settings
from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.exits import ExitCode, StartupError, exit_codes_help
from trtllm_worker.ops.log import setup_logging

if TYPE_CHECKING:
    from trtllm_worker.client import Client, DeadLetter, DoneEvent
    from trtllm_worker.client.sdk import JobOptions

PROG = "trtllm-worker"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve TensorRT-LLM from a RabbitMQ job queue into Redis streams, and "
        "submit, follow, cancel and inspect jobs. Settings come from WORKER_* variables "
        "(and .env). Without a command: serve.",
        epilog=exit_codes_help(),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("serve", help="run the worker (the default)")
    commands.add_parser(
        "gateway",
        help="serve OpenAI's API (chat, completions, files, batches) in front of the queue "
        "on WORKER_GATEWAY_PORT",
    )

    submit = commands.add_parser(
        "submit",
        help="publish a job and print its request id; with --follow, print its tokens",
    )
    submit.add_argument(
        "prompt",
        nargs="?",
        help="the prompt (the job's inputs); - reads it from stdin; or give --messages",
    )
    submit.add_argument(
        "--messages",
        metavar="FILE",
        help="a conversation instead of a prompt: a JSON file of [{role, content}, ...] "
        "(- reads it from stdin), rendered with the model's chat template",
    )
    submit.add_argument(
        "--tools", metavar="FILE", help="with --messages: a JSON file of tool definitions"
    )
    grammar = submit.add_mutually_exclusive_group()
    grammar.add_argument(
        "--grammar",
        metavar="SCHEMA_FILE",
        help="constrain the output to the JSON Schema in this file (structured output)",
    )
    grammar.add_argument(
        "--regex", metavar="PATTERN", help="constrain the output to this regular expression"
    )
    submit.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        action="append",
        type=int,
        metavar="ID",
        help="a token id that ends the job (repeatable)",
    )
    submit.add_argument(
        "--param",
        "-p",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a job parameter, VALUE as JSON, a bare word as a string "
        "(e.g. -p max_new_tokens=32 -p stop='[\"\\n\"]')",
    )
    submit.add_argument("--request-id", help="default: a fresh random id")
    submit.add_argument("--metadata", metavar="JSON", help="a JSON object echoed in `done`")
    submit.add_argument("--tenant", help="whom the job is for: its usage is counted under it")
    submit.add_argument(
        "--priority",
        type=int,
        choices=range(10),
        metavar="0-9",
        help="the message's AMQP priority: 5 or more (WORKER_PREEMPT_PRIORITY) pauses batch "
        "work for it",
    )
    submit.add_argument(
        "--deadline", metavar="RFC3339", help="do not start the job after this time"
    )
    submit.add_argument(
        "--follow", "-f", action="store_true", help="print the tokens as they arrive"
    )
    _timeout_option(submit)

    tail = commands.add_parser("tail", help="print a request's stream to its end")
    tail.add_argument("request_id")
    tail.add_argument(
        "--from-id",
        default="0",
        metavar="ENTRY_ID",
        help="start after this entry (default 0); a stream that ended at or before it "
        "prints nothing and exits 0 at once",
    )
    _timeout_option(tail)

    cancel = commands.add_parser("cancel", help="cancel a request")
    cancel.add_argument("request_id")

    dead = commands.add_parser(
        "dead-letters",
        help="list the dead-letter queue (one line each: request id, code: reason); "
        "--requeue sends them back to the job queue",
    )
    dead.add_argument(
        "--requeue", action="store_true", help="republish them to the job queue (after a fix)"
    )
    dead.add_argument(
        "--request-id",
        dest="request_ids",
        action="extend",
        nargs="+",
        default=None,
        metavar="ID",
        help="only these requests",
    )
    commands.add_parser(
        "migrate-queue",
        help="declare the job queue again as this worker declares it (priorities, "
        "WORKER_QUEUE_TYPE), keeping its jobs; stop the workers first",
    )
    commands.add_parser(
        "check",
        help="check the broker, Redis, the queues, the tokenizer and the engine settings; "
        "one line each, non-zero exit on a problem",
    )
    usage = commands.add_parser(
        "usage",
        help="print jobs, input tokens and generated tokens per tenant and UTC day, as "
        'JSON lines {"tenant", "day", "jobs", "input_tokens", "generated_tokens"} sorted '
        "by day then tenant (jobs without a tenant: -); jobs with a LoRA adapter also "
        'under "adapters": {name: {"jobs", "input_tokens", "generated_tokens"}}',
    )
    usage.add_argument("--tenant", metavar="T", help="only this tenant")
    usage.add_argument("--since", metavar="YYYY-MM-DD", help="only from this UTC day on")
    add_batch_parser(commands)
    acl = commands.add_parser(
        "acl",
        help="print the Redis ACL rules and RabbitMQ permissions each role needs for these "
        "settings (PASSWORD: each user's password)",
    )
    acl.add_argument("--json", action="store_true", help="as JSON, for provisioning tools")
    return parser


def _timeout_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help=f"give up (exit {ExitCode.TIMEOUT.value}) if the job has not ended by then",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings()
    except ConfigError as exc:
        _error(str(exc))
        return ExitCode.CONFIG
    if args.command in (None, "serve"):
        return _serve(settings)
    if args.command == "acl":
        return _acl(settings, as_json=args.json)
    if args.command == "gateway":
        return _gateway(settings)
    return run_client_command(args, settings)


def _acl(settings: Settings, *, as_json: bool) -> int:
    from trtllm_worker.connect import grants

    try:
        text = grants.as_json(settings) + "\n" if as_json else grants.as_text(settings)
    except ConfigError as exc:
        _error(str(exc))
        return ExitCode.CONFIG
    sys.stdout.write(text)
    return ExitCode.OK


def _gateway(settings: Settings) -> int:
    try:
        from trtllm_worker.gateway.server import serve
    except ImportError as exc:
        _error(f"the gateway needs the gateway extra (pip install 'trtllm-worker[gateway]'): {exc}")
        return ExitCode.CONFIG
    from trtllm_worker.app.service import event_loop_factory

    setup_logging(settings.log_level, settings.log_format)
    try:
        return serve(settings, event_loop_factory(settings.event_loop))
    except ConfigError as exc:
        _error(str(exc))
        return ExitCode.CONFIG
    except KeyboardInterrupt:
        return ExitCode.OK


def _serve(settings: Settings) -> int:
    from trtllm_worker.app.service import event_loop_factory, serve

    setup_logging(settings.log_level, settings.log_format)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(settings.event_loop)) as runner:
            return runner.run(serve(settings))
    except StartupError as exc:  # bad settings (2), RabbitMQ/Redis/engine unavailable (69)
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return ExitCode.OK


def run_client_command(args: argparse.Namespace, settings: Settings) -> int:
    """Run a client command; every error a user can act on becomes one line on stderr
    and an exit code, never a traceback."""
    import aiormq
    from redis.exceptions import RedisError

    from trtllm_worker.client import ClientError, InvalidJobError, ServiceUnavailable
    from trtllm_worker.client.batch_files import InvalidBatch

    if settings.log_level == "DEBUG":
        setup_logging(settings.log_level, settings.log_format)
    else:  # the libraries' own logs would repeat, as tracebacks, what the one line says
        for name in ("aio_pika", "aiormq"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return asyncio.run(_client_command(args, settings))
    except (ConfigError, InvalidJobError, UsageError, InvalidBatch) as exc:
        _error(str(exc))
        return ExitCode.CONFIG
    except ServiceUnavailable as exc:
        _error(str(exc))
        return ExitCode.UNAVAILABLE
    except ClientError as exc:
        _error(str(exc))
        return ExitCode.FAILED
    except (RedisError, aiormq.exceptions.AMQPError, OSError) as exc:
        if isinstance(exc, BrokenPipeError):
            return _broken_pipe()
        _error(f"{type(exc).__name__}: {' '.join(str(exc).split())}")
        return ExitCode.UNAVAILABLE
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


class UsageError(ValueError):
    """A command-line value that cannot be used (exit 2)."""


def _error(message: str) -> None:
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr, flush=True)


def _note(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


def _broken_pipe() -> int:
    """stdout was closed (`| head`): stop quietly, without Python's flush error at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return ExitCode.FAILED


def parse_params(pairs: Sequence[str]) -> dict[str, Any]:
    """`name=value` pairs, each value JSON (a bare word is taken as a string)."""
    params: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise UsageError(f"--param {pair!r}: expected NAME=VALUE")
        try:
            params[name] = json.loads(raw)
        except json.JSONDecodeError:
            params[name] = raw
    return params


def trace_context(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`TRACEPARENT` and `TRACESTATE` (OpenTelemetry's environment carrier): a caller's
    span becomes the job's parent, as a traced script or CI job would have it."""
    from trtllm_worker.client.sdk import TRACEPARENT

    traceparent = environ.get("TRACEPARENT", "").strip()
    if not traceparent:
        return None
    if not TRACEPARENT.match(traceparent.lower()):
        raise UsageError(f"TRACEPARENT: not a W3C traceparent: {traceparent!r}")
    context = {"traceparent": traceparent}
    if environ.get("TRACESTATE", "").strip():
        context["tracestate"] = environ["TRACESTATE"].strip()
    return context


def submit_options(args: argparse.Namespace) -> JobOptions:
    """The job fields of `submit`'s options (a usage error for what cannot be read)."""
    if (args.prompt is None) == (args.messages is None):
        raise UsageError("give either a prompt or --messages")
    options: JobOptions = {}
    if args.request_id is not None:
        options["request_id"] = args.request_id
    if args.deadline is not None:
        options["deadline"] = args.deadline
    if args.tenant is not None:
        options["tenant"] = args.tenant
    metadata = parse_metadata(args.metadata)
    if metadata is not None:
        options["metadata"] = metadata
    if args.messages is not None:
        options["messages"] = read_json_list(args.messages, "--messages")
    if args.tools is not None:
        if args.messages is None:
            raise UsageError("--tools goes with --messages")
        options["tools"] = read_json_list(args.tools, "--tools")
    return options


def submit_parameters(args: argparse.Namespace) -> dict[str, Any]:
    params = parse_params(args.param)
    if args.grammar is not None:
        schema = read_json(args.grammar, "--grammar")
        if not isinstance(schema, dict):
            raise UsageError("--grammar: the file must hold a JSON Schema object")
        params["grammar"] = {"type": "json", "value": schema}
    elif args.regex is not None:
        params["grammar"] = {"type": "regex", "value": args.regex}
    if args.stop_token_ids:
        params["stop_token_ids"] = list(args.stop_token_ids)
    return params


def read_json(source: str, option: str) -> Any:
    """A JSON document from a file, or from stdin for `-`."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{option}: cannot read {source}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{option}: {source} is not JSON ({exc})") from None


def read_json_list(source: str, option: str) -> list[dict[str, Any]]:
    value = read_json(source, option)
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise UsageError(f"{option}: {source} must hold a JSON list of objects")
    return value


def parse_metadata(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--metadata: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UsageError("--metadata: must be a JSON object")
    return value


async def _client_command(args: argparse.Namespace, settings: Settings) -> int:
    if args.command == "check":
        from trtllm_worker.app.check import check

        return ExitCode.FAILED if await check(settings) else ExitCode.OK
    from trtllm_worker.client import Client

    async with Client(settings) as client:
        if args.command == "submit":
            return await _submit(client, args)
        if args.command == "tail":
            return await _follow(client, args.request_id, args.from_id, args.timeout, None)
        if args.command == "cancel":
            await client.cancel(args.request_id)
            _note(f"cancel sent for {args.request_id}")
            return ExitCode.OK
        if args.command == "dead-letters":
            return await _dead_letters(client, args.requeue, args.request_ids)
        if args.command == "migrate-queue":
            return await _migrate_queue(client)
        if args.command == "usage":
            return await _usage(client, args.tenant, parse_since(args.since))
        if args.command == "batch":
            from trtllm_worker.app.batch_cli import run_batch

            return await run_batch(client, args, settings)
    raise UsageError(f"unknown command {args.command!r}")


async def _submit(client: Client, args: argparse.Namespace) -> int:
    options = submit_options(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    started = time.monotonic()
    request_id = await client.submit(
        prompt,
        submit_parameters(args),
        trace_context=trace_context(os.environ),
        priority=args.priority,
        **options,
    )
    if not args.follow:
        print(request_id, flush=True)
        return ExitCode.OK
    _note(f"request {request_id}")
    return await _follow(client, request_id, "0", args.timeout, started)


async def _follow(
    client: Client, request_id: str, from_id: str, wait_s: float | None, submitted: float | None
) -> int:
    """Print the stream's text as it arrives, then one summary line on stderr."""
    from trtllm_worker.client import DoneEvent, ErrorEvent, TokenEvent

    out = sys.stdout.buffer
    first_token: float | None = None
    ends_with_newline = True
    try:
        async with asyncio.timeout(wait_s):
            async for event in client.stream(request_id, from_id):
                if isinstance(event, TokenEvent):
                    first_token = first_token or time.monotonic()
                    if event.text:
                        out.write(event.text.encode())
                        out.flush()
                        ends_with_newline = event.text.endswith("\n")
                    continue
                if not ends_with_newline:
                    out.write(b"\n")
                    out.flush()
                if isinstance(event, ErrorEvent):
                    _error(f"request {request_id} failed: {event.code}: {event.message}")
                    return ExitCode.FAILED
                if isinstance(event, DoneEvent):
                    _note(summary(request_id, event, submitted, first_token, time.monotonic()))
                    return ExitCode.OK
    except TimeoutError:
        if not ends_with_newline:
            out.write(b"\n")
        _error(f"request {request_id} has not ended within {wait_s:g}s")
        return ExitCode.TIMEOUT
    except BrokenPipeError:
        return _broken_pipe()
    # no terminal entry after `from_id`: the stream had already ended at or before it
    _note(f"{request_id}: ended at or before entry {from_id}, nothing after it")
    return ExitCode.OK


def summary(
    request_id: str,
    done: DoneEvent,
    submitted: float | None,
    first_token: float | None,
    finished: float,
) -> str:
    """`<id>: <finish reason>, <n> tokens, first token after <ms>, <rate> tokens/s`
    (the timings only when this process submitted the job)."""
    parts = [
        f"{request_id}: {done.finish_reason}",
        f"{done.generated_tokens} tokens ({done.input_tokens} in the prompt)",
    ]
    if submitted is not None:
        ttft = f"{(first_token - submitted) * 1000:.0f} ms" if first_token else "-"
        elapsed = finished - submitted
        rate = f"{done.generated_tokens / elapsed:.1f}" if elapsed > 0 else "-"
        parts += [f"first token after {ttft}", f"{elapsed:.2f} s", f"{rate} tokens/s"]
    return ", ".join(parts)


def dead_letter_line(letter: DeadLetter) -> str:
    """`<request id or -> <code>: <reason>`, on one line."""
    reason = " ".join(letter.message.split()) or "(no reason given)"
    return f"{letter.request_id or '-'} {letter.code}: {reason}"


async def _migrate_queue(client: Client) -> int:
    from trtllm_worker.client.migrate import MigrationRefused

    try:
        done = await client.migrate_queue(report=_note)
    except MigrationRefused as exc:
        _error(str(exc))
        return ExitCode.FAILED
    if done.migrated:
        _note(f"queue {done.queue!r} migrated: {done.moved} jobs kept")
    else:
        _note(f"queue {done.queue!r} is already as the worker declares it: nothing to do")
    return ExitCode.OK


async def _dead_letters(client: Client, requeue: bool, request_ids: list[str] | None) -> int:
    wanted = None if request_ids is None else list(dict.fromkeys(request_ids))
    if requeue:
        letters = await client.requeue_dead_letters(wanted)
        for letter in letters:
            print(f"requeued {dead_letter_line(letter)}", flush=True)
        _note(f"{len(letters)} requeued to {client.queue!r}")
    else:
        letters = await client.dead_letters()
        if wanted is not None:
            letters = [letter for letter in letters if letter.request_id in wanted]
        for letter in letters:
            print(dead_letter_line(letter), flush=True)
        _note(f"{len(letters)} dead letters in {client.dead_queue!r}")
    missing = [i for i in wanted or [] if i not in {letter.request_id for letter in letters}]
    for request_id in missing:
        _error(f"no dead letter of request {request_id} in {client.dead_queue!r}")
    return ExitCode.FAILED if missing else ExitCode.OK


def parse_since(raw: str | None) -> date | None:
    """`--since`: a UTC day, `YYYY-MM-DD` (a usage error otherwise)."""
    if raw is None:
        return None
    try:
        if not raw.isascii() or len(raw) != 10 or raw[4] != "-" or raw[7] != "-":
            raise ValueError  # fromisoformat also takes 20250102 and week dates
        return date.fromisoformat(raw)
    except ValueError:
        raise UsageError(f"--since {raw!r}: expected a day as YYYY-MM-DD") from None


async def _usage(client: Client, tenant: str | None, since: date | None) -> int:
    """One JSON line per tenant and day."""
    for usage in await client.usage(tenant, since):
        print(json.dumps(usage.as_dict()), flush=True)
    return ExitCode.OK
