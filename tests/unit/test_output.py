"""OutputProcessor and RequestState (trtllm_worker/pipeline/output.py): engine outputs →
stream entries as CONTRACT.md "Token stream (Redis)" specifies them.

Expected texts come from the tokenizer's full decode, never from literals, except where
the tokenizer is the byte tokenizer and the text is plain ASCII."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import pytest
from tokenizers import Tokenizer

from trtllm_worker.contract.stream import Fields, entry_id
from trtllm_worker.engine.base import EngineOutput, FinishReason
from trtllm_worker.pipeline.output import OutputProcessor, RequestState

TOKENIZERS = ["byte_tokenizer", "bpe_tokenizer"]
PROMPT = "Hello"
CONTINUATION = " world, 日本語 👨‍👩‍👧‍👦 🇫🇷 e\u0301!"
EOS = "</s>"

Entry = tuple[str, str, Fields]


def _get_tokenizer(request: pytest.FixtureRequest, name: str) -> Tokenizer:
    return cast(Tokenizer, request.getfixturevalue(name))


def _decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def _suffix(tokenizer: Tokenizer, prompt: Sequence[int], ids: Sequence[int]) -> str:
    """What `ids` add to the decode of `prompt`."""
    base = _decode(tokenizer, prompt)
    full = _decode(tokenizer, [*prompt, *ids])
    assert full.startswith(base), "test data: decode(prompt) must be a prefix"
    return full[len(base) :]


def _state(
    tokenizer: Tokenizer,
    *,
    engine_id: int = 1,
    prompt: str = PROMPT,
    stops: Sequence[str] = (),
    min_new_tokens: int = 0,
    eos_ids: frozenset[int] = frozenset(),
    stop_token_ids: frozenset[int] = frozenset(),
    skip_special_tokens: bool = True,
    return_logprobs: bool = False,
    metadata_json: str | None = None,
) -> RequestState:
    prompt_ids = tokenizer.encode(prompt).ids
    return RequestState(
        request_id=f"request-{engine_id}",
        key=f"stream:request-{engine_id}",
        engine_id=engine_id,
        tokenizer=tokenizer,
        prompt_ids=prompt_ids,
        input_tokens=len(prompt_ids),
        stops=stops,
        min_new_tokens=min_new_tokens,
        eos_ids=eos_ids,
        stop_token_ids=stop_token_ids,
        skip_special_tokens=skip_special_tokens,
        return_logprobs=return_logprobs,
        metadata_json=metadata_json,
    )


def _processor(*states: RequestState) -> OutputProcessor:
    processor = OutputProcessor()
    for state in states:
        processor.add(state)
    return processor


def _chunks(ids: Sequence[int], size: int) -> list[list[int]]:
    return [list(ids[start : start + size]) for start in range(0, len(ids), size)]


def _outputs(
    engine_id: int, ids: Sequence[int], size: int, finish: FinishReason | None
) -> list[EngineOutput]:
    """`ids` as outputs of `size` tokens; the last one carries `finish`."""
    chunks = _chunks(ids, size)
    return [
        EngineOutput(engine_id, chunk, finish=finish if n == len(chunks) - 1 else None)
        for n, chunk in enumerate(chunks)
    ]


def _tokens(entries: Sequence[Entry], key: str | None = None) -> list[Fields]:
    return [
        fields
        for entry_key, _, fields in entries
        if fields["event"] == "token" and (key is None or entry_key == key)
    ]


def _texts(entries: Sequence[Entry], key: str | None = None) -> list[str]:
    texts = [fields["text"] for fields in _tokens(entries, key)]
    assert all(isinstance(text, str) for text in texts)
    return [str(text) for text in texts]


def _terminal(entries: Sequence[Entry], key: str) -> tuple[str, Fields]:
    terminals = [(eid, f) for k, eid, f in entries if k == key and f["event"] != "token"]
    assert len(terminals) == 1, f"one terminal entry expected, got {terminals}"
    return terminals[0]


def _run(processor: OutputProcessor, outputs: Sequence[EngineOutput]) -> list[Entry]:
    """Process the outputs one engine step at a time; all entries, in order."""
    entries: list[Entry] = []
    for output in outputs:
        entries.extend(processor.process([output]).entries)
    return entries


def _earliest_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop occurrence that ends first; the longer one on a tie."""
    found = [(text.find(stop) + len(stop), -len(stop), stop) for stop in stops if stop in text]
    if not found:
        return None
    end, negative_length, stop = min(found)
    return end + negative_length, stop


