"""Per-tenant usage counters: where they live and what `write.lua` needs to count a job.

A job is counted by `end_stream` in `lua/write.lua`, in the same script call that stores
its terminal entry, and only when that call stores it: a redelivered, paused or
duplicated job ends its stream once, so it is counted once.

Keys (one hash per UTC day, fields `jobs:<tenant>`, `input_tokens:<tenant>`,
`generated_tokens:<tenant>`, and for a job with a LoRA adapter also the same three
prefixed `adapter_` under `<tenant>:<adapter>`: a breakdown of the tenant's totals, which
it never changes):

- one node (Sentinel included): `<prefix>_usage:<YYYY-MM-DD>`;
- Redis Cluster: `<prefix>_usage:<YYYY-MM-DD>:{<tag>}`, `<tag>` a short string that hashes
  to the slot of the stream the terminal entry ends, so a script touches keys of one
  slot only. A day has at most 16384 such keys; the reader sums them.

`_usage` follows the prefix because a request id cannot begin with `_`: no stream key
(`<prefix><request id>`) is ever a usage key, nor matched by the reader's pattern."""

from __future__ import annotations

import re
import time
from binascii import crc_hqx
from dataclasses import dataclass, field
from functools import cache
from typing import Final

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

NO_TENANT: Final = "-"
"""The tenant a job without one counts as."""
USAGE_INFIX: Final = "_usage:"
COUNTERS: Final = ("jobs", "input_tokens", "generated_tokens")
"""The hash fields are `<counter>:<tenant>` (a counter's name holds no colon)."""
ADAPTER_PREFIX: Final = "adapter_"
"""`adapter_<counter>:<tenant>:<adapter>`: the part of a tenant's counter that used
`adapter` (a tenant may hold colons, an adapter's name holds none)."""
NOT_COUNTED: Final = ("", 0, "", 0, "")
"""A terminal entry's usage values when nothing is counted (a store built without usage)."""


def utc_day(now: float | None = None) -> str:
    """`YYYY-MM-DD` of `now` (default: this moment) in UTC."""
    return time.strftime("%Y-%m-%d", time.gmtime(time.time() if now is None else now))


@cache
def slot_tags() -> tuple[str, ...]:
    """Per hash slot, the shortest hex string (the lowest number) hashing to it: 16384
    tags of at most 5 characters, computed once per process (about 0.1 s, on Redis
    Cluster only, when the store is built). A key's slot is CRC16 (XMODEM, which
    `binascii.crc_hqx` computes) of its hash tag, modulo 16384."""
    tags: list[bytes | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    missing = REDIS_CLUSTER_HASH_SLOTS
    number = 0
    while missing:
        tag = b"%x" % number
        slot = crc_hqx(tag, 0) % REDIS_CLUSTER_HASH_SLOTS
        if tags[slot] is None:
            tags[slot] = tag
            missing -= 1
        number += 1
    return tuple(tag.decode() for tag in tags if tag is not None)


def usage_key(prefix: str, day: str, tag: str | None = None) -> str:
    """The counters of `day` (of the slot `tag` hashes to, on Redis Cluster)."""
    key = f"{prefix}{USAGE_INFIX}{day}"
    return key if tag is None else f"{key}:{{{tag}}}"


def usage_pattern(prefix: str) -> str:
    """A SCAN MATCH pattern for every usage key under `prefix` (glob characters of the
    prefix escaped)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", prefix + USAGE_INFIX) + "*"


def usage_day(prefix: str, key: str) -> str | None:
    """The day of a usage key under `prefix`, or None for any other key."""
    match = re.fullmatch(
        re.escape(prefix + USAGE_INFIX) + r"([0-9]{4}-[0-9]{2}-[0-9]{2})(?::\{[0-9a-f]+\})?", key
    )
    return None if match is None else match.group(1)


@dataclass(frozen=True, slots=True)
class UsageKeys:
    """How one deployment's terminal entries are counted: its prefix, how long a day's
    counters are kept after their last write, and whether keys must share their
    stream's slot (Redis Cluster)."""

    prefix: str
    ttl_s: int
    cluster: bool = False
    _today: tuple[int, str] = field(default=(-1, ""), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cluster:
            slot_tags()  # now, not on the event loop at the first terminal entry

    def _day(self) -> str:
        """This UTC day, formatted once per day rather than once per job (a terminal
        entry of a 1-token job is on the worker's hottest path)."""
        now = time.time()
        number = int(now // 86400)
        cached_number, cached_day = self._today
        if number != cached_number:
            cached_day = utc_day(now)
            object.__setattr__(self, "_today", (number, cached_day))
        return cached_day

    def key(self, stream: str, day: str) -> str:
        """The usage key the terminal entry of `stream` counts into on `day`."""
        if not self.cluster:
            return usage_key(self.prefix, day)
        return usage_key(self.prefix, day, slot_tags()[key_slot(stream.encode())])

    def values(
        self, stream: str, tenant: str | None, input_tokens: int, adapter: str | None = None
    ) -> tuple[str, int, str, int, str]:
        """`write.lua`'s usage values of a terminal entry: key, TTL, tenant, input tokens,
        LoRA adapter ('' for none) (the script counts the generated tokens itself: the
        token entries before the terminal one). The day is this worker's UTC day, not
        the script's `TIME`: the whole key, slot tag included, is named here where the
        slot table is, and the script stays deterministic. Clocks apart by a little
        move a job ending at midnight to the next day or the one before, nothing
        worse."""
        return (
            self.key(stream, self._day()),
            self.ttl_s,
            tenant or NO_TENANT,
            input_tokens,
            adapter or "",
        )
