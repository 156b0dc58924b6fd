"""One contract, every engine: echo, the LLM API adapter and the Executor adapter (both on
the tensorrt_llm double). What the worker relies on from any engine."""

from __future__ import annotations

import time

from tests.engines.conftest import POISON, EngineFactory, collect, drive, tokens_of
from trtllm_worker.contract.job import MAX_TOP_LOGPROBS
from trtllm_worker.engine.base import EngineOutput, EngineRequest, FinishReason, Sampling

EOS = 2


def request(request_id: int, prompt: list[int], max_new: int, **kwargs: object) -> EngineRequest:
    return EngineRequest(id=request_id, prompt_ids=prompt, max_new_tokens=max_new, **kwargs)  # type: ignore[arg-type]


def test_streams_tokens_in_order_and_ends_by_length(make_engine: EngineFactory) -> None:
    outputs = drive(make_engine(), [request(1, [5, 6, 7], 7, end_id=EOS)])[1]
    assert tokens_of(outputs) == [5, 6, 7, 5, 6, 7, 5]
    assert [o.final for o in outputs].count(True) == 1
    assert outputs[-1].finish is FinishReason.LENGTH
    assert all(o.error is None for o in outputs)


def test_eos_ends_the_request_with_the_eos_token_last(make_engine: EngineFactory) -> None:
    eos = request(1, [5, 6, EOS], 50, end_id=EOS, eos_ids=frozenset({EOS}))
    outputs = drive(make_engine(), [eos])[1]
    assert tokens_of(outputs) == [5, 6, EOS]
    assert outputs[-1].finish is FinishReason.EOS_TOKEN


def test_a_second_eos_id_ends_the_request_too(make_engine: EngineFactory) -> None:
    eos = request(1, [5, 9], 50, end_id=EOS, eos_ids=frozenset({EOS, 9}))
    outputs = drive(make_engine(), [eos])[1]
    assert tokens_of(outputs) == [5, 9]
    assert outputs[-1].finish is FinishReason.EOS_TOKEN


def test_ignore_eos_generates_to_the_limit(make_engine: EngineFactory) -> None:
    ignoring = request(1, [5, EOS], 5, end_id=EOS, ignore_eos=True)
    outputs = drive(make_engine(), [ignoring])[1]
    assert tokens_of(outputs) == [5, EOS, 5, EOS, 5]
    assert outputs[-1].finish is FinishReason.LENGTH


def test_eos_is_not_honoured_before_min_new_tokens(make_engine: EngineFactory) -> None:
    early = request(1, [5, EOS], 50, end_id=EOS, eos_ids=frozenset({EOS}), min_new_tokens=3)
    outputs = drive(make_engine(), [early])[1]
    tokens = tokens_of(outputs)
    assert len(tokens) == 4
    assert tokens[-1] == EOS
    assert outputs[-1].finish is FinishReason.EOS_TOKEN


def test_a_resumed_request_counts_min_new_tokens_from_the_resume_point(
    make_engine: EngineFactory,
) -> None:
    """The first attempt published 5, EOS of min_new_tokens 5: the worker resubmits the
    prompt with them, min_new_tokens 3 (what remains). The EOS at the 4th generated token
    overall (2nd new) may not end it; the one at the 6th (4th new) does. The TensorRT-LLM
    adapters pass the remainder as `min_tokens`, which counts this request's tokens."""
    prompt, published = [5, EOS], [5, EOS]
    resumed = request(
        1, [*prompt, *published], 50, end_id=EOS, eos_ids=frozenset({EOS}),
        min_new_tokens=3, resumed_tokens=2,
    )  # fmt: skip
    outputs = drive(make_engine(), [resumed])[1]
    tokens = tokens_of(outputs)  # a model steers away from an EOS it may not end with yet
    assert len(tokens) == 4
    assert tokens[-1] == EOS
    assert outputs[-1].finish is FinishReason.EOS_TOKEN


