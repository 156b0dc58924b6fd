"""What a scenario is: how it runs, which results file it leaves, its summary row, and
its target with how that target is judged."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Data = dict[str, Any]
"""A scenario's JSON in bench/results/, as loaded."""
OfRedis = Callable[[float], str]
"""A rate as a share of this run's redis-benchmark XADD rate ("0.0974 x Redis")."""


@dataclass(frozen=True)
class Target:
    text: str
    """As the summary's target column shows it."""
    met: Callable[[Data], bool] | None = None
    """Whether the scenario's results meet it; None: nothing to judge (a sweep's curves)."""


@dataclass(frozen=True)
class Scenario:
    name: str
    """As `make bench SCENARIOS=...` names it."""
    run: Callable[[float], None]
    """Measures, given this run's redis-benchmark XADD rate; writes its results to
    bench/results/ and prints a line."""
    results: str
    """The JSON it writes (bench/results/<results>.json), which its summary row is made of."""
    row: Callable[[Data, OfRedis], tuple[str, str]]
    """The summary's "what" and "result" cells, from that JSON."""
    target: Target
    label: str = ""
    """The summary's scenario cell (its name unless given)."""

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", self.name)
