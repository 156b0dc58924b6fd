"""`make bench` / `python bench/run.py [SCENARIO ...]`: redis-benchmark's XADD rate, then
each scenario named (every one by default), then bench/results/SUMMARY.md."""

from __future__ import annotations

import argparse

from bench import report, settings
from bench.scenarios import REGISTRY, SUMMARY_ORDER
from bench.services import redis_xadd_ceiling

DESCRIPTION = """trtllm-worker benchmark: real worker processes (echo engine standing in for a GPU),
jobs published through RabbitMQ with publisher confirms, every stream read with XREAD as
a subscriber does. `make bench` runs every scenario; `python bench/run.py --help`."""


def main() -> None:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    known = list(REGISTRY)
    parser.add_argument(
        "scenarios",
        nargs="*",
        metavar="SCENARIO",
        help=f"some of {', '.join(name for name in known if name != 'idle')}, idle (default: all)",
    )
    args = parser.parse_args()
    unknown = [name for name in args.scenarios if name not in known]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(known)}")
    names: list[str] = args.scenarios or known
    settings.RESULTS.mkdir(parents=True, exist_ok=True)
    ceiling = redis_xadd_ceiling()
    print(f"redis-benchmark pipelined XADD: {ceiling:,.0f}/s")
    for name in names:
        REGISTRY[name].run(ceiling)
    print(f"summary: {report.write_summary(ceiling, (REGISTRY[n] for n in SUMMARY_ORDER))}")
    for line in report.verdicts(REGISTRY[name] for name in dict.fromkeys(names)):
        print(f"target: {line}")
