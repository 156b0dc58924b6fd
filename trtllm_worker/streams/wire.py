"""The wire form of a batch of stream writes: the KEYS and ARGV of `write.lua`'s calls.

Token entries travel as columns in one MessagePack argument, without ids or field names
(the script builds them): the worker makes no object per token and sends two values per
token, and Redis parses one argument instead of several per token.

A part's code is `8 n + 4 (top logprobs follow) + 2 (logprobs follow) + 1 (a terminal
entry follows)` for n token entries (`write.lua`)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import msgpack
from redis.crc import key_slot

from trtllm_worker.contract.stream import TOKEN, Fields, entry_id, lease_key
from trtllm_worker.streams.usage import NOT_COUNTED, UsageKeys

PER_TOKEN = 8
"""A part's code counts its token entries in steps of this (below: the flags)."""
WITH_TOP = 4
WITH_LOGPROBS = 2
WITH_END = 1

END_VALUES = len(NOT_COUNTED) + 2
"""Values after a terminal entry's fields: its usage, then its batch line's model and
clock (`write.lua`)."""

AFTER_TAIL = ""
"""The id of a terminal entry whose index is not known: after whatever the stream holds."""

Entry = tuple[str, str, Fields]
"""(stream key, entry id, fields): one entry to append."""


def write_argv(ttl_s: int, values: list[Any]) -> list[Any]:
    """`write.lua`'s ARGV: the TTL, then the parts' values as one MessagePack array."""
    return [ttl_s, msgpack.packb(values)]


