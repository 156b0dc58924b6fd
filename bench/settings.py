"""Where the bench reads and writes, and what it compares with."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("BENCH_RESULTS", Path(__file__).parent / "results"))
"""Where every JSON, plot, SUMMARY.md and worker log goes: bench/results/, whose files the
README cites (BENCH_RESULTS elsewhere: a trial run that leaves them as committed)."""

PERFORMANCE_WORK_BASE = "1866419fe8a5afeeada680f2e8f92af0f857b52b"
"""The last commit before issue 15's per-token work ("Compaction timers are cancelled when
the store closes"): the code that work halved the CPU per token of, and so the figure the
README's baseline row and its target (CPU <= 0.5 x) are measured against. A full hash, not
a branch or a tag, so that the comparison does not move as the history does."""
BASELINE_REF = os.environ.get("BENCH_BASELINE", PERFORMANCE_WORK_BASE)
"""The code CPU per token is compared with (any git ref of this repository; BENCH_BASELINE
overrides it)."""

AMQP_URL = os.environ.get("WORKER_TEST_AMQP_URL", "amqp://guest:guest@localhost:5672/")
REDIS_URL = os.environ.get("WORKER_TEST_REDIS_URL", "redis://localhost:6379/0")

TRACING_ROUNDS = int(os.environ.get("BENCH_TRACING_ROUNDS", "3"))
"""Rounds of off, on, tenth, tenth, on, off in the tracing scenario."""

PRIORITIES_BASE = "7b2216d0d65218b2a8bf54b9cd50f69d98bb32e7"
"""The last commit before issue 27's priorities ("An ssl_* query parameter on a redis://
URL is a settings error"): what the `tiers` scenario measures the cost of priorities on
the throughput and short workloads against (same run, ABBA)."""
TIERS_WINDOW_S = float(os.environ.get("BENCH_TIERS_WINDOW_S", "60"))
"""How long each phase of the `tiers` scenarios is measured."""
TIERS_COST_SCALE = int(os.environ.get("BENCH_TIERS_COST_SCALE", "8"))
"""How many times the jobs of `throughput` and `short` the cost of priorities is measured
on: at 1 a run lasts under two seconds and single runs spread by 15 to 25 %."""
TIERS_COST_ROUNDS = int(os.environ.get("BENCH_TIERS_COST_ROUNDS", "2"))
"""Rounds of before, this, this, before in the cost of priorities."""

BATCH_LINES = int(os.environ.get("BENCH_BATCH_LINES", "50000"))
"""Lines of the `batch` scenario's input file (50,000: OpenAI's limit per batch)."""
BATCH_ROUNDS = int(os.environ.get("BENCH_BATCH_ROUNDS", "1"))
"""Rounds of direct, batch, batch, direct in the `batch` scenario."""

GATEWAY_LEVELS = tuple(
    int(level)
    for level in os.environ.get("BENCH_GATEWAY_LEVELS", "20,50,100,200,500,1000").split(",")
)
"""Concurrent streaming clients at each level of the `gateway` scenario's sweep."""
GATEWAY_STEP_MS = float(os.environ.get("BENCH_GATEWAY_STEP_MS", "50"))
"""The echo engine's step in the sweep: each stream's pace (50 ms: 20 tokens/s)."""
GATEWAY_TOKENS = int(os.environ.get("BENCH_GATEWAY_TOKENS", "64"))
"""max_tokens of every answer of the `gateway` scenario."""
GATEWAY_WINDOW_S = float(os.environ.get("BENCH_GATEWAY_WINDOW_S", "10"))
"""How long each level of the sweep is measured, after its clients have started."""
GATEWAY_DIRECT = int(os.environ.get("BENCH_GATEWAY_DIRECT", "50"))
"""At most this many concurrent direct readers beside a level's gateway clients."""
GATEWAY_PAIRS = int(os.environ.get("BENCH_GATEWAY_PAIRS", "200"))
"""Back-to-back pairs (gateway, direct) of the unloaded added TTFT."""
GATEWAY_KEEP_GOING = os.environ.get("BENCH_GATEWAY_KEEP_GOING", "") not in ("", "0")
"""Run every level of the `gateway` sweep, not only up to the first that did not hold."""
