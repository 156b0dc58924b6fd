"""The `gateway` scenario's load generator, a process of its own (`python -m
bench.gateway_load CONFIG_JSON`), so that the clients do not share an event loop, or a
GIL, with the gateway or the bench. Roles:

- `gateway`: `clients` concurrent streaming clients, each on one keep-alive connection,
  POSTing streamed chat completions back to back (`bench/sse_client.py`);
- `direct`: `clients` concurrent SDK clients, each submitting the same kind of job
  (`job_fields` of the same body, at the open gateway's priority) and reading its stream
  straight from Redis (`Client.stream`, the SDK's reader), back to back;
- `alternate`: one job at a time, through the gateway then direct, `pairs` times.

Clients start spread over `ramp_s`, and pause up to `think_s` between answers; answers
that *started* within the window [`warmup_s`, `warmup_s` + `window_s`) are measured,
tokens received within it counted.
Prints `window-start` and `window-end` as the window opens and closes (the bench samples
the gateway's CPU then), and a JSON line of results last. Its own CPU and event-loop lag
over the window go with them: the check that the load generator was not the bound."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis

from bench.gateway_stats import Window, percentile, relay_added
from bench.sse_client import Answer, ProtocolError, StreamingClient
from trtllm_worker.client import Client, DoneEvent, ErrorEvent, TokenEvent
from trtllm_worker.contract.openai import CHAT_COMPLETIONS, job_fields

PROMPT = "Tell me about message queues and streams."
clock = time.perf_counter
"""Every timestamp (uvloop's `loop.time()` counts whole milliseconds)."""
Reply = list[tuple[str, list[tuple[str, dict[str, str]]]]]
LAG_TICK_S = 0.01
"""How often the lag probe asks the loop to wake it."""


def chat_body(model: str, tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "stream": True,
    }


@dataclass
class Config:
    role: str
    clients: int
    host: str
    port: int
    amqp_url: str
    redis_url: str
    queue: str
    prefix: str
    model: str
    tokens: int
    priority: int
    ramp_s: float = 1.0
    warmup_s: float = 2.0
    window_s: float = 10.0
    drain_s: float = 30.0
    pairs: int = 0
    shadows: int = 0
    think_s: float = 0.0
    """Between one answer's end and the next request, a pause drawn uniformly from
    [0, think_s): without it each client's requests lock onto the engine's step (its
    next request arrives a fixed time after the step that ended its last answer)."""
    """Gateway clients whose answers a reader of the job's stream in Redis shadows."""


class Run:
    def __init__(self, config: Config) -> None:
        self.config = config
        now = clock()
        self.window = Window(now + config.warmup_s, now + config.warmup_s + config.window_s)
        self.ttft_ms: list[float] = []
        self.pairs: list[tuple[float, float]] = []
        self.answers = 0
        self.short = 0
        self.errors: Counter[str] = Counter()
        self.lag_ms: list[float] = []
        self.relay_ms: list[float] = []
        self.redis = aioredis.Redis.from_url(config.redis_url, decode_responses=True)
        every = max(config.clients // max(config.shadows, 1), 1)
        self.shadowed = set(range(0, config.clients, every)[: config.shadows])
        body = chat_body(config.model, config.tokens)
        self.body = body
        fields = job_fields(CHAT_COMPLETIONS, body, stream=True)
        inputs = fields.pop("inputs", None)
        self.job = (inputs, fields.pop("parameters", {}), fields)  # as the gateway splits them

    def measured(self, answer: Answer) -> None:
        """An answer that ended: counted if it started within the window."""
        if not self.window.holds(answer.started):
            return
        self.answers += 1
        if answer.first_token is None or answer.tokens != self.config.tokens:
            self.short += 1
        if answer.first_token is not None:
            self.ttft_ms.append((answer.first_token - answer.started) * 1000)

    async def through_gateway(self, client: StreamingClient, shadowed: bool) -> Answer:
        answer = Answer(clock())
        shadow: list[asyncio.Task[dict[int, float]]] = []
        if shadowed:
            answer.token_times = []
            answer.on_first = lambda answer_id: shadow.append(
                asyncio.create_task(self.shadow(answer_id.removeprefix("chatcmpl-")))
            )
        try:
            await client.chat(self.body, answer, clock, self.window.add)
        finally:
            for task in shadow:
                if not task.done():
                    task.cancel()
        if shadow and answer.token_times is not None and self.window.holds(answer.started):
            with contextlib.suppress(asyncio.CancelledError):
                self.relay_ms += relay_added(answer.token_times, await shadow[0])
        return answer

    async def shadow(self, request_id: str) -> dict[int, float]:
        """When each token entry of the job's stream arrives to a reader of it in Redis,
        by index, from the reader's second read on (what the first returns was there
        before it started)."""
        key, last = self.config.prefix + request_id, "0"
        seen: dict[int, float] = {}
        first = True
        while True:
            reply = cast(Reply, await self.redis.xread({key: last}, block=5000, count=512))
            now = clock()
            for _, items in reply:
                for entry_id, fields in items:
                    last = entry_id
                    if fields.get("event") == "token" and not first:
                        seen[int(fields["index"])] = now
                    elif fields.get("event") in ("done", "error"):
                        return seen
            first = False

    async def direct(self, sdk: Client) -> Answer:
        inputs, parameters, extra = self.job
        answer = Answer(clock())
        request_id = await sdk.submit(inputs, parameters, priority=self.config.priority, **extra)
        async for event in sdk.stream(request_id):
            if isinstance(event, TokenEvent):
                now = clock()
                if answer.first_token is None:
                    answer.first_token = now
                answer.tokens += 1
                self.window.add(now, 1)
            elif isinstance(event, DoneEvent):
                answer.ended = clock()
            elif isinstance(event, ErrorEvent):
                raise ProtocolError(f"job error {event.code}: {event.message}")
        return answer

    async def client_loop(self, index: int, one: Callable[[], Awaitable[Answer]]) -> None:
        await asyncio.sleep(index * self.config.ramp_s / max(self.config.clients, 1))
        while clock() < self.window.end:
            started = clock()
            try:
                self.measured(await one())
            except Exception as exc:  # counted; the client goes on
                if self.window.holds(started):
                    self.errors[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
                await asyncio.sleep(0.1)
            if self.config.think_s:
                await asyncio.sleep(random.uniform(0, self.config.think_s))

    async def lag_probe(self) -> None:
        """How late the loop wakes a sleeper, within the window (ms)."""
        while True:
            asked = clock()
            await asyncio.sleep(LAG_TICK_S)
            woke = clock()
            if self.window.holds(asked):
                self.lag_ms.append((woke - asked - LAG_TICK_S) * 1000)

    async def announce(self) -> tuple[float, float]:
        """Prints the window's edges as they pass; returns this process's CPU seconds at
        each."""
        await asyncio.sleep(max(self.window.start - clock(), 0))
        print("window-start", flush=True)
        cpu_start = time.process_time()
        await asyncio.sleep(max(self.window.end - clock(), 0))
        print("window-end", flush=True)
        return cpu_start, time.process_time()


async def run(config: Config) -> dict[str, Any]:
    state = Run(config)
    probe = asyncio.create_task(state.lag_probe())
    announce = asyncio.create_task(state.announce())
    gateways = [StreamingClient(config.host, config.port) for _ in range(config.clients)]
    sdk = Client(
        amqp_url=config.amqp_url,
        redis_url=config.redis_url,
        queue=config.queue,
        stream_prefix=config.prefix,
        client_name="bench-gateway-direct",
    )
    try:
        if config.role == "alternate":
            await alternate(state, gateways[0], sdk)
        else:
            loops = [
                state.client_loop(i, _one(state, config.role, i, c, sdk))
                for i, c in enumerate(gateways)
            ]
            limit = config.warmup_s + config.window_s + config.drain_s
            try:
                await asyncio.wait_for(asyncio.gather(*loops), limit)
            except TimeoutError:
                state.errors["not ended within the drain time"] += 1
        cpu_start, cpu_end = await announce if config.role != "alternate" else (0.0, 0.0)
    finally:
        probe.cancel()
        announce.cancel()
        await asyncio.gather(*(c.close() for c in gateways), return_exceptions=True)
        await sdk.aclose()
        await state.redis.aclose()
    return {
        "role": config.role,
        "clients": config.clients,
        "answers": state.answers,
        "short_answers": state.short,
        "errors": dict(state.errors),
        "ttft_ms": [round(t, 3) for t in state.ttft_ms],
        "pairs_ms": [(round(g, 3), round(d, 3)) for g, d in state.pairs],
        "relay_added_ms": state.relay_ms,
        "window_tokens": state.window.tokens,
        "window_s": config.window_s,
        "cpu_pct": round((cpu_end - cpu_start) / config.window_s * 100, 1),
        "loop_lag_ms_p50": percentile(state.lag_ms, 0.5),
        "loop_lag_ms_p99": percentile(state.lag_ms, 0.99),
    }


def _one(
    state: Run, role: str, index: int, client: StreamingClient, sdk: Client
) -> Callable[[], Awaitable[Answer]]:
    """One answer of client `index` of `role`."""
    if role == "gateway":
        shadowed = index in state.shadowed
        return lambda: state.through_gateway(client, shadowed)
    return lambda: state.direct(sdk)


async def alternate(state: Run, gateway: StreamingClient, sdk: Client) -> None:
    """One job at a time, through the gateway then direct: the added time unloaded,
    paired (a pair's two jobs are a few milliseconds apart)."""
    state.window = Window(float("-inf"), float("inf"))
    for n in range(state.config.pairs + 5):  # five pairs to warm up connections
        through = await state.through_gateway(gateway, False)
        direct = await state.direct(sdk)
        if n < 5:
            continue
        if through.first_token is None or direct.first_token is None:
            state.short += 1
            continue
        state.answers += 1
        state.pairs.append(
            (
                (through.first_token - through.started) * 1000,
                (direct.first_token - direct.started) * 1000,
            )
        )


def main() -> None:
    config = Config(**json.loads(sys.argv[1]))
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the dev extra
        print(json.dumps(asyncio.run(run(config))), flush=True)
    else:
        print(json.dumps(uvloop.run(run(config))), flush=True)


if __name__ == "__main__":
    main()
