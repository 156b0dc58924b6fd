"""The `trtllm-worker` command (also `python -m worker`). `serve` is the default."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from worker import __version__
from worker.config import load_settings
from worker.errors import ConfigError
from worker.log import setup_logging

EXIT_CONFIG = 2
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: a service the worker needs does not answer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trtllm-worker",
        description="Serve TensorRT-LLM from a RabbitMQ job queue into Redis streams.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("serve", help="run the worker (the default); settings from WORKER_*")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in (None, "serve"):
        return _serve()
    raise AssertionError(args.command)


def _serve() -> int:
    from worker.service import serve

    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"trtllm-worker: {exc}", file=sys.stderr)
        return EXIT_CONFIG
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