# -- indices, entry ids, the done entry -------------------------------------------------------


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize("size", [1, 3, 1000], ids=["1-per-output", "3-per-output", "all-in-one"])
@pytest.mark.parametrize("metadata", [None, '{"user": "u1", "n": 2}'], ids=["no-meta", "meta"])
def test_indices_entry_ids_and_done_fields(
    request: pytest.FixtureRequest, tokenizer_name: str, size: int, metadata: str | None
) -> None:
    tokenizer = _get_tokenizer(request, tokenizer_name)
    state = _state(tokenizer, metadata_json=metadata)
    processor = _processor(state)
    ids = tokenizer.encode(CONTINUATION).ids
    n = len(ids)

    entries = _run(processor, _outputs(state.engine_id, ids, size, FinishReason.LENGTH))

    assert {key for key, _, _ in entries} == {state.key}
    tokens = _tokens(entries)
    assert [fields["index"] for fields in tokens] == list(range(n))
    assert [fields["token_id"] for fields in tokens] == ids
    assert [eid for _, eid, _ in entries] == [entry_id(seq) for seq in range(1, n + 2)]
    assert [eid for _, eid, _ in entries] == [f"0-{seq}" for seq in range(1, n + 2)]
    assert set(tokens[0]) == {"event", "index", "token_id", "text"}
    terminal_id, done = _terminal(entries, state.key)
    assert terminal_id == f"0-{n + 1}"
    assert entries[-1][2] is done
    expected_done: Fields = {
        "event": "done",
        "finish_reason": "length",
        "generated_tokens": n,
        "input_tokens": len(tokenizer.encode(PROMPT).ids),
        "generated_text": _suffix(tokenizer, tokenizer.encode(PROMPT).ids, ids),
    }
    if metadata is not None:
        expected_done["metadata"] = metadata
    assert done == expected_done
    assert "".join(_texts(entries)) == done["generated_text"]
    assert len(processor) == 0


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_no_token_entry_holds_a_partial_character(
    request: pytest.FixtureRequest, tokenizer_name: str
) -> None:
    tokenizer = _get_tokenizer(request, tokenizer_name)
    state = _state(tokenizer)
    ids = tokenizer.encode(CONTINUATION).ids

    entries = _run(_processor(state), _outputs(state.engine_id, ids, 1, FinishReason.LENGTH))

    assert [text for text in _texts(entries) if "\ufffd" in text] == []


def test_batch_reports_tokens_first_tokens_and_finished(byte_tokenizer: Tokenizer) -> None:
    state = _state(byte_tokenizer)
    processor = _processor(state)
    ids = byte_tokenizer.encode(" abcdef").ids

    first = processor.process([EngineOutput(state.engine_id, ids[:3])])
    second = processor.process([EngineOutput(state.engine_id, ids[3:], finish=FinishReason.LENGTH)])

    assert (first.tokens, second.tokens) == (3, len(ids) - 3)
    assert (first.first_tokens, second.first_tokens) == ([state], [])
    assert (first.finished, first.aborts) == ([], [])
    [(finished_state, terminal)] = second.finished
    assert finished_state is state
    assert terminal.generated_tokens == len(ids)
    assert terminal.outcome == "done:length"
    assert terminal.fields == second.entries[-1][2]


