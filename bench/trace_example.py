"""One job's trace from a real run, for the README: a worker process (echo engine, 20 ms
steps) exports over OTLP/HTTP to a receiver started here; the job is submitted with the
SDK under a producer's span after a first job holds the worker's only slot, so it waits
in the queue. Writes bench/results/trace.png (a waterfall) and prints the span.

    python bench/trace_example.py
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys
import uuid
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).parent.parent))
from tests.otlp import Collected, ReceivedSpan, http_receiver
from trtllm_worker.client import Client
from trtllm_worker.config import Settings

RESULTS = Path(__file__).parent / "results"
AMQP_URL = os.environ.get("WORKER_TEST_AMQP_URL", "amqp://guest:guest@localhost:5672/")
REDIS_URL = os.environ.get("WORKER_TEST_REDIS_URL", "redis://localhost:6379/0")


def draw(span: ReceivedSpan, path: Path) -> None:
    """A waterfall: one row per stretch between the span's start, its events and its
    end, each labelled with the event that ends it."""
    marks = [(event.name, (event.time_ns - span.start_ns) / 1e6) for event in span.events]
    marks.append(("acknowledged (span ends)", (span.end_ns - span.start_ns) / 1e6))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(marks) + 1.2))
    begin = 0.0
    for row, (_name, at) in enumerate(marks):
        ax.barh(row, max(at - begin, 0.4), left=begin, height=0.6, color="#4c7a99")
        ax.annotate(f" {at - begin:.1f} ms", (at, row), va="center", fontsize=8)
        begin = at
    ax.set_yticks(range(len(marks)), [f"until {name}" for name, _ in marks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, marks[-1][1] * 1.12)
    ax.set_xlabel("ms since the job was published")
    ax.set_title(
        f"{span.name}: trace {span.trace_id[:8]}…, child of the producer's span"
        f" {span.parent_span_id[:8]}…",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main() -> None:
    run = uuid.uuid4().hex[:8]
    queue, prefix = f"trace-{run}", f"trace:{run}:"
    collected = Collected(asyncio.get_running_loop())
    with http_receiver(collected) as endpoint:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "OTEL_"))}
        env.update(
            WORKER_AMQP_URL=AMQP_URL,
            WORKER_REDIS_URL=REDIS_URL,
            WORKER_QUEUE=queue,
            WORKER_STREAM_PREFIX=prefix,
            WORKER_HTTP_PORT="0",
            WORKER_ECHO_STEP_MS="20",
            WORKER_MAX_BATCH="1",
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_BSP_SCHEDULE_DELAY="100",
        )
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trtllm_worker", "serve", env=env, stderr=subprocess.PIPE
        )
        assert worker.stderr is not None
        while b"ready:" not in (line := await worker.stderr.readline()):
            if not line:
                raise SystemExit("the worker did not start")
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            amqp_url=AMQP_URL,
            redis_url=REDIS_URL,
            queue=queue,
            stream_prefix=prefix,
        )
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        try:
            async with Client(settings) as client:
                first = await client.submit("The slot is taken. ", {"max_new_tokens": 10})
                request_id = await client.submit(
                    "Once upon a time",
                    {"max_new_tokens": 16},
                    trace_context={"traceparent": f"00-{trace_id}-{parent}-01"},
                )
                for each in (first, request_id):
                    await asyncio.wait_for(client.result(each), 60)
            (span,) = await collected.wait_for(
                lambda s: s.attributes.get("trtllm_worker.request_id") == request_id
            )
        finally:
            worker.terminate()
            await worker.wait()
    print(f"{span.name}  trace {span.trace_id}  parent {span.parent_span_id}  {span.kind}")
    for event in span.events:
        print(f"  {(event.time_ns - span.start_ns) / 1e6:8.1f} ms  {event.name}")
    print(f"  {(span.end_ns - span.start_ns) / 1e6:8.1f} ms  (span ends: acknowledged)")
    for key, value in sorted(span.attributes.items()):
        print(f"  {key} = {value!r}")
    for key in ("service.name", "service.instance.id"):
        print(f"  resource {key} = {span.resource[key]!r}")
    draw(span, RESULTS / "trace.png")
    print(f"picture: {RESULTS / 'trace.png'}")
    assert re.fullmatch(r"[0-9a-f]{32}", span.trace_id)


if __name__ == "__main__":
    asyncio.run(main())