class WriteBatch:
    """The `write.lua` calls of one batch, built as the engine's outputs are read: per
    stream a part (its tokens in columns, then maybe its terminal entry) appended
    straight to the script's KEYS and ARGV, so the worker makes no object per token and
    sends two values per token (the script builds each entry's id, index and field
    names). Grouped per hash slot (one group on a single node): a call may declare keys
    of one slot only, and the store sends a cluster's groups one call per node."""

    __slots__ = ("_cluster", "_code_at", "_key", "_model", "_usage", "calls", "ended")

    def __init__(
        self, *, cluster: bool = False, usage: UsageKeys | None = None, model: str = ""
    ) -> None:
        self._cluster = cluster
        self._usage = usage
        """Where terminal entries count their job's usage (None: not counted)."""
        self._model = model
        """The model's public name, for the record of a terminal entry that ends a batch
        line (`contract/batches.py`)."""
        self.calls: dict[int, tuple[list[Any], list[Any]]] = {}
        """Per hash slot (0 on a single node): the call's KEYS and its parts' values
        (`StreamStore.write` sends them as one MessagePack array after the TTL)."""
        self.ended: list[str] = []
        """The streams that get their terminal entry."""
        self._code_at = 0
        self._key = ""

    def __bool__(self) -> bool:
        return bool(self.calls)

    def begin(self, keys: tuple[str, str], slot: int, lease: str, seq: int) -> list[Any]:
        """Open a part for the stream `keys` (stream and lease key) whose next entry is
        `seq`, fenced by `lease`; returns the ARGV to append its columns to."""
        call = self.calls.get(slot if self._cluster else 0)
        if call is None:
            call = self.calls[slot if self._cluster else 0] = ([], [])
        call[0].extend(keys)
        self._key = keys[0]
        args = call[1]
        self._code_at = len(args) + 2
        args += (lease, seq, 0)
        return args

    def plain(
        self, keys: tuple[str, str], slot: int, lease: str, seq: int,
        token_ids: Sequence[int], texts: Sequence[str],
    ) -> None:  # fmt: skip
        """A whole part of token entries without logprobs or end: `begin` and `tokens`
        in one call (the hot path: a step of a running request)."""
        call = self.calls.get(slot if self._cluster else 0)
        if call is None:
            call = self.calls[slot if self._cluster else 0] = ([], [])
        call[0].extend(keys)
        args = call[1]
        args += (lease, seq, len(token_ids) * PER_TOKEN)
        args += token_ids
        args += texts

    def tokens(
        self, args: list[Any], token_ids: Sequence[int], texts: Sequence[str],
        logprobs: Sequence[float | str] | None = None,
        top_logprobs: Sequence[str] | None = None,
    ) -> None:  # fmt: skip
        """The open part's token entries (logprobs: '' for none; top logprobs: each
        token's as compact JSON, `top_json`, '' for none)."""
        args += token_ids
        args += texts
        code = len(token_ids) * PER_TOKEN
        if logprobs is not None:
            args += logprobs
            code += WITH_LOGPROBS
        if top_logprobs is not None:
            args += top_logprobs
            code += WITH_TOP
        args[self._code_at] = code

    def end(
        self,
        args: list[Any],
        seq_id: str,
        fields: Fields,
        tenant: str | None = None,
        input_tokens: int = 0,
        adapter: str | None = None,
    ) -> None:
        """The open part's terminal entry (`seq_id` AFTER_TAIL: after the stream's tail),
        which counts the job's usage under `tenant` (and `adapter`, a breakdown) when it
        is stored."""
        args[self._code_at] += WITH_END
        self.ended.append(self._key)
        args += (seq_id, len(fields), *chain.from_iterable(fields.items()))
        if self._usage is None:
            args += NOT_COUNTED
        else:
            args += self._usage.values(self._key, tenant, input_tokens, adapter)
        args += (self._model, int(time.time() * 1000))

    def per_stream(self) -> list[tuple[str, WriteBatch]]:
        """The batch as one batch per stream (its parts in order), to write the streams
        one by one when Redis refused the batch (`StreamStore.write_each`)."""
        streams: dict[str, WriteBatch] = {}
        for slot, (keys, args) in self.calls.items():
            a = 0
            for k in range(0, len(keys), 2):
                code = int(args[a + 2])
                count = code // PER_TOKEN
                columns = 2 + bool(code & WITH_LOGPROBS) + bool(code & WITH_TOP)
                end = a + 3 + columns * count
                if code & WITH_END:
                    end += 2 + 2 * int(args[end + 1]) + END_VALUES
                one = streams.get(keys[k])
                if one is None:
                    one = streams[keys[k]] = WriteBatch(
                        cluster=self._cluster, usage=self._usage, model=self._model
                    )
                call = one.calls.setdefault(slot, ([], []))
                call[0].extend(keys[k : k + 2])
                call[1].extend(args[a:end])
                if code & WITH_END:
                    one.ended.append(keys[k])
                a = end
        return list(streams.items())

    def entries(self) -> list[Entry]:
        """The entries the batch stores, in order per stream, as subscribers will read
        them (a terminal entry after the tail shows its id as AFTER_TAIL)."""
        stored: list[Entry] = []
        for keys, args in self.calls.values():
            a = 0
            for key in keys[::2]:
                seq, code = int(args[a + 1]), int(args[a + 2])
                count, a = code // PER_TOKEN, a + 3
                ids, texts = args[a : a + count], args[a + count : a + 2 * count]
                a += 2 * count
                logprobs = tops = [""] * count
                if code & WITH_LOGPROBS:
                    logprobs, a = args[a : a + count], a + count
                if code & WITH_TOP:
                    tops, a = args[a : a + count], a + count
                for k in range(count):
                    fields: Fields = {
                        "event": TOKEN, "index": seq - 1 + k, "token_id": ids[k], "text": texts[k]
                    }  # fmt: skip
                    if logprobs[k] != "":
                        fields["logprob"] = float(logprobs[k])
                    if tops[k] != "":
                        fields["top_logprobs"] = tops[k]
                    stored.append((key, entry_id(seq + k), fields))
                if code & WITH_END:
                    seq_id, nfields = args[a], int(args[a + 1])
                    flat = args[a + 2 : a + 2 + 2 * nfields]
                    stored.append((key, seq_id, dict(zip(flat[::2], flat[1::2], strict=True))))
                    a += 2 + 2 * nfields + END_VALUES
        return stored

    @classmethod
    def of_entries(
        cls,
        entries: Sequence[Entry],
        leases: Mapping[str, str],
        *,
        cluster: bool = False,
        usage: UsageKeys | None = None,
        tenants: Mapping[str, str] | None = None,
    ) -> WriteBatch:
        """A batch of whole entries (in order; token entries of a stream with contiguous
        ids), for callers that hold entries rather than an engine's columns. A terminal
        entry counts under the stream's tenant in `tenants` (absent: `-`) and the
        `input_tokens` its fields give."""
        batch = cls(cluster=cluster, usage=usage)
        open_part: tuple[str, list[Any], int] | None = None  # key, args, next seq
        pending: list[tuple[int, str, float | str, str]] = []

        def flush() -> None:
            if open_part is not None and pending:
                ids, texts, logprobs, tops = (list(c) for c in zip(*pending, strict=True))
                with_logprobs = any(logprob != "" for logprob in logprobs)
                with_tops = any(top != "" for top in tops)
                batch.tokens(
                    open_part[1], ids, texts,
                    logprobs if with_logprobs else None, tops if with_tops else None,
                )  # fmt: skip
            pending.clear()

        for key, seq_id, fields in entries:
            seq = int(seq_id.rsplit("-", 1)[1]) if seq_id else 0
            if (
                open_part is None
                or open_part[0] != key
                or (fields["event"] == TOKEN and open_part[2] != seq)
            ):
                flush()
                slot = key_slot(key.encode()) if cluster else 0
                args = batch.begin((key, lease_key(key)), slot, leases.get(key, ""), seq or 1)
                open_part = (key, args, seq)
            if fields["event"] == TOKEN:
                pending.append(
                    (
                        int(fields["token_id"]),
                        str(fields["text"]),
                        fields.get("logprob", ""),
                        str(fields.get("top_logprobs", "")),
                    )
                )
                open_part = (key, open_part[1], seq + 1)
            else:
                flush()
                tenant = None if tenants is None else tenants.get(key)
                batch.end(open_part[1], seq_id, fields, tenant, int(fields.get("input_tokens", 0)))
                open_part = None
        flush()
        return batch


def top_json(pairs: Sequence[tuple[int, float]] | None) -> str:
    """One token's top logprobs as the entry's `top_logprobs` field: compact JSON
    `[[id,logprob],...]` (floats as their shortest round-tripping text); '' for none.
    A pair whose log probability is not finite (-inf: a token the model ruled out) is
    left out: JSON has no such number, and it is no likely token."""
    if pairs is None:
        return ""
    finite = [[int(t), float(lp)] for t, lp in pairs if math.isfinite(lp)]
    return json.dumps(finite, separators=(",", ":"))