def test_several_requests_in_one_batch(byte_tokenizer: Tokenizer, bpe_tokenizer: Tokenizer) -> None:
    one = _state(byte_tokenizer, engine_id=1)
    two = _state(bpe_tokenizer, engine_id=2)
    three = _state(bpe_tokenizer, engine_id=3, prompt="日本")
    processor = _processor(one, two, three)
    ids_one = byte_tokenizer.encode(" un deux").ids
    ids_two = bpe_tokenizer.encode(" hello tokenizers").ids
    ids_three = bpe_tokenizer.encode("語のテキスト").ids

    batch = processor.process(
        [
            EngineOutput(1, ids_one[:2]),
            EngineOutput(2, ids_two[:1]),
            EngineOutput(3, ids_three, finish=FinishReason.LENGTH),
            EngineOutput(1, ids_one[2:], finish=FinishReason.LENGTH),
            EngineOutput(2, ids_two[1:]),
        ]
    )

    assert batch.tokens == len(ids_one) + len(ids_two) + len(ids_three)
    assert batch.first_tokens == [one, two, three]
    for state, tokenizer, prompt, ids in (
        (one, byte_tokenizer, PROMPT, ids_one),
        (two, bpe_tokenizer, PROMPT, ids_two),
        (three, bpe_tokenizer, "日本", ids_three),
    ):
        own = [(eid, fields) for key, eid, fields in batch.entries if key == state.key]
        tokens = [fields for _, fields in own if fields["event"] == "token"]
        assert [fields["index"] for fields in tokens] == list(range(len(ids)))
        assert [fields["token_id"] for fields in tokens] == ids
        assert [eid for eid, _ in own][: len(ids)] == [entry_id(i + 1) for i in range(len(ids))]
        expected = _suffix(tokenizer, tokenizer.encode(prompt).ids, ids)
        assert "".join(_texts(batch.entries, state.key)) == expected
    assert {state.engine_id for state, _ in batch.finished} == {1, 3}
    assert len(processor) == 1
    assert processor.drop(two)  # still running in the engine
    assert len(processor) == 0
    for state in (one, three):
        terminal_id, done = _terminal(batch.entries, state.key)
        assert terminal_id == entry_id(state.next_index + 1)
        assert done["generated_text"] == "".join(_texts(batch.entries, state.key))


# -- stop sequences -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "finish",
    [None, FinishReason.LENGTH],
    ids=["engine-still-running", "output-was-final"],
)
def test_two_stops_in_one_output_earliest_completes(
    byte_tokenizer: Tokenizer, finish: FinishReason | None
) -> None:
    state = _state(byte_tokenizer, stops=["abcd", "bc"])
    processor = _processor(state)
    ids = byte_tokenizer.encode("xxabcdyy").ids

    batch = processor.process([EngineOutput(state.engine_id, ids, finish=finish)])

    tokens = _tokens(batch.entries)
    assert [fields["token_id"] for fields in tokens] == ids[:5]  # up to the 'c' of "bc"
    terminal_id, done = _terminal(batch.entries, state.key)
    assert terminal_id == entry_id(6)
    assert done["finish_reason"] == "stop_sequence"
    assert done["generated_tokens"] == 5
    assert done["generated_text"] == "xxa" == "".join(_texts(batch.entries))
    assert batch.aborts == ([] if finish is not None else [state.engine_id])
    assert len(processor) == 0
    later = processor.process([EngineOutput(state.engine_id, ids[5:], finish=FinishReason.LENGTH)])
    assert (later.entries, later.finished, later.aborts, later.tokens) == ([], [], [], 0)


def test_two_stops_in_one_output_with_multi_character_tokens(bpe_tokenizer: Tokenizer) -> None:
    tokenizer = bpe_tokenizer
    text = " world, hello tokenizers! Streaming text"
    stops = ["tokenizers", "hello tok"]
    state = _state(tokenizer, stops=stops)
    processor = _processor(state)
    prompt = tokenizer.encode(PROMPT).ids
    ids = tokenizer.encode(text).ids
    # The token that completes the first stop, and the text before that stop.
    count = next(
        k
        for k in range(1, len(ids) + 1)
        if _earliest_stop(_suffix(tokenizer, prompt, ids[:k]), stops)
    )
    found = _earliest_stop(_suffix(tokenizer, prompt, ids[:count]), stops)
    assert found is not None
    start, stop = found
    assert count < len(ids), "test data: tokens follow the stop"

    batch = processor.process([EngineOutput(state.engine_id, ids)])

    assert stop == "hello tok"
    assert len(_tokens(batch.entries)) == count
    _, done = _terminal(batch.entries, state.key)
    expected = _suffix(tokenizer, prompt, ids[:count])[:start]
    assert done["generated_text"] == expected == "".join(_texts(batch.entries))
    assert batch.aborts == [state.engine_id]


def test_stop_spanning_outputs(byte_tokenizer: Tokenizer) -> None:
    state = _state(byte_tokenizer, stops=["STOP"])
    processor = _processor(state)
    ids = byte_tokenizer.encode(" go ST").ids
    rest = byte_tokenizer.encode("OP more").ids

    first = processor.process([EngineOutput(state.engine_id, ids)])
    second = processor.process([EngineOutput(state.engine_id, rest)])

    assert "".join(_texts(first.entries)) == " go "  # "ST" is held back
    assert len(_tokens(second.entries)) == 2
    _, done = _terminal(second.entries, state.key)
    assert done["generated_text"] == " go "
    assert second.aborts == [state.engine_id]


