"""The store's Lua scripts, read from `lua/*.lua` in the package.

The write script has two entry points that differ in where the keys come from (KEYS, or
ARGV[3] on a cluster node) and in the cross-slot flag, a shebang that must be the
script's first line and changes how Redis runs it (Redis 7 only; flagged scripts are
refused when out of memory). So it cannot be a runtime parameter: each variant is a
one-line wrapper file, with `write.lua`, the shared body, appended when the text is
read, once per process."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.resources import files

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

LEASE_LOST = -1
"""`write.lua`'s result for a part the fence refused."""
ENTRIES_LOST = -2
"""`write.lua`'s result for a part whose stream lacks entries before the first given."""


@cache
def lua(name: str) -> str:
    """The text of `lua/<name>.lua`."""
    return (files(__package__) / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def write_script(entry: str) -> str:
    """The write script behind `entry` (`write_keys` or `write_node`)."""
    return lua(entry) + lua("write")


@dataclass(frozen=True, slots=True)
class Scripts:
    """The scripts every topology runs, registered on one client (their SHA computed
    once, loaded on demand)."""

    write: AsyncScript
    start: AsyncScript
    renew: AsyncScript
    release: AsyncScript
    compact: AsyncScript

    @classmethod
    def register(cls, client: aioredis.Redis | RedisCluster) -> Scripts:
        return cls(
            write=client.register_script(write_script("write_keys")),
            start=client.register_script(lua("start")),
            renew=client.register_script(lua("renew")),
            release=client.register_script(lua("release")),
            compact=client.register_script(lua("compact")),
        )
