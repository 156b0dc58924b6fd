"""Whether the gateway's Redis user holds the gateway's grants: each command it runs,
once, on probe keys under the prefix. A missing grant is then one line at start (and in
`/readyz`) instead of a 500 on the first request that needs it, which for a batch's
cancel or its expiry may come days later. The commands probed are `GATEWAY_COMMANDS`
(`connect/grants.py`), those the write script calls included: ACL checks a script's
calls as it checks a client's."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from trtllm_worker.connect.redis import AnyRedis
from trtllm_worker.contract.batches import (
    batch_key,
    counts_key,
    file_data_key,
    file_index_key,
    file_key,
    index_key,
    line_key,
)
from trtllm_worker.contract.stream import cancel_key, lease_key, stream_key, wake_key

PROBE_ID = "trtllm-gateway-acl-probe"
Call = tuple[str, Callable[[Any], Any]]
PROBE_TTL_S = 10
NOOP_SCRIPT = "return 0"


def _calls(prefix: str, probe: str) -> tuple[list[Call], list[Call]]:
    """(command name, its call on a pipeline) for each command of `GATEWAY_COMMANDS`,
    on the keys the gateway runs it on: first those that remove keys (run while the
    keys do not exist: the writes after them run only when both are allowed, so a probe
    never leaves a key behind), then the others."""
    stream = stream_key(prefix, probe)
    wake = wake_key(prefix, probe)
    files = file_key(prefix, probe)
    chunks = file_data_key(prefix, probe)
    batch = batch_key(prefix, probe)
    counts = counts_key(prefix, probe)
    line = line_key(stream)
    mark = cancel_key(stream)
    written = (wake, mark, files, chunks, batch, counts)
    # key by key: on a Redis Cluster the keys lie in different slots
    removing = [_expire(key) for key in written] + [_delete(key) for key in written]
    others: list[Call] = [
        ("XADD", lambda p: p.xadd(wake, {"probe": "1"}, maxlen=1, approximate=False)),
        ("XREAD", lambda p: p.xread({stream: "0"}, count=1)),
        ("XREVRANGE", lambda p: p.xrevrange(stream, count=1)),
        ("XLEN", lambda p: p.xlen(stream)),
        ("EXISTS", lambda p: p.exists(lease_key(stream))),
        ("SET", lambda p: p.set(mark, "probe", px=PROBE_TTL_S * 1000)),
        ("GET", lambda p: p.get(line)),
        ("HSET", lambda p: p.hset(files, "probe", "1")),
        ("HGETALL", lambda p: p.hgetall(files)),
        ("RPUSH", lambda p: p.rpush(chunks, "probe")),
        ("LLEN", lambda p: p.llen(chunks)),
        ("LRANGE", lambda p: p.lrange(chunks, 0, 0)),
        ("HSETNX", lambda p: p.hsetnx(batch, "probe", "1")),
        ("HLEN", lambda p: p.hlen(batch)),
        ("HMGET", lambda p: p.hmget(batch, ["probe"])),
        ("HINCRBY", lambda p: p.hincrby(counts, "probe", 1)),
        # the indexes are shared: XX adds nothing, the member removed is not there
        ("ZADD", lambda p: p.zadd(index_key(prefix), {probe: 0}, xx=True)),
        ("ZREVRANGE", lambda p: p.zrevrange(file_index_key(prefix), 0, 0)),
        ("ZREM", lambda p: p.zrem(index_key(prefix), probe)),
    ]
    return removing, [*others, *removing]


def _expire(key: str) -> Call:
    return "EXPIRE", lambda p: p.expire(key, PROBE_TTL_S)


def _delete(key: str) -> Call:
    return "DEL", lambda p: p.delete(key)


PROBED = tuple(
    dict.fromkeys(["SCRIPT LOAD", "EVALSHA", *(name for name, _ in _calls("p:", "x")[1])])
)
"""The commands the probe runs (a test holds them to `GATEWAY_COMMANDS`)."""


async def _refused(redis: AnyRedis, calls: list[Call]) -> list[str]:
    """The names of `calls` refused by ACL (other errors, as a full Redis's, are not
    the grants' to report: the worker's probe ignores them too)."""
    pipe = redis.pipeline(transaction=False)
    for _, call in calls:
        call(pipe)
    replies = await pipe.execute(raise_on_error=False)
    return [name for (name, _), reply in zip(calls, replies, strict=True)
            if isinstance(reply, NoPermissionError)]  # fmt: skip


async def refused_commands(redis: AnyRedis, prefix: str) -> list[str]:
    """The commands of the gateway this Redis user may not run on its keys under
    `prefix`, in the order probed; [] when it holds them all. Connection errors are the
    caller's to handle."""
    refused: list[str] = []
    try:
        sha = await redis.script_load(NOOP_SCRIPT)
        await redis.evalsha(sha, 0)
    except NoPermissionError as exc:
        refused.append("EVALSHA" if "evalsha" in str(exc).lower() else "SCRIPT LOAD")
    except ResponseError:
        pass  # not a refusal
    removing, everything = _calls(prefix, f"{PROBE_ID}-{uuid.uuid4().hex[:12]}")
    first = await _refused(redis, removing)
    names = first or await _refused(redis, everything)
    refused += [name for name in dict.fromkeys(names) if name not in refused]
    return refused
