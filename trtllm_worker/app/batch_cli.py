"""`trtllm-worker batch …`: OpenAI Batch files through the queue (the SDK's batch calls,
with progress bars on a terminal and OpenAI's JSON on stdout)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trtllm_worker.config import Settings
from trtllm_worker.contract.exits import ExitCode

if TYPE_CHECKING:
    from tqdm import tqdm

    from trtllm_worker.client import Client

HELP = "run OpenAI Batch files: submit, status, results, cancel, list, wait"


def add_batch_parser(commands: Any) -> None:
    """The `batch` command and its subcommands."""
    batch = commands.add_parser("batch", help=HELP, description=HELP)
    sub = batch.add_subparsers(dest="batch_command", metavar="SUBCOMMAND", required=True)
    submit = sub.add_parser(
        "submit",
        help="publish each valid line of an OpenAI Batch input file as a job; prints the "
        "batch id (run again with --id after an interruption: only the missing lines go)",
    )
    submit.add_argument("file", type=Path, help="the .jsonl input file")
    submit.add_argument("--id", dest="batch_id", metavar="ID", help="default: a fresh id")
    submit.add_argument(
        "--priority", type=int, choices=range(10), default=0, metavar="0-9",
        help="the jobs' priority (default 0: interactive jobs go first)",
    )  # fmt: skip
    submit.add_argument(
        "--completion-window", default="24h", metavar="WINDOW",
        help="lines not ended by then end as batch_expired (default 24h; s, m, h or d)",
    )  # fmt: skip
    submit.add_argument("--tenant", help="whom the jobs are for: their usage counts under it")
    submit.add_argument(
        "--max-lines", type=int, default=None, metavar="N",
        help="refuse a file of more lines (default 1,000,000)",
    )  # fmt: skip
    submit.add_argument(
        "--max-bytes", type=int, default=None, metavar="N",
        help="refuse a larger file (default 1 GiB)",
    )  # fmt: skip
    submit.add_argument("--wait", action="store_true", help="then wait for the batch to end")
    status = sub.add_parser("status", help="print the batch as OpenAI's Batch object (JSON)")
    status.add_argument("batch_id", metavar="ID")
    results = sub.add_parser(
        "results",
        help="write the output lines (and with --errors the error lines) of the lines "
        "ended so far, in input order",
    )
    results.add_argument("batch_id", metavar="ID")
    results.add_argument("-o", "--output", type=Path, required=True, metavar="OUT.jsonl")
    results.add_argument("--errors", type=Path, metavar="ERR.jsonl")
    cancel = sub.add_parser("cancel", help="cancel the batch; prints its Batch object")
    cancel.add_argument("batch_id", metavar="ID")
    listing = sub.add_parser("list", help="the newest batches first, one Batch object a line")
    listing.add_argument("--limit", type=int, default=100, metavar="N")
    wait = sub.add_parser(
        "wait",
        help="show progress until the batch ends, then print its Batch object; exit 0 "
        "when it completed, 1 otherwise",
    )
    wait.add_argument("batch_id", metavar="ID")


def _print(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False), flush=True)


def _bar(what: str, total: int | None = None) -> tqdm[Any]:
    """A progress bar on stderr, shown only when stderr is a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, unit=" lines", desc=what, file=sys.stderr, disable=None, leave=False)


async def run_batch(client: Client, args: argparse.Namespace, settings: Settings) -> int:
    command = args.batch_command
    if command == "submit":
        return await _submit(client, args)
    if command == "status":
        _print(await client.batch(args.batch_id))
    elif command == "results":
        out, err = await client.write_batch_results(args.batch_id, args.output, args.errors)
        batch = await client.batch(args.batch_id)
        counts = batch["request_counts"]
        left = counts["total"] - counts["completed"] - counts["failed"]
        where = f" to {args.errors}" if args.errors is not None else " (not written: --errors)"
        note = f"{out} output lines to {args.output}, {err} error lines{where}"
        if left:
            note += f"; the batch is {batch['status']}, {left} lines not ended yet"
        print(f"# {note}", file=sys.stderr, flush=True)
    elif command == "cancel":
        _print(await client.cancel_batch(args.batch_id))
    elif command == "list":
        for batch in await client.list_batches(args.limit):
            _print(batch)
    elif command == "wait":
        return await _wait(client, args.batch_id)
    return ExitCode.OK


async def _submit(client: Client, args: argparse.Namespace) -> int:
    from trtllm_worker.client.batch_files import DEFAULT_MAX_BYTES, DEFAULT_MAX_LINES

    with _bar("submitting") as bar:

        def total(lines: int) -> None:
            bar.total = lines
            bar.refresh()

        batch_id = await client.submit_batch(
            args.file,
            batch_id=args.batch_id,
            priority=args.priority,
            completion_window=args.completion_window,
            tenant=args.tenant,
            max_lines=args.max_lines or DEFAULT_MAX_LINES,
            max_bytes=args.max_bytes or DEFAULT_MAX_BYTES,
            progress=bar.update,
            on_total=total,
        )
    print(batch_id, flush=True)
    if args.wait:
        return await _wait(client, batch_id, print_object=False)
    return ExitCode.OK


async def _wait(client: Client, batch_id: str, *, print_object: bool = True) -> int:
    batch = await client.batch(batch_id)
    with _bar(batch_id, batch["request_counts"]["total"]) as bar:
        batch = await client.wait_batch(batch_id, progress=bar.update)
    if print_object:
        _print(batch)
    else:
        print(f"# {batch_id} {batch['status']}", file=sys.stderr, flush=True)
    return ExitCode.OK if batch["status"] == "completed" else ExitCode.FAILED
