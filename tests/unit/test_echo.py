"""The echo engine, driven directly as the looper drives it: enqueue/cancel, then `wait`
again and again. With `step_s=0` every `wait` runs exactly one step."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_worker.engine.base import EngineOutput, EngineRequest, FinishReason, Sampling
from trtllm_worker.engine.echo import EchoEngine

MAX_STEPS = 10_000


def run(engine: EchoEngine, ids: set[int]) -> list[list[EngineOutput]]:
    """Step until every request in `ids` had its final output; the outputs of each step."""
    steps: list[list[EngineOutput]] = []
    pending = set(ids)
    while pending:
        assert len(steps) < MAX_STEPS, f"requests {pending} never finished"
        outputs = engine.wait(1.0)
        steps.append(outputs)
        pending -= {output.id for output in outputs if output.final}
    return steps


def by_id(steps: list[list[EngineOutput]]) -> dict[int, list[EngineOutput]]:
    outputs: dict[int, list[EngineOutput]] = defaultdict(list)
    for step in steps:
        for output in step:
            outputs[output.id].append(output)
    return outputs


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


def run_one(request: EngineRequest) -> list[EngineOutput]:
    engine = EchoEngine(capacity=4, step_s=0)
    engine.enqueue(request)
    outputs = by_id(run(engine, {request.id}))[request.id]
    assert all(not output.final for output in outputs[:-1])
    assert outputs[-1].final
    return outputs


# -- the echo sequence ------------------------------------------------------------------


def test_generated_token_k_is_prompt_token_k_mod_n() -> None:
    outputs = run_one(EngineRequest(1, [1, 2, 3], max_new_tokens=8))

    assert tokens(outputs) == [1, 2, 3, 1, 2, 3, 1, 2]
    assert [len(output.token_ids) for output in outputs] == [1] * 8


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ([7], [7, 7, 7, 7, 7]),
        ([4, 5], [4, 5, 4, 5, 4]),
        ([9, 8, 7, 6, 5, 4, 3], [9, 8, 7, 6, 5]),
    ],
)
def test_echo_sequence_for_other_prompt_lengths(prompt: list[int], expected: list[int]) -> None:
    assert tokens(run_one(EngineRequest(1, prompt, max_new_tokens=5))) == expected


def test_max_new_tokens_finishes_with_length_on_the_last_token() -> None:
    outputs = run_one(EngineRequest(1, [1, 2, 3], max_new_tokens=4))

    assert [output.finish for output in outputs] == [None, None, None, FinishReason.LENGTH]
    assert outputs[-1].token_ids == [1]
    assert all(output.error is None for output in outputs)


def test_a_single_token_budget_finishes_on_the_first_step() -> None:
    outputs = run_one(EngineRequest(1, [5, 6], max_new_tokens=1))

    assert len(outputs) == 1
    assert outputs[0].token_ids == [5]
    assert outputs[0].finish is FinishReason.LENGTH


def test_sampling_parameters_do_not_change_the_output() -> None:
    sampling = Sampling(do_sample=True, temperature=1.7, top_k=3, top_p=0.5, seed=11)
    plain = run_one(EngineRequest(1, [3, 1, 4, 1, 5], max_new_tokens=9))
    sampled = run_one(EngineRequest(1, [3, 1, 4, 1, 5], max_new_tokens=9, sampling=sampling))

    assert tokens(sampled) == tokens(plain)
    assert sampled[-1].finish == plain[-1].finish == FinishReason.LENGTH


# -- EOS --------------------------------------------------------------------------------


def test_eos_id_ends_the_request_with_the_eos_id_as_last_token() -> None:
    outputs = run_one(EngineRequest(1, [5, 7, 9, 11], max_new_tokens=20, eos_ids=frozenset({9})))

    assert tokens(outputs) == [5, 7, 9]
    assert outputs[-1].token_ids == [9]
    assert outputs[-1].finish is FinishReason.EOS_TOKEN


def test_any_of_several_eos_ids_ends_the_request() -> None:
    request = EngineRequest(1, [5, 7, 9, 11], max_new_tokens=20, eos_ids=frozenset({11, 7}))
    outputs = run_one(request)

    assert tokens(outputs) == [5, 7]
    assert outputs[-1].finish is FinishReason.EOS_TOKEN


def test_eos_is_not_honoured_before_min_new_tokens() -> None:
    request = EngineRequest(
        1, [5, 7, 9, 11], max_new_tokens=20, min_new_tokens=4, eos_ids=frozenset({9})
    )
    outputs = run_one(request)

    # The first 9 is token 3 < min_new_tokens: it is generated and the request goes on.
    assert tokens(outputs) == [5, 7, 9, 11, 5, 7, 9]
    assert outputs[-1].finish is FinishReason.EOS_TOKEN


def test_eos_exactly_at_min_new_tokens_ends_the_request() -> None:
    request = EngineRequest(
        1, [5, 7, 9, 11], max_new_tokens=20, min_new_tokens=3, eos_ids=frozenset({9})
    )

    outputs = run_one(request)

    assert tokens(outputs) == [5, 7, 9]
    assert outputs[-1].finish is FinishReason.EOS_TOKEN


def test_ignore_eos_never_ends_on_eos() -> None:
    request = EngineRequest(
        1, [5, 7, 9, 11], max_new_tokens=10, eos_ids=frozenset({9}), ignore_eos=True
    )
    outputs = run_one(request)

    assert tokens(outputs) == [5, 7, 9, 11, 5, 7, 9, 11, 5, 7]
    assert outputs[-1].finish is FinishReason.LENGTH


# -- resume after redelivery -----------------------------------------------------------


def test_resumed_request_continues_the_same_sequence() -> None:
    # The first attempt generated 1, 2, 3, 1 of a budget of 7 before it was redelivered.
    prompt, generated = [1, 2, 3], [1, 2, 3, 1]
    request = EngineRequest(1, prompt + generated, max_new_tokens=3, resumed_tokens=4)
    outputs = run_one(request)

    assert tokens(outputs) == [2, 3, 1]
    assert outputs[-1].finish is FinishReason.LENGTH


def test_resumed_request_counts_min_new_tokens_from_the_resume_point() -> None:
    # First attempt: 5, 7 (of min_new_tokens=5). What remains of the minimum is 3, so the
    # next 9 (token 1 after the resume) is not EOS yet, the one after it (token 4) is.
    prompt, generated = [5, 7, 9], [5, 7]
    request = EngineRequest(
        1,
        prompt + generated,
        max_new_tokens=18,
        min_new_tokens=3,
        eos_ids=frozenset({9}),
        resumed_tokens=2,
    )
    outputs = run_one(request)

    assert tokens(outputs) == [9, 5, 7, 9]
    assert outputs[-1].finish is FinishReason.EOS_TOKEN


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    eos=st.frozensets(st.integers(0, 6), max_size=2),
    min_new=st.integers(0, 8),
    max_new=st.integers(1, 16),
    ignore_eos=st.booleans(),
    data=st.data(),
)
def test_resume_at_any_point_gives_the_rest_of_the_uninterrupted_run(
    prompt: list[int],
    eos: frozenset[int],
    min_new: int,
    max_new: int,
    ignore_eos: bool,
    data: st.DataObject,
) -> None:
    def attempt(generated: list[int]) -> list[EngineOutput]:
        r = len(generated)
        return run_one(
            EngineRequest(
                1,
                prompt + generated,
                max_new_tokens=max_new - r,
                min_new_tokens=max(0, min_new - r),
                eos_ids=eos,
                ignore_eos=ignore_eos,
                resumed_tokens=r,
            )
        )

    whole = attempt([])
    full = tokens(whole)
    assert len(full) <= max_new
    r = data.draw(st.integers(0, len(full) - 1), label="resumed_tokens")

    resumed = attempt(full[:r])

    assert tokens(resumed) == full[r:]
    assert resumed[-1].finish == whole[-1].finish


# -- cancel -----------------------------------------------------------------------------


def test_cancel_of_a_running_request_ends_it_with_no_tokens() -> None:
    engine = EchoEngine(capacity=4, step_s=0)
    engine.enqueue(EngineRequest(1, [1, 2, 3], max_new_tokens=100))
    assert [(o.id, o.token_ids, o.finish) for o in engine.wait(1.0)] == [(1, [1], None)]
    assert [(o.id, o.token_ids, o.finish) for o in engine.wait(1.0)] == [(1, [2], None)]

    engine.cancel(1)
    outputs = engine.wait(1.0)

    assert [(o.id, o.token_ids, o.finish) for o in outputs] == [(1, [], FinishReason.CANCELLED)]
    assert outputs[0].final
    assert engine.wait(0.01) == []  # gone from the engine


def test_cancel_of_one_request_leaves_the_others_running() -> None:
    engine = EchoEngine(capacity=4, step_s=0)
    engine.enqueue(EngineRequest(1, [1, 2, 3], max_new_tokens=5))
    engine.enqueue(EngineRequest(2, [4, 5], max_new_tokens=5))
    engine.wait(1.0)

    engine.cancel(2)
    outputs = by_id(run(engine, {1, 2}))

    assert [(o.token_ids, o.finish) for o in outputs[2]] == [([], FinishReason.CANCELLED)]
    assert tokens(outputs[1]) == [2, 3, 1, 2]
    assert outputs[1][-1].finish is FinishReason.LENGTH


def test_cancel_of_a_waiting_request_ends_it_without_admitting_it() -> None:
    engine = EchoEngine(capacity=1, step_s=0)
    engine.enqueue(EngineRequest(1, [1, 2, 3], max_new_tokens=3))
    engine.enqueue(EngineRequest(2, [4, 5], max_new_tokens=3))
    assert [o.id for o in engine.wait(1.0)] == [1]  # 2 waits for a free slot

    engine.cancel(2)
    outputs = by_id(run(engine, {1, 2}))

    assert [(o.token_ids, o.finish) for o in outputs[2]] == [([], FinishReason.CANCELLED)]
    assert tokens(outputs[1]) == [2, 3]
    assert outputs[1][-1].finish is FinishReason.LENGTH
    assert engine.wait(0.01) == []


def test_cancel_of_a_waiting_request_ends_it_before_the_next_step_is_due() -> None:
    engine = EchoEngine(capacity=1, step_s=60)
    engine.enqueue(EngineRequest(1, [1, 2, 3], max_new_tokens=3))
    engine.enqueue(EngineRequest(2, [4, 5], max_new_tokens=3))
    assert [o.id for o in engine.wait(1.0)] == [1]  # the first step is not delayed

    engine.cancel(2)
    outputs = engine.wait(0.01)  # the next step is a minute away

    assert [(o.id, o.token_ids, o.finish) for o in outputs] == [(2, [], FinishReason.CANCELLED)]


# -- batching ---------------------------------------------------------------------------


def test_capacity_limits_how_many_requests_advance_per_step() -> None:
    engine = EchoEngine(capacity=2, step_s=0)
    engine.enqueue(EngineRequest(1, [1], max_new_tokens=2))
    engine.enqueue(EngineRequest(2, [2], max_new_tokens=4))
    engine.enqueue(EngineRequest(3, [3], max_new_tokens=3))

    steps = run(engine, {1, 2, 3})

    assert [sorted(o.id for o in step) for step in steps] == [
        [1, 2],
        [1, 2],  # 1 finishes here ...
        [2, 3],  # ... so 3 starts on the next step
        [2, 3],
        [3],
    ]
    outputs = by_id(steps)
    assert tokens(outputs[1]) == [1, 1]
    assert tokens(outputs[2]) == [2, 2, 2, 2]
    assert tokens(outputs[3]) == [3, 3, 3]


def test_all_running_requests_advance_one_token_per_step() -> None:
    engine = EchoEngine(capacity=8, step_s=0)
    for request_id in range(1, 6):
        engine.enqueue(EngineRequest(request_id, [request_id, 10 + request_id], 6))

    steps = run(engine, set(range(1, 6)))

    assert len(steps) == 6
    for step in steps:
        assert sorted(o.id for o in step) == [1, 2, 3, 4, 5]
        assert all(len(o.token_ids) == 1 for o in step)
    for request_id, outputs in by_id(steps).items():
        assert tokens(outputs) == [request_id, 10 + request_id] * 3


def test_engine_reports_its_capacity() -> None:
    assert EchoEngine(capacity=7, step_s=0).capacity == 7


# -- logprobs ---------------------------------------------------------------------------


def test_return_logprobs_gives_one_logprob_per_token() -> None:
    request = EngineRequest(1, [1, 2, 3], max_new_tokens=5, return_logprobs=True)
    outputs = run_one(request)

    assert len(outputs) == 5
    for output in outputs:
        assert output.logprobs is not None
        assert len(output.logprobs) == len(output.token_ids)
        assert all(isinstance(value, float) for value in output.logprobs)


def test_without_return_logprobs_there_are_none() -> None:
    outputs = run_one(EngineRequest(1, [1, 2, 3], max_new_tokens=3))

    assert all(output.logprobs is None for output in outputs)


@pytest.mark.parametrize("tokens_per_step", [1, 3])
@pytest.mark.parametrize("count", [1, 3, 20])
def test_top_logprobs_list_the_generated_token_first(tokens_per_step: int, count: int) -> None:
    """Deterministic: the generated token first at its `logprob` 0.0, then distinct low
    ids at falling log probabilities; exactly `count` pairs per token."""
    engine = EchoEngine(capacity=4, step_s=0, tokens_per_step=tokens_per_step)
    request = EngineRequest(
        1, [0, 7, 19], max_new_tokens=7, return_logprobs=True, top_logprobs=count
    )
    engine.enqueue(request)
    outputs = by_id(run(engine, {1}))[1]
    generated = tokens(outputs)
    tops = [top for output in outputs for top in output.top_logprobs or []]
    assert len(tops) == len(generated) == 7
    for token, top in zip(generated, tops, strict=True):
        assert top is not None
        assert len(top) == count
        assert top[0] == (token, 0.0)
        assert len({token_id for token_id, _ in top}) == count
        assert [logprob for _, logprob in top] == [-float(k) for k in range(count)]
        assert all(token_id < 20 for token_id, _ in top[1:])
    again = EchoEngine(capacity=4, step_s=0, tokens_per_step=tokens_per_step)
    again.enqueue(request)
    assert [o.top_logprobs for o in by_id(run(again, {1}))[1]] == [o.top_logprobs for o in outputs]


def test_without_top_logprobs_there_are_none() -> None:
    outputs = run_one(EngineRequest(1, [1, 2, 3], max_new_tokens=3, return_logprobs=True))

    assert all(output.top_logprobs is None for output in outputs)


# -- step time and wake -----------------------------------------------------------------


def test_wait_before_the_next_step_is_due_returns_nothing() -> None:
    step_s = 0.3  # long enough that a loaded machine does not reach it by accident
    engine = EchoEngine(capacity=2, step_s=step_s)
    engine.enqueue(EngineRequest(1, [1, 2, 3], max_new_tokens=3))
    first = engine.wait(5.0)
    after_first = time.monotonic()

    assert engine.wait(timeout=0.01) == []  # no step yet

    second = engine.wait(timeout=5.0)  # blocks until the step is due
    waited = time.monotonic() - after_first
    assert [o.token_ids for o in first] == [[1]]
    assert [o.token_ids for o in second] == [[2]]
    assert waited >= step_s / 2


def test_steps_are_step_s_apart_even_right_after_an_idle_period() -> None:
    """After the engine sat idle for longer than a step, the second step must still wait
    for its turn instead of following the first one at once."""
    step_s = 0.3
    engine = EchoEngine(capacity=2, step_s=step_s)
    assert engine.wait(timeout=2 * step_s) == []  # idle: nothing to do
    engine.enqueue(EngineRequest(1, [1, 2, 3], max_new_tokens=3))
    assert [o.token_ids for o in engine.wait(5.0)] == [[1]]

    assert engine.wait(timeout=0.01) == []


def test_wake_interrupts_a_wait_on_an_idle_engine() -> None:
    engine = EchoEngine(capacity=2, step_s=0.01)
    results: list[tuple[list[EngineOutput], float]] = []
    waiting = threading.Event()

    def blocked() -> None:
        started = time.monotonic()
        waiting.set()
        outputs = engine.wait(5.0)
        results.append((outputs, time.monotonic() - started))

    thread = threading.Thread(target=blocked)
    thread.start()
    assert waiting.wait(5.0)
    engine.wake()
    thread.join(10.0)

    assert not thread.is_alive()
    [(outputs, elapsed)] = results
    assert outputs == []
    assert elapsed < 1.0


def test_wake_interrupts_a_wait_for_the_next_step() -> None:
    engine = EchoEngine(capacity=2, step_s=60)
    engine.enqueue(EngineRequest(1, [1, 2, 3], max_new_tokens=3))
    assert [o.token_ids for o in engine.wait(5.0)] == [[1]]  # the next step is a minute away
    results: list[tuple[list[EngineOutput], float]] = []
    waiting = threading.Event()

    def blocked() -> None:
        started = time.monotonic()
        waiting.set()
        outputs = engine.wait(5.0)
        results.append((outputs, time.monotonic() - started))

    thread = threading.Thread(target=blocked)
    thread.start()
    assert waiting.wait(5.0)
    engine.wake()
    thread.join(10.0)

    assert not thread.is_alive()
    [(outputs, elapsed)] = results
    assert outputs == []
    assert elapsed < 1.0


def test_wait_after_shutdown_raises() -> None:
    engine = EchoEngine(capacity=2, step_s=0)
    engine.enqueue(EngineRequest(1, [1, 2, 3], max_new_tokens=3))
    engine.shutdown()

    with pytest.raises(RuntimeError, match="shut down"):
        engine.wait(0.01)