def test_held_back_text_is_released_with_the_final_token(byte_tokenizer: Tokenizer) -> None:
    state = _state(byte_tokenizer, stops=["STOP"])
    ids = byte_tokenizer.encode(" go ST").ids

    entries = _run(
        _processor(state), [EngineOutput(state.engine_id, ids, finish=FinishReason.LENGTH)]
    )

    texts = _texts(entries)
    assert texts[-1] == "ST"
    _, done = _terminal(entries, state.key)
    assert done["generated_text"] == "".join(texts) == " go ST"


def test_stop_before_min_new_tokens_is_not_honoured(byte_tokenizer: Tokenizer) -> None:
    state = _state(byte_tokenizer, stops=["ab"], min_new_tokens=4)
    ids = byte_tokenizer.encode("xabab").ids  # the first "ab" ends at token 3, the second at 5

    batch = _processor(state).process([EngineOutput(state.engine_id, ids)])

    _, done = _terminal(batch.entries, state.key)
    assert done["generated_text"] == "xab"
    assert done["generated_tokens"] == 5


# -- EOS --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_eos_token_text_is_not_published(
    request: pytest.FixtureRequest, tokenizer_name: str
) -> None:
    tokenizer = _get_tokenizer(request, tokenizer_name)
    eos = tokenizer.token_to_id(EOS)
    assert eos is not None
    state = _state(tokenizer, eos_ids=frozenset({eos}))
    ids = [*tokenizer.encode(" fin 日本").ids, eos]

    entries = _run(_processor(state), _outputs(state.engine_id, ids, 2, FinishReason.EOS_TOKEN))

    tokens = _tokens(entries)
    assert tokens[-1]["token_id"] == eos
    assert tokens[-1]["text"] == ""
    _, done = _terminal(entries, state.key)
    assert done["finish_reason"] == "eos_token"
    assert done["generated_tokens"] == len(ids)
    expected = _suffix(tokenizer, tokenizer.encode(PROMPT).ids, ids[:-1])
    assert done["generated_text"] == expected == "".join(_texts(entries))
    assert EOS not in str(done["generated_text"])


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_eos_text_is_published_when_eos_is_ignored_and_specials_kept(
    request: pytest.FixtureRequest, tokenizer_name: str
) -> None:
    tokenizer = _get_tokenizer(request, tokenizer_name)
    eos = tokenizer.token_to_id(EOS)
    assert eos is not None
    state = _state(tokenizer, eos_ids=frozenset(), skip_special_tokens=False)  # ignore_eos
    prompt = tokenizer.encode(PROMPT).ids
    ids = [*tokenizer.encode(" fin").ids, eos]

    entries = _run(
        _processor(state), [EngineOutput(state.engine_id, ids, finish=FinishReason.EOS_TOKEN)]
    )

    eos_text = _suffix(tokenizer, [*prompt, *ids[:-1]], ids[-1:])
    assert eos_text == EOS
    assert _texts(entries)[-1] == eos_text
    _, done = _terminal(entries, state.key)
    assert done["generated_text"] == _suffix(tokenizer, prompt, ids) == "".join(_texts(entries))


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_special_token_text_is_skipped_by_default(
    request: pytest.FixtureRequest, tokenizer_name: str
) -> None:
    """With `ignore_eos` a generated EOS does not end the request; its text `</s>` is
    left out unless the job asks for special tokens."""
    tokenizer = _get_tokenizer(request, tokenizer_name)
    eos = tokenizer.token_to_id(EOS)
    assert eos is not None
    state = _state(tokenizer, eos_ids=frozenset())  # ignore_eos
    before = tokenizer.encode(" fin").ids
    ids = [*before, eos, *tokenizer.encode(" more").ids]
    entries = _run(
        _processor(state), [EngineOutput(state.engine_id, ids, finish=FinishReason.LENGTH)]
    )
    texts = _texts(entries)
    assert len(texts) == len(ids)  # still one entry per token
    assert texts[len(before)] == ""  # the EOS entry
    _, done = _terminal(entries, state.key)
    assert EOS not in str(done["generated_text"])
    assert done["generated_text"] == "".join(texts)


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_a_stop_token_id_ends_with_stop_sequence_and_no_text(
    request: pytest.FixtureRequest, tokenizer_name: str
) -> None:
    tokenizer = _get_tokenizer(request, tokenizer_name)
    stop = tokenizer.encode("!").ids[-1]
    ids = [*tokenizer.encode(" one two").ids, stop]
    assert stop not in ids[:-1]
    state = _state(tokenizer, stop_token_ids=frozenset({stop}), skip_special_tokens=False)
    entries = _run(
        _processor(state), [EngineOutput(state.engine_id, ids, finish=FinishReason.STOP_SEQUENCE)]
    )
    texts = _texts(entries)
    assert texts[-1] == ""
    _, done = _terminal(entries, state.key)
    assert done["finish_reason"] == "stop_sequence"
    assert (
        done["generated_text"]
        == "".join(texts)
        == _suffix(tokenizer, tokenizer.encode(PROMPT).ids, ids[:-1])
    )


