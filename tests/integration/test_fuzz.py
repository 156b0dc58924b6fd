"""Any bytes on the queue end as a completed job or a dead letter with a reason; the
worker never crashes and its memory stays flat. `make fuzz` runs many more cases
(FUZZ_EXAMPLES)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.integration.conftest import Producer, Spawn, Subscriber, xread
from trtllm_worker.contract.job import MAX_BODY_BYTES, valid_request_id

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
job_fields = st.sampled_from(
    ["request_id", "inputs", "input_ids", "parameters", "deadline", "metadata", "extra"]
)
parameter_fields = st.sampled_from(
    [
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "stop",
        "seed",
        "truncate",
        "ignore_eos",
        "return_logprobs",
        "do_sample",
        "repetition_penalty",
        "bogus",
    ]
)
near_valid_jobs = st.fixed_dictionaries(
    {"inputs": st.text(min_size=1, max_size=60)},
    optional={
        "parameters": st.dictionaries(
            parameter_fields,
            st.one_of(json_values, st.integers(min_value=0, max_value=40)),
            max_size=4,
        ),
        "metadata": json_values,
        "deadline": st.one_of(st.text(max_size=30), st.just("2999-01-01T00:00:00Z")),
    },
)
bodies = st.one_of(
    st.binary(max_size=300),
    st.dictionaries(job_fields, json_values, max_size=5).map(
        lambda d: json.dumps(d, ensure_ascii=False).encode()
    ),
    near_valid_jobs.map(lambda d: json.dumps(d).encode()),
    st.integers(min_value=100, max_value=50_000).map(lambda n: b"[" * n + b"]" * n),
    st.just(b'{"inputs": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}'),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", errors="surrogatepass")),
)
content_types = st.sampled_from([None, "application/json", "text/plain", "application/json; x=1"])


def generate(count: int) -> list[tuple[bytes, str | None]]:
    """`count` (body, content type) cases drawn by hypothesis."""
    drawn: list[tuple[bytes, str | None]] = []

    @settings(
        max_examples=count,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(bodies, content_types)
    def draw(body: bytes, content_type: str | None) -> None:
        drawn.append((body, content_type))

    draw()
    return drawn


def with_unique_id(body: bytes) -> bytes:
    """Give a readable request id a fresh value, so that cases cannot collide."""
    try:
        data: Any = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if isinstance(data, dict) and valid_request_id(data.get("request_id")):
        data["request_id"] = f"fz-{uuid.uuid4().hex}"
        return json.dumps(data).encode()
    return body


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def run_cases(
    cases: list[tuple[bytes, str | None]], producer: Producer, subscriber: Subscriber
) -> None:
    """Publish every case; wait until each is dead-lettered or has a terminal entry."""
    expected: dict[str, bytes] = {}
    for body, content_type in cases:
        message_id = f"fz-{uuid.uuid4().hex}"
        body = with_unique_id(body)
        expected[message_id] = body
        await producer.publish(body, message_id=message_id, content_type=content_type)
    dead_queue = await producer.channel.get_queue(f"{producer.queue}.dead")
    settled: dict[str, str] = {}
    async with asyncio.timeout(120):
        while len(settled) < len(expected):
            while (message := await dead_queue.get(no_ack=True, fail=False)) is not None:
                assert message.message_id in expected
                assert message.headers["x-error-code"]
                assert message.headers["x-error-message"]
                settled[str(message.message_id)] = "dead"
            open_ids = {i: request_id_of(i, expected[i]) for i in expected if i not in settled}
            keys = {subscriber.key(r): i for i, r in open_ids.items() if r is not None}
            if keys:
                reply = await xread(subscriber.redis, dict.fromkeys(keys, "0"), count=10_000)
                for key, items in reply:
                    if items[-1][1]["event"] in ("done", "error"):
                        settled.setdefault(keys[key], "stream")
            await asyncio.sleep(0.05)


def request_id_of(message_id: str, body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return message_id
    if isinstance(data, dict) and "request_id" in data:
        return valid_request_id(data["request_id"])
    return message_id


async def test_any_bytes_end_completed_or_dead_lettered(
    spawn: Spawn, producer: Producer, subscriber: Subscriber
) -> None:
    worker = await spawn(WORKER_MAX_NEW_TOKENS="64", WORKER_DEFAULT_MAX_NEW_TOKENS="8")
    cases = generate(EXAMPLES)
    half = len(cases) // 2
    await run_cases(cases[:half], producer, subscriber)
    warm = rss_kib(worker.pid)
    await run_cases(cases[half:], producer, subscriber)
    after = rss_kib(worker.pid)
    assert worker.process.returncode is None, worker.log()
    assert "Traceback" not in worker.log()
    # flat: the second half of the cases adds at most a little (allocator slack)
    assert after - warm < max(warm // 5, 16 * 1024), (warm, after)


def test_cases_cover_both_outcomes() -> None:
    """The generator produces runnable jobs as well as garbage (else the test above
    proves little)."""
    cases = generate(200)
    runnable = sum(
        1
        for body, ctype in cases
        if ctype in (None, "application/json", "application/json; x=1")
        and body.startswith(b'{"inputs"')
    )
    assert runnable > 10
    assert len(cases) - runnable > 50
