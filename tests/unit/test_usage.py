"""Tenants and usage, the parts that need no service: the job field, the key layout and
its hash slots, and the usage values a terminal entry carries in a batch."""

from __future__ import annotations

import json

import pytest
from redis.crc import key_slot

from trtllm_worker.contract.errors import InvalidJob
from trtllm_worker.contract.job import Job, JobLimits, parse_job
from trtllm_worker.contract.stream import Fields
from trtllm_worker.streams.usage import (
    NO_TENANT,
    UsageKeys,
    slot_tags,
    usage_day,
    usage_key,
    usage_pattern,
    utc_day,
)
from trtllm_worker.streams.wire import Entry, WriteBatch

LIMITS = JobLimits(max_new_tokens=100, default_max_new_tokens=10)


def parse(**fields: object) -> Job:
    body = json.dumps({"request_id": "r1", "inputs": "x", **fields}).encode()
    return parse_job(body, content_type=None, message_id=None, limits=LIMITS)


@pytest.mark.parametrize("tenant", ["acme", "a", "Team-7.eu:prod_1", "t" * 64])
def test_a_tenant_has_the_characters_of_a_request_id(tenant: str) -> None:
    assert parse(tenant=tenant).tenant == tenant


@pytest.mark.parametrize("tenant", ["", "t" * 65, "-acme", "a b", "ünïcode", 7, None])
def test_a_malformed_tenant_is_an_invalid_request_naming_tenant(tenant: object) -> None:
    if tenant is None:  # null is "no tenant"
        assert parse(tenant=tenant).tenant is None
        return
    with pytest.raises(InvalidJob) as caught:
        parse(tenant=tenant)
    assert caught.value.code == "invalid_request"
    assert caught.value.message.startswith("tenant: ")
    assert caught.value.tenant is None  # counted as `-`


def test_an_invalid_job_keeps_its_readable_tenant() -> None:
    with pytest.raises(InvalidJob) as caught:
        parse(tenant="acme", parameters={"top_p": 2})
    assert caught.value.tenant == "acme"
    with pytest.raises(InvalidJob) as limited:
        parse(tenant="acme", parameters={"max_new_tokens": 1000})
    assert limited.value.tenant == "acme"


def test_every_slot_has_a_short_tag_that_hashes_to_it() -> None:
    tags = slot_tags()
    assert len(tags) == 16384
    assert all(key_slot(tag.encode()) == slot for slot, tag in enumerate(tags))
    assert max(map(len, tags)) <= 5


@pytest.mark.parametrize("prefix", ["gen:", "test:ab12:", "{pinned}:"])
def test_a_cluster_usage_key_shares_its_streams_slot(prefix: str) -> None:
    keys = UsageKeys(prefix, 60, cluster=True)
    for request_id in ("a", "r-1", "job:2", "x" * 128):
        stream = prefix + request_id
        key = keys.key(stream, "2025-01-02")
        assert key_slot(key.encode()) == key_slot(stream.encode())
        assert usage_day(prefix, key) == "2025-01-02"


def test_one_node_has_one_usage_key_a_day() -> None:
    keys = UsageKeys("gen:", 60)
    assert keys.key("gen:a", "2025-01-02") == keys.key("gen:b", "2025-01-02")
    assert keys.key("gen:a", "2025-01-02") == usage_key("gen:", "2025-01-02")
    assert usage_key("gen:", "2025-01-02") == "gen:_usage:2025-01-02"
    assert keys.values("gen:a", None, 3)[1:] == (60, NO_TENANT, 3, "")
    assert keys.values("gen:a", "t", 3, "sql")[2:] == ("t", 3, "sql")


def test_no_stream_key_is_a_usage_key() -> None:
    """A request id begins with a letter or digit, so `<prefix>_usage:` is never a
    stream; and the reader takes only well-formed usage keys of its own prefix."""
    assert usage_day("gen:", "gen:usage:2025-01-02") is None
    assert usage_day("gen:", "gen:_usage:2025-01-02") == "2025-01-02"
    assert usage_day("gen:", "gen:_usage:2025-01-02:{3fa}") == "2025-01-02"
    assert usage_day("gen:", "gen:x_usage:2025-01-02") is None
    assert usage_day("gen:", "other:_usage:2025-01-02") is None
    assert usage_day("gen:", "gen:_usage:2025-01-02:junk") is None


def test_the_scan_pattern_escapes_the_prefix() -> None:
    assert usage_pattern("gen:") == "gen:_usage:*"
    assert usage_pattern("a*b?[c]\\") == "a\\*b\\?\\[c\\]\\\\_usage:*"


def test_utc_day() -> None:
    assert utc_day(0) == "1970-01-01"
    assert utc_day(86400 * 365 - 1) == "1970-12-31"


def test_a_job_ending_after_midnight_counts_into_the_new_day(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The day is formatted once per day: the first terminal entry after midnight UTC
    names the next day's key, not the cached one."""
    midnight = 86400 * 20_000.0  # 2024-10-04T00:00:00Z
    keys = UsageKeys("gen:", 60)
    monkeypatch.setattr("trtllm_worker.streams.usage.time.time", lambda: midnight - 0.001)
    before = keys.values("gen:a", None, 1)[0]
    assert keys.values("gen:b", None, 1)[0] == before == "gen:_usage:2024-10-03"
    monkeypatch.setattr("trtllm_worker.streams.usage.time.time", lambda: midnight)
    assert keys.values("gen:a", None, 1)[0] == "gen:_usage:2024-10-04"


def test_a_terminal_entry_carries_its_usage_and_batches_still_split_and_read_back() -> None:
    keys = UsageKeys("gen:", 60)
    done: Fields = {"event": "done", "finish_reason": "length", "generated_tokens": 1,
            "input_tokens": 4, "generated_text": "a"}  # fmt: skip
    token: Fields = {"event": "token", "index": 0, "token_id": 97, "text": "a"}
    entries: list[Entry] = [("gen:a", "0-1", token), ("gen:a", "0-2", done), ("gen:b", "", done)]
    batch = WriteBatch.of_entries(entries, {}, usage=keys, tenants={"gen:a": "acme"})
    _, values = batch.calls[0]
    day_key = usage_key("gen:", utc_day())
    at = [i for i, value in enumerate(values) if value == day_key]
    assert [values[i : i + 5] for i in at] == [
        [day_key, 60, "acme", 4, ""],
        [day_key, 60, "-", 4, ""],
    ]
    assert batch.entries() == entries
    assert [key for key, _ in batch.per_stream()] == ["gen:a", "gen:b"]
    assert [one.entries() for _, one in batch.per_stream()] == [entries[:2], entries[2:]]
    uncounted = WriteBatch.of_entries(entries, {})
    assert uncounted.calls[0][1][-7:-2] == ["", 0, "", 0, ""]