def test_eos_token_carries_held_back_and_unfinished_text(byte_tokenizer: Tokenizer) -> None:
    eos = byte_tokenizer.token_to_id(EOS)
    assert eos is not None
    state = _state(byte_tokenizer, stops=["STOP"], eos_ids=frozenset({eos}))
    unfinished = list("日".encode()[:2])
    ids = [*byte_tokenizer.encode(" go ST").ids, *unfinished, eos]

    entries = _run(
        _processor(state), [EngineOutput(state.engine_id, ids, finish=FinishReason.EOS_TOKEN)]
    )

    texts = _texts(entries)
    replaced = bytes(unfinished).decode("utf-8", errors="replace")
    assert texts[-1] == "ST" + replaced
    _, done = _terminal(entries, state.key)
    assert done["generated_text"] == "".join(texts) == " go ST" + replaced


# -- cancel, deadline, errors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("abort_cause", "expected"),
    [
        pytest.param(None, "cancelled", id="cancelled"),
        pytest.param(FinishReason.DEADLINE, "deadline", id="deadline"),
    ],
)
@pytest.mark.parametrize("published", [0, 3], ids=["no-tokens", "after-tokens"])
def test_cancelled_finish(
    byte_tokenizer: Tokenizer, abort_cause: FinishReason | None, expected: str, published: int
) -> None:
    state = _state(byte_tokenizer)
    processor = _processor(state)
    ids = byte_tokenizer.encode(" abc").ids[:published]
    if ids:
        processor.process([EngineOutput(state.engine_id, ids)])
    state.abort_cause = abort_cause

    batch = processor.process([EngineOutput(state.engine_id, [], finish=FinishReason.CANCELLED)])

    [(key, terminal_id, done)] = batch.entries
    assert (key, terminal_id) == (state.key, entry_id(published + 1))
    assert done["event"] == "done"
    assert done["finish_reason"] == expected
    assert done["generated_tokens"] == published
    assert done["generated_text"] == _suffix(byte_tokenizer, byte_tokenizer.encode(PROMPT).ids, ids)
    assert batch.first_tokens == []
    assert len(processor) == 0


def test_abort_cause_does_not_override_a_natural_finish(byte_tokenizer: Tokenizer) -> None:
    state = _state(byte_tokenizer)
    state.abort_cause = FinishReason.DEADLINE

    batch = _processor(state).process(
        [EngineOutput(state.engine_id, [97], finish=FinishReason.LENGTH)]
    )

    assert _terminal(batch.entries, state.key)[1]["finish_reason"] == "length"


def test_error_output_ends_the_request_with_engine_error(byte_tokenizer: Tokenizer) -> None:
    state = _state(byte_tokenizer)
    processor = _processor(state)
    processor.process([EngineOutput(state.engine_id, byte_tokenizer.encode(" ab").ids)])

    batch = processor.process(
        [EngineOutput(state.engine_id, [], error="CUDA error:\n  an illegal memory access")]
    )

    [(key, terminal_id, fields)] = batch.entries
    assert (key, terminal_id) == (state.key, entry_id(4))
    assert fields == {
        "event": "error",
        "code": "engine_error",
        "message": "CUDA error: an illegal memory access",
    }
    [(_, terminal)] = batch.finished
    assert terminal.outcome == "error:engine_error"
    assert terminal.generated_tokens == 3
    assert len(processor) == 0
    assert processor.process([EngineOutput(state.engine_id, [97])]).entries == []


def test_outputs_of_unknown_requests_are_ignored(byte_tokenizer: Tokenizer) -> None:
    state = _state(byte_tokenizer, engine_id=1)
    processor = _processor(state)

    batch = processor.process(
        [EngineOutput(99, [97], finish=FinishReason.LENGTH), EngineOutput(1, [98])]
    )

    assert [key for key, _, _ in batch.entries] == [state.key]
    assert batch.tokens == 1


