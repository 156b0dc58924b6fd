"""The core without a broker: the store's fenced writes, leases, the output pump and
the job runner, on the real Redis (the store is Redis: a fake would prove nothing)
with a fake looper (the engine thread is `test_looper.py`'s business)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from tests.services import ServiceUrls
from trtllm_worker.broker.settle import Settler, outcome_of
from trtllm_worker.config import REDIS_MAX_TTL_S, Settings
from trtllm_worker.connect.redis import redis_client
from trtllm_worker.contract.errors import (
    DeadlineExceeded,
    DeliveryLimitExceeded,
    HandBack,
    StreamUnusable,
)
from trtllm_worker.contract.job import Job
from trtllm_worker.contract.stream import Fields, FinishReason, error_fields, lease_key
from trtllm_worker.engine.base import EngineOutput, EngineRequest
from trtllm_worker.engine.looper import Looper
from trtllm_worker.ops.metrics import Metrics
from trtllm_worker.pipeline.intake import Intake
from trtllm_worker.pipeline.leases import Leases
from trtllm_worker.pipeline.output import OutputProcessor, RequestState
from trtllm_worker.pipeline.pump import Inbox, OutputPump
from trtllm_worker.pipeline.runner import JobRunner
from trtllm_worker.streams.store import ENTRIES_LOST_REASON, Ended, StreamStore
from trtllm_worker.streams.wire import AFTER_TAIL, WriteBatch
from trtllm_worker.tokenizer import builtin_byte_tokenizer, load_tokenizer


@pytest.fixture
async def redis(services: ServiceUrls) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(services.redis, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
async def store(
    services: ServiceUrls, redis: aioredis.Redis, prefix: str
) -> AsyncIterator[StreamStore]:
    made = StreamStore(redis_client(services.redis, client_name="test"), ttl_s=60, lease_ttl_s=1.0)
    yield made
    await made.close()
    keys = [k async for k in redis.scan_iter(match=f"*{prefix}*")]
    if keys:
        await redis.delete(*keys)


def token(index: int, token_id: int, text: str) -> tuple[str, dict[str, Any]]:
    return f"0-{index + 1}", {"event": "token", "index": index, "token_id": token_id, "text": text}


async def entries(redis: aioredis.Redis, key: str) -> list[dict[str, str]]:
    reply = cast(list[tuple[str, dict[str, str]]], await redis.xrange(key))
    return [fields for _, fields in reply]


# -- store --------------------------------------------------------------------------


async def test_fenced_write_appends_only_for_the_lease_holder(
    store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    key = prefix + "a"
    assert await store.start(key, "mine") is not None
    seq, fields = token(0, 97, "a")
    assert await store.write(WriteBatch.of_entries([(key, seq, fields)], {key: "mine"})) == {}
    seq, fields = token(1, 98, "b")
    refused = await store.write(WriteBatch.of_entries([(key, seq, fields)], {key: "stale"}))
    assert refused[key].startswith("the lease was lost")
    assert [e["text"] for e in await entries(redis, key)] == ["a"]


async def test_what_a_batch_says_it_stores_is_what_redis_holds(
    store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    """The script builds each entry from the batch's columns: ids, indices, field names
    and logprobs (present, absent for a token without one) come out as the batch's own
    view of them, for several streams and parts of one stream in one call."""
    tokenizer = builtin_byte_tokenizer()
    processor = OutputProcessor()
    states = []
    for n, logprobs in enumerate((True, False)):
        key = f"{prefix}cols-{n}"
        await store.start(key, f"lease-{n}")
        state = RequestState(
            request_id=f"cols-{n}", key=key, engine_id=n + 1, tokenizer=tokenizer,
            prompt_ids=[97], input_tokens=1, return_logprobs=logprobs, lease=f"lease-{n}",
        )  # fmt: skip
        processor.add(state)
        states.append(state)
    batch = processor.process(
        [
            EngineOutput(1, [98, 99], [-0.5, None]),
            EngineOutput(2, [100]),
            EngineOutput(1, [101], [-1.25], finish=FinishReason.LENGTH),
            EngineOutput(2, [102, 103], finish=FinishReason.EOS_TOKEN),
        ]
    )
    assert await store.write(batch.write) == {}
    expected: dict[str, list[dict[str, str]]] = {s.key: [] for s in states}
    for key, entry_id, fields in batch.entries:
        expected[key].append({"id": entry_id, **{k: str(v) for k, v in fields.items()}})
    for state in states:
        stored = cast(list[tuple[str, dict[str, str]]], await redis.xrange(state.key))
        assert [{"id": i, **f} for i, f in stored] == expected[state.key]
    first = cast(list[tuple[str, dict[str, str]]], await redis.xrange(states[0].key))
    logprob_stream = [f for _, f in first]
    assert [f.get("logprob") for f in logprob_stream] == ["-0.5", None, "-1.25", None]
    assert [f["index"] for f in logprob_stream[:3]] == ["0", "1", "2"]


async def test_top_logprobs_columns_are_stored_as_json_beside_logprobs(
    store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    """Top logprobs travel as one more column: each token entry gets its compact JSON,
    none where the engine gave none (or a stop token's), non-finite pairs left out;
    the same entries rebuilt from whole entries (`of_entries`) and written stream by
    stream (`per_stream`) store the same."""
    tokenizer = builtin_byte_tokenizer()
    processor = OutputProcessor()
    key = f"{prefix}top"
    await store.start(key, "lease")
    processor.add(
        RequestState(
            request_id="top", key=key, engine_id=1, tokenizer=tokenizer, prompt_ids=[97],
            input_tokens=1, return_logprobs=True, top_logprobs=2, lease="lease",
        )
    )  # fmt: skip
    batch = processor.process(
        [
            EngineOutput(1, [98, 99], [-0.5, None], top_logprobs=[[(98, -0.5), (7, -2.0)], None]),
            EngineOutput(
                1, [100], [-0.25], FinishReason.LENGTH,
                top_logprobs=[[(100, -0.25), (3, float("-inf"))]],
            ),
        ]
    )  # fmt: skip
    assert await store.write(batch.write) == {}
    stored = await entries(redis, key)
    assert [e.get("top_logprobs") for e in stored] == [
        "[[98,-0.5],[7,-2.0]]",
        None,
        "[[100,-0.25]]",
        None,
    ]
    assert [e.get("logprob") for e in stored] == ["-0.5", None, "-0.25", None]
    expected = [{k: str(v) for k, v in fields.items()} for _, _, fields in batch.entries]
    assert stored == expected
    for n, rebuilt in enumerate(
        (
            WriteBatch.of_entries(batch.entries, {key: "lease"}),
            *(one for _, one in batch.write.per_stream()),
        )
    ):
        again = f"{prefix}top-{n}"
        await store.start(again, "lease")
        moved = [(again, entry_id, fields) for _, entry_id, fields in rebuilt.entries()]
        assert await store.write(WriteBatch.of_entries(moved, {again: "lease"})) == {}
        assert await entries(redis, again) == expected


async def test_a_retried_batch_stores_no_index_twice(
    store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    key = prefix + "b"
    await store.start(key, "t")
    batch = [(key, *token(0, 97, "a")), (key, *token(1, 98, "b"))]
    assert await store.write(WriteBatch.of_entries(batch, {key: "t"})) == {}
    assert await store.write(WriteBatch.of_entries(batch, {key: "t"})) == {}
    assert [e["index"] for e in await entries(redis, key)] == ["0", "1"]


async def test_the_terminal_entry_ends_the_stream(
    store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    key = prefix + "c"
    await store.start(key, "t")
    done = {"event": "done", "finish_reason": "length", "generated_tokens": 1}
    batch = [(key, *token(0, 97, "a")), (key, "0-2", done)]
    assert await store.write(WriteBatch.of_entries(batch, {key: "t"})) == {}
    assert 0 < await redis.ttl(key) <= 60
    assert not await redis.exists(lease_key(key))  # released with the terminal entry
    assert (await entries(redis, key))[-1]["event"] == "done"


async def test_the_longest_stream_ttl_the_settings_allow_is_one_redis_takes(
    services: ServiceUrls, redis: aioredis.Redis, prefix: str
) -> None:
    """WORKER_STREAM_TTL_S at its bound: the terminal entry's EXPIRE, the cancel mark's
    SET EX and the delivery counter's EXPIRE are all accepted."""
    longest = StreamStore(redis_client(services.redis, client_name="test"), ttl_s=REDIS_MAX_TTL_S)
    key = prefix + "ttl"
    try:
        await longest.start(key, "t")
        done = {"event": "done", "finish_reason": "length", "generated_tokens": 1}
        batch = [(key, *token(0, 97, "a")), (key, "0-2", done)]
        assert await longest.write(WriteBatch.of_entries(batch, {key: "t"})) == {}
        assert await redis.ttl(key) > REDIS_MAX_TTL_S - 60
        await longest.mark_cancelled(prefix + "other")
        assert await longest.count_delivery(prefix + "other") == 1
    finally:
        await longest.close()


async def test_an_unleased_end_never_overwrites_a_stream_another_worker_owns(
    store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    """An invalid job's error entry (written before any lease exists) lands only where
    no worker holds the request's lease."""
    key = prefix + "d"
    await store.start(key, "other-worker")
    await store.write(WriteBatch.of_entries([(key, *token(0, 97, "a"))], {key: "other-worker"}))
    assert await store.end(key, error_fields("invalid_request", "bad")) is Ended.NOT_OURS
    assert [e["event"] for e in await entries(redis, key)] == ["token"]
    await store.release_leases({key: "other-worker"})
    assert await store.end(key, error_fields("invalid_request", "bad")) is Ended.STORED
    assert [e["event"] for e in await entries(redis, key)] == ["token", "error"]
    assert await store.end(key, error_fields("invalid_request", "again")) is Ended.ALREADY_ENDED
    assert 0 < await redis.ttl(key) <= 60


async def keep_only(redis: aioredis.Redis, key: str, count: int) -> None:
    """The stream as a promoted replica holds it when it never got the entries after the
    first `count` (XDEL would not do: the stream would remember its last id)."""
    kept = cast(list[tuple[str, dict[str, str]]], await redis.xrange(key, count=count))
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        for entry_id, fields in kept:
            pipe.xadd(key, cast(Any, fields), id=entry_id)
        await pipe.execute()


async def test_a_stream_that_lost_entries_is_not_written_on(
    store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    """After a failover that lost writes (the promoted replica never got 0-2 and 0-3),
    writing 0-4 would leave a hole in the indices: the fence refuses it."""
    key = prefix + "gap"
    await store.start(key, "t")
    batch = [(key, *token(i, 97 + i, "abc"[i])) for i in range(3)]
    assert await store.write(WriteBatch.of_entries(batch, {key: "t"})) == {}
    await keep_only(redis, key, 1)  # what the new master holds
    refused = await store.write(WriteBatch.of_entries([(key, *token(3, 100, "d"))], {key: "t"}))
    assert refused == {key: ENTRIES_LOST_REASON}
    done: Fields = {"event": "done", "finish_reason": "length", "generated_tokens": 4}
    assert await store.end(key, done, "t", "0-5") is Ended.ENTRIES_LOST
    assert [e["index"] for e in await entries(redis, key)] == ["0"]
    # the stream as it is can be continued: the next entry is 0-2
    assert await store.write(WriteBatch.of_entries([(key, *token(1, 98, "b"))], {key: "t"})) == {}


async def test_a_key_that_is_not_a_stream_is_refused_for_good(
    store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    key = prefix + "e"
    await redis.set(key, "not a stream")
    with pytest.raises(StreamUnusable):
        await store.start(key, "t")
    with pytest.raises(StreamUnusable):
        await store.end(key, error_fields("invalid_request", "bad"), seq_id=AFTER_TAIL)
    refused = await store.write(WriteBatch.of_entries([(key, *token(0, 97, "a"))], {}))
    assert "WRONGTYPE" in refused[key]


# -- leases -------------------------------------------------------------------------


async def test_a_lease_held_elsewhere_is_waited_out(store: StreamStore, prefix: str) -> None:
    key = prefix + "f"
    assert await store.start(key, "gone-worker") is not None  # expires after 1 s
    leases = Leases(store, ttl_s=1.0)
    attempts = 0

    async def start() -> Any:
        nonlocal attempts
        attempts += 1
        return await store.start(key, "mine")

    await asyncio.wait_for(leases.take(key, "mine", start, lambda: False), 5)
    assert attempts > 1
    assert leases.token(key) == "mine"


async def test_a_stopping_worker_gives_up_waiting_for_a_lease(
    store: StreamStore, prefix: str
) -> None:
    key = prefix + "g"
    await store.start(key, "other")
    leases = Leases(store, ttl_s=1.0)
    with pytest.raises(HandBack):
        await leases.take(key, "mine", lambda: store.start(key, "mine"), lambda: True)


async def test_renewing_reports_a_lease_lost(
    store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    kept, lost = prefix + "h1", prefix + "h2"
    leases = Leases(store, ttl_s=1.0)
    for key in (kept, lost):
        await leases.take(key, "mine", lambda key=key: store.start(key, "mine"), lambda: False)  # type: ignore[misc]
    await redis.set(lease_key(lost), "thief")
    reported: list[str] = []
    await leases.renew(reported.append)
    assert reported == [lost]
    assert leases.token(kept) == "mine"
    assert leases.token(lost) == ""


# -- runner and pump ------------------------------------------------------------------


class FakeLooper:
    """Records what the runner hands the engine thread."""

    def __init__(self) -> None:
        self.submitted: list[EngineRequest] = []
        self.cancelled: list[int] = []
        self.new: asyncio.Queue[EngineRequest] = asyncio.Queue()

    def submit(self, request: EngineRequest) -> None:
        self.submitted.append(request)
        self.new.put_nowait(request)

    def cancel(self, engine_id: int) -> None:
        self.cancelled.append(engine_id)

    def consumed(self, batches: int) -> None:
        pass


class Pipeline:
    def __init__(self, store: StreamStore, prefix: str) -> None:
        self.settings = Settings(_env_file=None, stream_prefix=prefix, lease_ttl_s=1.0)
        self.metrics = Metrics()
        self.leases = Leases(store, ttl_s=1.0)
        self.looper = FakeLooper()
        looper = cast(Looper, self.looper)
        self.inbox = Inbox()
        self.pump = OutputPump(self.settings, store, self.leases, self.metrics, looper, self.inbox)
        intake = Intake(self.settings, load_tokenizer(None, None))
        self.runner = JobRunner(
            self.settings, intake, store, self.leases, self.pump, looper, self.metrics
        )

    async def submitted(self) -> EngineRequest:
        """The next request handed to the engine thread."""
        return await self.looper.new.get()


@pytest.fixture
async def pipeline(store: StreamStore, prefix: str) -> AsyncIterator[Pipeline]:
    made = Pipeline(store, prefix)
    pump = asyncio.create_task(made.pump.run())
    yield made
    pump.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pump
    await made.pump.wait_background()


def job(request_id: str, **fields: Any) -> Job:
    return Job.model_validate({"request_id": request_id, "inputs": "abc", **fields})


async def test_runner_publishes_what_the_engine_returns(
    pipeline: Pipeline, redis: aioredis.Redis, prefix: str
) -> None:
    run = asyncio.create_task(pipeline.runner.run(job("r1", parameters={"max_new_tokens": 3}), 0))
    request = await pipeline.submitted()
    assert (request.prompt_ids, request.max_new_tokens) == ([97, 98, 99], 3)
    pipeline.inbox.put([EngineOutput(request.id, [97, 98])], 0.0)
    pipeline.inbox.put([EngineOutput(request.id, [99], finish=FinishReason.LENGTH)], 0.0)
    result = await run
    assert result.terminal is not None
    assert result.terminal.generated_tokens == 3
    stored = await entries(redis, prefix + "r1")
    assert [e.get("text") for e in stored[:-1]] == ["a", "b", "c"]
    assert stored[-1]["generated_text"] == "abc"
    assert len(pipeline.leases) == 0  # nothing leaked
    assert len(pipeline.pump) == 0


async def test_runner_resumes_after_the_stored_tokens(
    pipeline: Pipeline, store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    key = prefix + "r2"
    await store.start(key, "earlier")
    await store.write(
        WriteBatch.of_entries(
            [(key, *token(0, 97, "a")), (key, *token(1, 98, "b"))], {key: "earlier"}
        )
    )
    await store.release_leases({key: "earlier"})
    run = asyncio.create_task(pipeline.runner.run(job("r2", parameters={"max_new_tokens": 4}), 0))
    request = await pipeline.submitted()
    assert (request.prompt_ids, request.max_new_tokens, request.resumed_tokens) == (
        [97, 98, 99, 97, 98],
        2,
        2,
    )
    pipeline.inbox.put([EngineOutput(request.id, [99, 97], finish=FinishReason.LENGTH)], 0)
    await run
    stored = await entries(redis, key)
    assert [e["index"] for e in stored[:-1]] == ["0", "1", "2", "3"]
    assert stored[-1]["generated_text"] == "abca"
    assert pipeline.metrics.resumed._value.get() == 1


async def test_a_cancel_before_the_job_starts_ends_it_with_what_was_stored(
    pipeline: Pipeline, store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    key = prefix + "r3"
    await store.start(key, "earlier")
    await store.write(WriteBatch.of_entries([(key, *token(0, 97, "a"))], {key: "earlier"}))
    await store.release_leases({key: "earlier"})
    await store.mark_cancelled(key)
    result = await pipeline.runner.run(job("r3"), 0)
    assert result.terminal is not None
    done = (await entries(redis, key))[-1]
    assert (done["finish_reason"], done["generated_tokens"], done["generated_text"]) == (
        "cancelled",
        "1",
        "a",
    )
    assert pipeline.looper.submitted == []


async def test_a_passed_deadline_is_not_run(pipeline: Pipeline) -> None:
    with pytest.raises(DeadlineExceeded):
        await pipeline.runner.run(job("r4", deadline="2001-01-01T00:00:00Z"), 0)
    assert pipeline.looper.submitted == []
    assert len(pipeline.leases) == 0  # handed to the error entry, not tracked


async def test_a_resumed_job_whose_deadline_passed_ends_done_with_what_was_stored(
    pipeline: Pipeline, store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    """The deadline passed while the job was handed over: it had started, so it ends as
    a running job does at its deadline (done, deadline, the published text), not with
    `deadline_exceeded`."""
    key = prefix + "r4b"
    await store.start(key, "earlier")
    await store.write(
        WriteBatch.of_entries(
            [(key, *token(0, 97, "a")), (key, *token(1, 98, "b"))], {key: "earlier"}
        )
    )
    await store.release_leases({key: "earlier"})
    result = await pipeline.runner.run(job("r4b", deadline="2001-01-01T00:00:00Z"), 0)
    assert result.terminal is not None
    stored = await entries(redis, key)
    assert [e["event"] for e in stored] == ["token", "token", "done"]
    done = stored[-1]
    assert (done["finish_reason"], done["generated_tokens"], done["generated_text"]) == (
        "deadline",
        "2",
        "ab",
    )
    assert pipeline.looper.submitted == []
    assert not await redis.exists(lease_key(key))


async def test_cancel_reaches_the_engine_and_ends_cancelled(
    pipeline: Pipeline, redis: aioredis.Redis, prefix: str
) -> None:
    run = asyncio.create_task(pipeline.runner.run(job("r5"), 0))
    request = await pipeline.submitted()
    assert pipeline.runner.cancel("r5") is True
    assert pipeline.looper.cancelled == [request.id]
    pipeline.inbox.put([EngineOutput(request.id, [], finish=FinishReason.CANCELLED)], 0)
    await run
    assert (await entries(redis, prefix + "r5"))[-1]["finish_reason"] == "cancelled"


async def test_a_lost_lease_hands_the_job_back_and_stops_its_writes(
    pipeline: Pipeline, redis: aioredis.Redis, prefix: str
) -> None:
    key = prefix + "r6"
    run = asyncio.create_task(pipeline.runner.run(job("r6"), 0))
    request = await pipeline.submitted()
    await redis.set(lease_key(key), "another-worker")
    pipeline.inbox.put([EngineOutput(request.id, [97])], 0)
    with pytest.raises(HandBack):
        await run
    assert await entries(redis, key) == []
    assert pipeline.looper.cancelled == [request.id]  # out of the engine too
    assert len(pipeline.pump) == 0


async def test_lost_entries_hand_the_job_back_to_resume_from_the_stream(
    pipeline: Pipeline, redis: aioredis.Redis, prefix: str
) -> None:
    key = prefix + "r7"
    run = asyncio.create_task(pipeline.runner.run(job("r7", parameters={"max_new_tokens": 4}), 0))
    request = await pipeline.submitted()
    pipeline.inbox.put([EngineOutput(request.id, [97, 98])], 0)
    while await redis.xlen(key) < 2:
        await pipeline.pump.wait_background()
    await keep_only(redis, key, 1)  # a failover lost the last write
    pipeline.inbox.put([EngineOutput(request.id, [99])], 0)
    with pytest.raises(HandBack, match="resumes from what the stream holds"):
        await run
    assert pipeline.looper.cancelled == [request.id]
    assert not await redis.exists(lease_key(key))  # released for the next taker
    again = asyncio.create_task(pipeline.runner.run(job("r7", parameters={"max_new_tokens": 4}), 0))
    resumed = await pipeline.submitted()
    assert resumed.resumed_tokens == 1
    pipeline.inbox.put([EngineOutput(resumed.id, [98, 99, 97], finish=FinishReason.LENGTH)], 0)
    await again
    stored = await entries(redis, key)
    assert [e["index"] for e in stored[:-1]] == ["0", "1", "2", "3"]
    assert stored[-1]["generated_text"] == "abca"


async def test_a_batch_redis_refuses_for_good_fails_only_the_stream_at_fault(
    pipeline: Pipeline, redis: aioredis.Redis, prefix: str
) -> None:
    """One stream's lease key became a hash: the write script's fence (GET) fails with
    WRONGTYPE, which fails the whole call, every time. Not an outage: the streams are
    written one by one, the one at fault fails, the others go on to their end."""
    names = ["w1", "w2", "w3"]
    runs = {n: asyncio.create_task(pipeline.runner.run(job(n), 0)) for n in names}
    for _ in names:
        await pipeline.submitted()
    requests = {s.request_id: s.engine_id for s in pipeline.pump.states()}
    bad = prefix + "w2"
    await redis.delete(lease_key(bad))
    await redis.hset(lease_key(bad), "not", "a lease")
    pipeline.inbox.put([EngineOutput(requests[n], [97]) for n in names], 0)
    pipeline.inbox.put(
        [EngineOutput(requests[n], [98], finish=FinishReason.LENGTH) for n in names], 0
    )
    async with asyncio.timeout(10):
        with pytest.raises(StreamUnusable, match="WRONGTYPE"):
            await runs["w2"]
        for good in ("w1", "w3"):
            result = await runs[good]
            assert result.terminal is not None
            stored = await entries(redis, prefix + good)
            assert [e["event"] for e in stored] == ["token", "token", "done"]
            assert stored[-1]["generated_text"] == "ab"
    assert await entries(redis, bad) == []
    assert len(pipeline.pump) == 0
    assert pipeline.pump.redis_healthy


async def test_hand_back_all_releases_the_leases(
    pipeline: Pipeline, redis: aioredis.Redis, prefix: str
) -> None:
    runs = [asyncio.create_task(pipeline.runner.run(job(f"h{i}"), 0)) for i in range(3)]
    for _ in range(3):
        await pipeline.submitted()
    assert pipeline.runner.hand_back_all("the broker connection was lost") == 3
    for run in runs:
        with pytest.raises(HandBack):
            await run
    assert len(pipeline.leases) == 0
    await pipeline.pump.wait_background()
    # released, so the next owner need not wait for them to expire
    assert await redis.exists(*(lease_key(f"{prefix}h{i}") for i in range(3))) == 0


async def test_an_error_found_under_the_lease_is_written_with_it(
    pipeline: Pipeline, store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    """A passed deadline is found after the lease was taken: its error entry goes
    through that lease's fence (which releases it), never around it."""
    key = prefix + "d1"
    with pytest.raises(DeadlineExceeded) as caught:
        await pipeline.runner.run(job("d1", deadline="2001-01-01T00:00:00Z"), 0)
    error = caught.value
    assert error.lease
    assert await redis.get(lease_key(key)) == error.lease  # kept for the error entry
    settler = Settler(pipeline.settings, store, pipeline.metrics, lambda: None)

    class Message:
        message_id = None
        calls: list[str] = []  # noqa: RUF012

        async def ack(self) -> None:
            self.calls.append("ack")

    message = Message()
    await settler.settle(cast(Any, message), outcome_of(error))
    assert message.calls == ["ack"]
    stored = await entries(redis, key)
    assert [e["event"] for e in stored] == ["error"]
    assert stored[0]["code"] == "deadline_exceeded"
    assert not await redis.exists(lease_key(key))


async def test_copies_of_one_request_run_once_and_the_others_find_its_end(
    pipeline: Pipeline, redis: aioredis.Redis, prefix: str
) -> None:
    """Copies of one request in hand at once (a producer's retries, redeliveries) wait
    for the copy that runs, one after another: each then finds its terminal entry and
    ends without running, as a redelivered duplicate of a finished job does."""
    copies = [
        asyncio.create_task(pipeline.runner.run(job("dup", parameters={"max_new_tokens": 2}), 0))
        for _ in range(12)
    ]
    request = await pipeline.submitted()
    pipeline.inbox.put([EngineOutput(request.id, [97, 98], finish=FinishReason.LENGTH)], 0)
    results = await asyncio.wait_for(asyncio.gather(*copies), 10)
    assert [result.terminal is not None for result in results].count(True) == 1
    assert len(pipeline.looper.submitted) == 1
    assert [e["event"] for e in await entries(redis, prefix + "dup")] == ["token", "token", "done"]
    assert pipeline.runner.cancel("dup") is False  # no copy left in hand
    assert len(pipeline.leases) == 0
    assert not await redis.exists(lease_key(prefix + "dup"))


async def test_a_job_refused_at_admission_ends_its_stream_through_its_own_lease(
    pipeline: Pipeline, store: StreamStore, redis: aioredis.Redis, prefix: str
) -> None:
    """The delivery limit is checked once the job holds its lease: a dead worker's lease
    is waited out first, and the error entry goes through the job's own lease (terminal
    entry, TTL, lease released). A copy of a finished job is not even asked."""
    key = prefix + "p1"
    await store.start(key, "dead-worker")  # expires after 1 s, never released
    await store.write(WriteBatch.of_entries([(key, *token(0, 97, "a"))], {key: "dead-worker"}))
    asked: list[str] = []

    async def over_limit() -> None:
        asked.append("p1")
        raise DeliveryLimitExceeded("delivered 4 times without finishing", request_id="p1")

    with pytest.raises(DeliveryLimitExceeded) as caught:
        await pipeline.runner.run(job("p1"), 0, admit=over_limit)
    assert caught.value.lease
    assert await redis.get(lease_key(key)) == caught.value.lease
    settler = Settler(pipeline.settings, store, pipeline.metrics, lambda: None)
    assert await settler._error_entry(cast(Any, None), caught.value)
    assert [e["event"] for e in await entries(redis, key)] == ["token", "error"]
    assert 0 < await redis.ttl(key) <= 60
    assert not await redis.exists(lease_key(key))
    again = await pipeline.runner.run(job("p1"), 0, admit=over_limit)
    assert again.terminal is None  # a duplicate of a finished job: acknowledged
    assert asked == ["p1"]
    assert pipeline.looper.submitted == []


class HeldStore(StreamStore):
    """The real store, except that a batch ending a stream, once Redis has stored it,
    waits to be let go before its reply reaches the pump: as under load, when the event
    loop runs other tasks (the lease keeper's) between the two."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stored = asyncio.Event()
        self.go = asyncio.Event()

    async def write(self, batch: WriteBatch) -> dict[str, str]:
        refused = await super().write(batch)
        if batch.ended:
            self.stored.set()
            await self.go.wait()
        return refused


async def test_a_renewal_racing_the_final_write_leaves_the_finished_job_alone(
    services: ServiceUrls, redis: aioredis.Redis, prefix: str
) -> None:
    """The final write releases the lease with the terminal entry; a renewal that runs
    after it in Redis, and whose reply the event loop handles before the write's, finds
    the lease gone. The job finished: it is not handed back (before the fix it was, and
    its already finished message went back to the queue)."""
    store = HeldStore(redis_client(services.redis, client_name="test"), ttl_s=60, lease_ttl_s=1.0)
    made = Pipeline(store, prefix)
    pump = asyncio.create_task(made.pump.run())
    try:
        run = asyncio.create_task(made.runner.run(job("race", parameters={"max_new_tokens": 2}), 0))
        request = await made.submitted()
        made.inbox.put([EngineOutput(request.id, [97, 98], finish=FinishReason.LENGTH)], 0)
        await store.stored.wait()  # the terminal entry is stored and the lease released
        await made.leases.renew(made.pump.drop_lost_lease)  # what the lease keeper does
        store.go.set()
        result = await asyncio.wait_for(run, 5)
        assert result.terminal is not None
        assert result.terminal.fields["finish_reason"] == "length"
        assert made.looper.cancelled == []
        assert len(made.leases) == 0
        assert len(made.pump) == 0
        assert [e["event"] for e in await entries(redis, prefix + "race")] == [
            "token",
            "token",
            "done",
        ]
    finally:
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
        await store.close()
        keys = [k async for k in redis.scan_iter(match=f"*{prefix}*")]
        if keys:
            await redis.delete(*keys)