def test_cancel_mid_stream_ends_cancelled_keeping_the_tokens(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.enqueue(request(1, [5, 6], 100_000))
    outputs: dict[int, list[EngineOutput]] = {1: []}
    while not outputs[1]:
        outputs[1].extend(engine.wait(0.05))
    engine.cancel(1)
    collect(engine, outputs)
    assert outputs[1][-1].finish is FinishReason.CANCELLED
    assert 0 < len(tokens_of(outputs[1])) < 100_000


def test_cancel_of_a_queued_request(make_engine: EngineFactory) -> None:
    engine = make_engine(capacity=1)
    engine.enqueue(request(1, [5], 100_000))
    engine.enqueue(request(2, [6], 10))
    outputs: dict[int, list[EngineOutput]] = {1: [], 2: []}
    while not outputs[1]:
        for output in engine.wait(0.05):
            outputs[output.id].append(output)
    engine.cancel(2)
    engine.cancel(1)
    collect(engine, outputs)
    assert outputs[2][-1].finish is FinishReason.CANCELLED
    assert tokens_of(outputs[2]) == []


def test_a_failing_request_leaves_the_others_running(make_engine: EngineFactory) -> None:
    outputs = drive(
        make_engine(),
        [request(1, [5, 6], 30), request(2, [5, POISON], 30), request(3, [7], 30)],
    )
    assert outputs[2][-1].error
    assert outputs[2][-1].finish is None
    for good in (1, 3):
        assert outputs[good][-1].finish is FinishReason.LENGTH
        assert len(tokens_of(outputs[good])) == 30


def test_logprobs_when_asked(make_engine: EngineFactory) -> None:
    outputs = drive(
        make_engine(), [request(1, [5, 6], 6, return_logprobs=True), request(2, [5, 6], 6)]
    )
    for output in outputs[1]:
        assert output.logprobs is not None
        assert len(output.logprobs) == len(output.token_ids)
        assert all(p is not None and p <= 0 for p in output.logprobs)
    assert all(o.logprobs is None for o in outputs[2])


def test_top_logprobs_most_likely_first_or_refused(make_engine: EngineFactory) -> None:
    """Where an engine can return top logprobs (echo; the LLM API with TorchSampler) a
    request gets exactly K distinct `(token_id, logprob)` per token, most likely first;
    greedy, the chosen token is the first, its `logprob` the first's. The Executor
    cannot, and its limits say so, with what to use instead."""
    engine = make_engine(sampler="TorchSampler")
    if make_engine.kind == "trtllm-executor":  # type: ignore[attr-defined]
        assert engine.limits.max_top_logprobs == 0
        assert "WORKER_SAMPLER=TorchSampler" in engine.limits.top_logprobs_why
        return
    assert engine.limits.max_top_logprobs == MAX_TOP_LOGPROBS
    greedy = Sampling(do_sample=False)
    outputs = drive(
        engine,
        [
            request(1, [5, 6, 7], 7, return_logprobs=True, top_logprobs=3, sampling=greedy),
            request(2, [5, 6, 7], 7, return_logprobs=True, sampling=greedy),
        ],
    )
    tokens = tokens_of(outputs[1])
    tops = [top for o in outputs[1] for top in (o.top_logprobs or [])]
    logprobs = [p for o in outputs[1] for p in (o.logprobs or [])]
    assert len(tokens) == len(tops) == len(logprobs) == 7
    for token, top, logprob in zip(tokens, tops, logprobs, strict=True):
        assert top is not None
        assert len(top) == 3
        assert len({token_id for token_id, _ in top}) == 3
        values = [value for _, value in top]
        assert values == sorted(values, reverse=True)
        assert all(value <= 0 for value in values)
        assert top[0] == (token, logprob)
    assert all(o.top_logprobs is None for o in outputs[2])


def test_deadline_ends_the_request_where_the_engine_takes_one(
    make_engine: EngineFactory,
) -> None:
    if make_engine.kind == "trtllm":  # type: ignore[attr-defined]
        # The LLM API takes no per-request deadline: the request runs on until the
        # worker's own timer aborts it (covered end to end in the integration tests).
        passed = request(1, [5], 20, deadline=time.time() - 1)
        assert drive(make_engine(), [passed])[1][-1].finish is FinishReason.LENGTH
        return
    late = request(1, [5], 1_000_000, deadline=time.time() + 0.2)
    outputs = drive(make_engine(), [late])[1]
    assert outputs[-1].finish is FinishReason.DEADLINE


def test_hundreds_of_concurrent_requests(make_engine: EngineFactory) -> None:
    requests = [request(i, [i % 200 + 3, 1], 20) for i in range(1, 301)]
    outputs = drive(make_engine(capacity=64), requests, limit_s=60)
    for req in requests:
        assert outputs[req.id][-1].finish is FinishReason.LENGTH
        assert tokens_of(outputs[req.id]) == ([req.prompt_ids[0], 1] * 10)


def test_shutdown_with_requests_in_flight(make_engine: EngineFactory) -> None:
    engine = make_engine()
    for i in range(1, 11):
        engine.enqueue(request(i, [5, 6], 100_000))
    got: list[EngineOutput] = []
    while not got:
        got = engine.wait(0.05)
    started = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - started < 5


def test_stats_report_the_engine(make_engine: EngineFactory) -> None:
    engine = make_engine()
    drive(engine, [request(1, [5], 50)])
    stats = engine.stats()
    assert stats.active_requests is not None
    assert stats.active_requests >= 0


def test_a_stop_token_id_ends_the_request_with_stop_sequence(make_engine: EngineFactory) -> None:
    stopping = request(
        1, [5, 6, 7], 50, end_id=EOS, eos_ids=frozenset({EOS}), stop_token_ids=frozenset({6})
    )
    outputs = drive(make_engine(), [stopping])[1]
    assert tokens_of(outputs) == [5, 6]  # the stop token is the last one
    assert outputs[-1].finish is FinishReason.STOP_SEQUENCE


def test_the_stop_token_has_its_logprob_too(make_engine: EngineFactory) -> None:
    """Every generated token, the one that stopped the job included, has its log
    probability: TensorRT-LLM trims a stop token from `token_ids` but not from the log
    probabilities (the adapter put the token back and dropped its logprob)."""
    stopping = request(
        1,
        [5, 6, 7],
        50,
        end_id=EOS,
        eos_ids=frozenset({EOS}),
        stop_token_ids=frozenset({6}),
        return_logprobs=True,
    )
    outputs = drive(make_engine(), [stopping])[1]
    assert tokens_of(outputs) == [5, 6]
    logprobs = [p for o in outputs for p in (o.logprobs or [])]
    assert len(logprobs) == 2
    assert all(p is not None and p <= 0 for p in logprobs)


def test_ignore_eos_keeps_the_jobs_stop_token_ids(make_engine: EngineFactory) -> None:
    job = request(1, [5, EOS, 7], 50, end_id=EOS, ignore_eos=True, stop_token_ids=frozenset({7}))
    outputs = drive(make_engine(), [job])[1]
    assert tokens_of(outputs) == [5, EOS, 7]
    assert outputs[-1].finish is FinishReason.STOP_SEQUENCE