# -- logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("return_logprobs", [True, False], ids=["requested", "not-requested"])
def test_logprob_field_only_when_requested(
    byte_tokenizer: Tokenizer, return_logprobs: bool
) -> None:
    state = _state(byte_tokenizer, return_logprobs=return_logprobs)
    ids = byte_tokenizer.encode(" abc").ids
    logprobs = [-0.5 * (n + 1) for n in range(len(ids))]

    batch = _processor(state).process(
        [EngineOutput(state.engine_id, ids, logprobs=logprobs, finish=FinishReason.LENGTH)]
    )

    tokens = _tokens(batch.entries)
    if return_logprobs:
        assert [fields["logprob"] for fields in tokens] == logprobs
    else:
        assert [fields for fields in tokens if "logprob" in fields] == []
    _, done = _terminal(batch.entries, state.key)
    assert "logprob" not in done


# -- resume -----------------------------------------------------------------------------------


RESUME_CASES = [
    pytest.param(CONTINUATION, (), id="multibyte"),
    pytest.param(" one STOP never completes: ST", ("STOP!",), id="held-back-at-cut"),
]


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize(("text", "stops"), RESUME_CASES)
@pytest.mark.parametrize("cut", [1, 4, 9])
def test_replay_reproduces_the_live_texts(
    request: pytest.FixtureRequest,
    tokenizer_name: str,
    text: str,
    stops: tuple[str, ...],
    cut: int,
) -> None:
    """A redelivered job replays the tokens an earlier attempt published: same texts,
    same next index, and the continuation publishes what the live run would have."""
    tokenizer = _get_tokenizer(request, tokenizer_name)
    ids = tokenizer.encode(text).ids
    assert cut < len(ids)
    live = _state(tokenizer, stops=stops)
    live_processor = _processor(live)
    published = _run(live_processor, _outputs(live.engine_id, ids[:cut], 2, None))

    resumed = _state(tokenizer, stops=stops)
    finish = resumed.replay(ids[:cut])

    assert finish is None
    assert resumed.texts == _texts(published) == live.texts
    assert resumed.next_index == cut
    rest = [EngineOutput(live.engine_id, ids[cut:], finish=FinishReason.LENGTH)]
    assert _run(_processor(resumed), rest) == _run(live_processor, rest)


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_replay_of_a_completed_stop_returns_stop_sequence(
    request: pytest.FixtureRequest, tokenizer_name: str
) -> None:
    tokenizer = _get_tokenizer(request, tokenizer_name)
    stops = ["hello tok"]
    ids = tokenizer.encode(" world, hello tokenizers! Streaming").ids
    live = _state(tokenizer, stops=stops)
    batch = _processor(live).process([EngineOutput(live.engine_id, ids)])
    published = [int(fields["token_id"]) for fields in _tokens(batch.entries)]
    assert len(published) < len(ids), "test data: the stop completes before the end"

    resumed = _state(tokenizer, stops=stops)
    finish = resumed.replay(published)

    assert finish is FinishReason.STOP_SEQUENCE
    assert resumed.texts == _texts(batch.entries)
    assert resumed.done_fields(FinishReason.STOP_SEQUENCE) == _terminal(batch.entries, live.key)[1]


def test_the_registry_holds_a_request_until_its_terminal_entry_is_stored(
    byte_tokenizer: Tokenizer,
) -> None:
    """One registry, two phases: finished by `process` (no more outputs taken), a request
    is still in hand, so a hand-back reaches it, until `settle`."""
    one, two = _state(byte_tokenizer, engine_id=1), _state(byte_tokenizer, engine_id=2)
    processor = _processor(one, two)
    assert processor.get(one.request_id) is one
    assert processor.with_key(two.key) is two
    batch = processor.process([EngineOutput(1, [97], finish=FinishReason.LENGTH)])
    assert [state for state, _ in batch.finished] == [one]
    assert (len(processor), processor.in_hand) == (1, 2)
    assert processor.get(one.request_id) is one  # its terminal entry is being written
    assert processor.process([EngineOutput(1, [98])]).entries == []  # no more outputs
    processor.settle(one)
    assert processor.get(one.request_id) is None
    assert processor.drop(two)  # still in the engine: the caller cancels it there
    assert not processor.drop(two)
    assert (len(processor), processor.in_hand, processor.states()) == (0, 0, [])
