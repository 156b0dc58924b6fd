"""Reading per-tenant usage: what the worker counted with each terminal entry, summed per
tenant and UTC day (`streams/usage.py` says where the counters live). An operator call
of the SDK, so producers can bill or report from their own code; `trtllm-worker usage`
prints it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from datetime import date
from typing import Any, cast

from redis.asyncio.cluster import RedisCluster

from trtllm_worker.connect.redis import AnyRedis
from trtllm_worker.streams.usage import ADAPTER_PREFIX, COUNTERS, usage_day, usage_pattern

SCAN_COUNT = 1000
HGETALL_CHUNK = 500
"""Keys read per round trip (a day has up to 16384 keys on Redis Cluster)."""


@dataclass(frozen=True, slots=True)
class Usage:
    """One tenant's usage on one UTC day."""

    tenant: str
    """`-` for jobs without a tenant."""
    day: str
    """`YYYY-MM-DD`, UTC."""
    jobs: int
    input_tokens: int
    generated_tokens: int
    adapters: dict[str, dict[str, int]] = field(default_factory=dict)
    """Of these totals, what jobs with a LoRA adapter used, per adapter:
    `{name: {"jobs", "input_tokens", "generated_tokens"}}` (empty: none did)."""

    def as_dict(self) -> dict[str, Any]:
        """`{"tenant", "day", "jobs", "input_tokens", "generated_tokens"}`, with
        `"adapters"` when jobs used one."""
        row = asdict(self)
        if not self.adapters:
            del row["adapters"]
        return row


async def _usage_keys(client: AnyRedis, prefix: str) -> AsyncIterator[str]:
    """Every usage key under `prefix`: SCAN on every master of a cluster (a replica
    would count its keys twice), or on the one node."""
    pattern = usage_pattern(prefix)
    if isinstance(client, RedisCluster):
        scan = client.scan_iter(
            match=pattern, count=SCAN_COUNT, _type="hash", target_nodes=RedisCluster.PRIMARIES
        )
    else:
        scan = client.scan_iter(match=pattern, count=SCAN_COUNT, _type="hash")
    async for key in scan:
        yield key.decode() if isinstance(key, bytes) else str(key)


async def read_usage(
    client: AnyRedis,
    prefix: str,
    *,
    tenant: str | None = None,
    since: date | None = None,
) -> list[Usage]:
    """The usage counted under `prefix`, one entry per (tenant, day), sorted by day then
    tenant; only `tenant`'s and only days from `since` on (UTC) when given."""
    first = None if since is None else since.isoformat()
    days: dict[str, str] = {}
    async for key in _usage_keys(client, prefix):
        day = usage_day(prefix, key)
        if day is not None and (first is None or day >= first):
            days[key] = day
    totals: dict[tuple[str, str], list[int]] = {}
    by_adapter: dict[tuple[str, str], dict[str, dict[str, int]]] = {}
    keys = sorted(days)
    for start in range(0, len(keys), HGETALL_CHUNK):
        chunk = keys[start : start + HGETALL_CHUNK]
        pipe = client.pipeline(transaction=False)
        for key in chunk:
            pipe.hgetall(key)
        for key, counters in zip(chunk, await pipe.execute(), strict=True):
            for name, value in cast(dict[Any, Any], counters).items():
                text = name.decode() if isinstance(name, bytes) else str(name)
                counter, _, who = text.partition(":")
                if counter.startswith(ADAPTER_PREFIX):
                    counter = counter.removeprefix(ADAPTER_PREFIX)
                    who, _, adapter = who.rpartition(":")
                    if counter not in COUNTERS or (tenant is not None and who != tenant):
                        continue
                    per = by_adapter.setdefault((days[key], who), {})
                    counts = per.setdefault(adapter, dict.fromkeys(COUNTERS, 0))
                    counts[counter] += int(value)
                    continue
                if counter not in COUNTERS or (tenant is not None and who != tenant):
                    continue
                row = totals.setdefault((days[key], who), [0, 0, 0])
                row[COUNTERS.index(counter)] += int(value)
    return [
        Usage(
            tenant=who,
            day=day,
            jobs=jobs,
            input_tokens=inputs,
            generated_tokens=generated,
            adapters=dict(sorted(by_adapter.get((day, who), {}).items())),
        )
        for (day, who), (jobs, inputs, generated) in sorted(totals.items())
    ]
