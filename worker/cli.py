"""The `trtllm-worker` command (also `python -m worker`). `serve` is the default."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from worker import __version__
from worker.config import Settings, load_settings
from worker.errors import ConfigError
from worker.log import setup_logging

EXIT_CONFIG = 2
EXIT_FAILED = 1
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: a service the worker needs does not answer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trtllm-worker",
        description="Serve TensorRT-LLM from a RabbitMQ job queue into Redis streams. "
        "Settings come from WORKER_* variables (and .env).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("serve", help="run the worker (the default)")
    submit = commands.add_parser("submit", help="publish a job; with --follow, print its tokens")
    submit.add_argument("prompt", help="the prompt (the job's inputs)")
    submit.add_argument(
        "--param",
        "-p",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a job parameter, VALUE as JSON (e.g. -p max_new_tokens=32 -p stop='[\"\\n\"]')",
    )
    submit.add_argument("--request-id", help="default: a fresh random id")
    submit.add_argument("--follow", "-f", action="store_true", help="print tokens as they arrive")
    tail = commands.add_parser("tail", help="follow a request's stream to its end")
    tail.add_argument("request_id")
    cancel = commands.add_parser("cancel", help="cancel a request")
    cancel.add_argument("request_id")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"trtllm-worker: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command in (None, "serve"):
        return _serve(settings)
    try:
        return asyncio.run(_client_command(args, settings))
    except (ConfigError, ValueError) as exc:
        print(f"trtllm-worker: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (OSError, ConnectionError) as exc:
        print(f"trtllm-worker: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return 130


def _serve(settings: Settings) -> int:
    from worker.service import serve

    setup_logging(settings.log_level, settings.log_format)
    try:
        return asyncio.run(serve(settings))
    except ConfigError as exc:
        print(f"trtllm-worker: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ConnectionError as exc:
        print(f"trtllm-worker: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return 0


def parse_params(pairs: Sequence[str]) -> dict[str, Any]:
    """`name=value` pairs, each value JSON (a bare word is taken as a string)."""
    params: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--param {pair!r}: expected NAME=VALUE")
        try:
            params[name] = json.loads(raw)
        except json.JSONDecodeError:
            params[name] = raw
    return params


async def _client_command(args: argparse.Namespace, settings: Settings) -> int:
    from worker import client

    if args.command == "cancel":
        await client.cancel(settings.amqp_url, settings.queue, args.request_id)
        print(args.request_id)
        return 0
    if args.command == "tail":
        return await _print_stream(settings, args.request_id, time.monotonic())
    body = client.job_body(
        inputs=args.prompt, parameters=parse_params(args.param), request_id=args.request_id
    )
    started = time.monotonic()
    request_id = await client.submit(settings.amqp_url, settings.queue, body)
    if not args.follow:
        print(request_id)
        return 0
    print(f"# {request_id}", file=sys.stderr)
    return await _print_stream(settings, request_id, started)


async def _print_stream(settings: Settings, request_id: str, started: float) -> int:
    from worker import client

    first_token: float | None = None
    key = settings.stream_prefix + request_id
    async for _, fields in client.follow(settings.redis_url, key):
        event = fields.get("event")
        if event == "token":
            first_token = first_token or time.monotonic()
            sys.stdout.write(fields.get("text", ""))
            sys.stdout.flush()
        elif event == "done":
            elapsed = time.monotonic() - started
            tokens = int(fields.get("generated_tokens", "0"))
            ttft = f"{(first_token - started) * 1000:.0f} ms" if first_token else "-"
            rate = f"{tokens / elapsed:.1f}" if elapsed > 0 else "-"
            print(
                f"\n# {fields.get('finish_reason')}: {tokens} tokens, "
                f"first token after {ttft}, {rate} tokens/s",
                file=sys.stderr,
            )
            return 0
        elif event == "error":
            print(f"\n# error {fields.get('code')}: {fields.get('message')}", file=sys.stderr)
            return EXIT_FAILED
    return EXIT_FAILED
