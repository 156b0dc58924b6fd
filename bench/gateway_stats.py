"""The `gateway` scenario's arithmetic (pure, unit-tested): percentiles, the time the
gateway adds to the first token over the same kind of jobs read straight from Redis,
and the most concurrent streams within a latency bound."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q` quantile (0 < q <= 1) as the harness takes it: the value at
    rank int(q x n) of the sorted values (the largest for a p99 of under 100 values);
    None without values."""
    if not values:
        return None
    if not 0 < q <= 1:
        raise ValueError(f"q must be in (0, 1], not {q}")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def added_latency(through: Sequence[float], direct: Sequence[float]) -> dict[str, Any]:
    """TTFT (ms) through the gateway against TTFT of the same kind of jobs read straight
    from Redis in the same run: each side's p50 and p99, and what the gateway adds at
    each (the difference of the percentiles: the two sets are not paired job by job)."""
    figures: dict[str, Any] = {"answers": len(through), "direct_answers": len(direct)}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        ours, theirs = percentile(through, q), percentile(direct, q)
        figures[f"gateway_ms_{name}"] = _ms(ours)
        figures[f"direct_ms_{name}"] = _ms(theirs)
        figures[f"added_ms_{name}"] = (
            None if ours is None or theirs is None else round(ours - theirs, 3)
        )
    return figures


def paired_added(pairs: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Back-to-back pairs (through the gateway, direct), one job at a time: the added
    time of each pair, its p50 and p99, besides each side's."""
    through = [g for g, _ in pairs]
    direct = [d for _, d in pairs]
    differences = [g - d for g, d in pairs]
    figures = added_latency(through, direct)
    figures["paired_added_ms_p50"] = _ms(percentile(differences, 0.5))
    figures["paired_added_ms_p99"] = _ms(percentile(differences, 0.99))
    return figures


def relay_added(through: Sequence[float], direct: dict[int, float]) -> list[float]:
    """Per token of one answer, paired: when it arrived through the gateway
    (`through[k]`, the k-th token's chunk) minus when the same token's entry (index k)
    arrived to a reader of the job's stream in Redis, in ms; tokens the reader did not
    wait for (already in the stream when it started) are not in `direct`."""
    return [
        round((through[k] - seen) * 1000, 3)
        for k, seen in sorted(direct.items())
        if 0 <= k < len(through)
    ]


def holds(point: dict[str, Any], bound_ms: float) -> bool:
    """Whether a level of the sweep held its streams: every answer whole and without an
    error, and the added latency per token (paired) p99 under `bound_ms`."""
    added = point.get("relay_added_ms_p99")
    return (
        added is not None
        and added < bound_ms
        and not point.get("errors")
        and not point.get("short_answers")
        and point.get("answers", 0) > 0
    )


def most_streams(points: Sequence[dict[str, Any]], bound_ms: float) -> int | None:
    """The most concurrent streams of a level that held, with every smaller level
    holding too (the sweep stops counting at the first that did not); None if the
    smallest did not."""
    best = None
    for point in sorted(points, key=lambda p: int(p["streams"])):
        if not holds(point, bound_ms):
            break
        best = int(point["streams"])
    return best


def shares(clients: int, per_process: int) -> list[int]:
    """`clients` spread as evenly as can be over the fewest processes of at most
    `per_process` each."""
    processes = max(-(-clients // per_process), 1)
    return [clients // processes + (n < clients % processes) for n in range(processes)]


class Window:
    """Tokens received within [start, end) (monotonic seconds)."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.tokens = 0

    def add(self, now: float, tokens: int) -> None:
        if self.start <= now < self.end:
            self.tokens += tokens

    def holds(self, moment: float) -> bool:
        return self.start <= moment < self.end
