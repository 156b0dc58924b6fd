"""Engine outputs → stream entries. The event loop owns every request's state here:
its detokenizer, its stop gate, its next index. A stop match becomes an abort for the
engine. `OutputProcessor.process` is the only loop over engine outputs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.crc import key_slot
from tokenizers import Tokenizer

from trtllm_worker.contract.errors import ENGINE_ERROR, INTERNAL_ERROR
from trtllm_worker.contract.stream import Fields, FinishReason, entry_id, error_fields, lease_key
from trtllm_worker.engine.base import EngineOutput, TopLogprobs
from trtllm_worker.pipeline.detokenize import IncrementalDetokenizer, StopGate
from trtllm_worker.streams.usage import UsageKeys
from trtllm_worker.streams.wire import Entry, WriteBatch, top_json

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Terminal:
    """How a request ended, as stored in its terminal entry."""

    fields: Fields
    generated_tokens: int

    @property
    def outcome(self) -> str:
        """`done:<finish_reason>` or `error:<code>`, for metrics and logs."""
        event = str(self.fields["event"])
        detail = self.fields.get("finish_reason", self.fields.get("code", ""))
        return f"{event}:{detail}"


class RequestState:
    """Everything the event loop knows about one running request."""

    __slots__ = (
        "_detok",
        "_gate",
        "abort_cause",
        "adapter",
        "done",
        "end_ids",
        "engine_id",
        "eos_ids",
        "first_token_at",
        "input_tokens",
        "key",
        "lease",
        "metadata_json",
        "next_index",
        "pieces",
        "plain",
        "request_id",
        "return_logprobs",
        "script_keys",
        "slot",
        "stop_token_ids",
        "tenant",
        "texts",
        "top_logprobs",
    )

    def __init__(
        self,
        *,
        request_id: str,
        key: str,
        engine_id: int,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        input_tokens: int,
        stops: Sequence[str] = (),
        min_new_tokens: int = 0,
        eos_ids: frozenset[int] = frozenset(),
        stop_token_ids: frozenset[int] = frozenset(),
        skip_special_tokens: bool = True,
        return_logprobs: bool = False,
        top_logprobs: int = 0,
        metadata_json: str | None = None,
        lease: str = "",
        tenant: str | None = None,
        adapter: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.tenant = tenant
        """Whom the job is for: its terminal entry counts its usage under it."""
        self.adapter = adapter
        """The job's LoRA adapter: its usage is also counted under it, per tenant."""
        self.key = key
        self.script_keys = (key, lease_key(key))
        self.slot = key_slot(key.encode())
        """The stream's hash slot (a cluster writes each slot in a call of its own)."""
        self.lease = lease
        """The token of the lease this attempt holds: every write is fenced by it."""
        self.engine_id = engine_id
        self.input_tokens = input_tokens
        self.eos_ids = eos_ids
        self.stop_token_ids = stop_token_ids
        self.end_ids = eos_ids | stop_token_ids
        self.return_logprobs = return_logprobs
        self.top_logprobs = top_logprobs
        """How many top logprobs its token entries carry (0: no such field)."""
        self.metadata_json = metadata_json
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._gate = StopGate(stops, min_new_tokens)
        self.plain = not self._gate.active and not return_logprobs
        """No stop sequence to look for, no logprobs: a step that ends nothing is only
        its tokens' texts (`OutputProcessor.process`'s fast path)."""
        self.pieces = self._detok.pieces
        self.next_index = 0
        self.texts: list[str] = []
        self.abort_cause: FinishReason | None = None
        self.first_token_at: float | None = None
        self.done: asyncio.Future[Terminal] | None = None

    def token_text(self, token_id: int, *, last: bool) -> str:
        """Advance by one token; return the text its entry carries. `last` marks the
        request's final token: then everything still held back is released."""
        # The text of an EOS or stop token id is never published (eos_ids is empty with
        # ignore_eos); the echo engine can emit one before min_new_tokens, a model cannot.
        text = "" if token_id in self.end_ids else self._detok.step(token_id)
        if last:
            text += self._detok.flush()
        released = self._gate.push(text, self.next_index + 1)
        if last and self._gate.matched is None:
            released += self._gate.flush()
        self.next_index += 1
        self.texts.append(released)
        return released

    def take(self, token_ids: Sequence[int], *, final: bool) -> int:
        """Advance by one step's tokens (`final`: the request's last step); their texts
        are appended to `texts`. Returns how many were taken: fewer than given when a
        stop sequence matched (the rest are never published). Without stop sequences
        and end ids among them, one pass with no per-token Python beyond the decoder."""
        if (
            not final
            and not self._gate.active
            and (not self.end_ids or self.end_ids.isdisjoint(token_ids))
        ):
            try:
                self._detok.extend(token_ids, self.texts)
            finally:  # a decoder failure keeps the texts before it, as token_text does
                self.next_index = len(self.texts)
            return len(token_ids)
        last = len(token_ids) - 1
        for position, token_id in enumerate(token_ids):
            self.token_text(token_id, last=final and position == last)
            if self._gate.matched is not None:
                return position + 1
        return len(token_ids)

    @property
    def stopped(self) -> bool:
        return self._gate.matched is not None

    def done_fields(self, finish: FinishReason) -> Fields:
        fields: Fields = {
            "event": "done",
            "finish_reason": finish.value,
            "generated_tokens": self.next_index,
            "input_tokens": self.input_tokens,
            "generated_text": "".join(self.texts),
        }
        if self.metadata_json is not None:
            fields["metadata"] = self.metadata_json
        return fields

    def replay(self, token_ids: Sequence[int]) -> FinishReason | None:
        """Rebuild the state from tokens an earlier attempt published (resume). Returns
        the finish reason if that attempt had already finished without storing it."""
        for token_id in token_ids:
            self.token_text(token_id, last=False)
            if self.stopped:
                return FinishReason.STOP_SEQUENCE
        return None


@dataclass(slots=True)
class ProcessedBatch:
    """What one batch of engine outputs turned into: the store's calls, and what
    happened to the requests."""

    write: WriteBatch
    finished: list[tuple[RequestState, Terminal]] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)
    first_tokens: list[RequestState] = field(default_factory=list)
    tokens: int = 0

    @property
    def entries(self) -> list[Entry]:
        """Every entry the batch stores, in order per stream."""
        return self.write.entries()

    @property
    def entry_count(self) -> int:
        return self.tokens + len(self.finished)


def _tops(tops: Sequence[TopLogprobs | None] | None, count: int) -> list[str]:
    """The first `count` tokens' top logprobs as compact JSON, '' where the engine
    gave none."""
    given = [top_json(pairs) for pairs in (tops or [])[:count]]
    return given + [""] * (count - len(given))


def _logprobs(logprobs: Sequence[float | None] | None, count: int) -> list[float | str]:
    """The first `count` logprobs as their shortest round-tripping text, '' where the
    engine gave none."""
    given: list[float | str] = ["" if v is None else repr(v) for v in (logprobs or [])[:count]]
    return given + [""] * (count - len(given))


class OutputProcessor:
    """The registry of running requests (the only one: "is request X running here?" is
    `get`), and the only loop over engine outputs. A request is in hand from `add` until
    its terminal entry is stored (`settle`) or it is dropped (`drop`); its outputs are
    taken, by engine id, until `process` finishes it. Between the two its terminal entry
    is being written: it is still in hand (a hand-back reaches it), no longer in the
    engine."""

    def __init__(
        self, *, cluster: bool = False, usage: UsageKeys | None = None, model: str = ""
    ) -> None:
        self._usage = usage
        self._model = model
        """Where terminal entries count their job's usage (None: not counted)."""
        self._in_hand: dict[str, RequestState] = {}
        """Every registered request, by request id."""
        self._states: dict[int, RequestState] = {}
        """Those whose outputs are still taken, by engine id."""
        self._cluster = cluster

    def __len__(self) -> int:
        """Requests whose outputs are still taken (running in the engine)."""
        return len(self._states)

    @property
    def in_hand(self) -> int:
        return len(self._in_hand)

    def get(self, request_id: str) -> RequestState | None:
        return self._in_hand.get(request_id)

    def with_key(self, key: str) -> RequestState | None:
        return next((s for s in self._in_hand.values() if s.key == key), None)

    def states(self) -> list[RequestState]:
        """The requests in hand, as a list: a caller may drop them as it goes."""
        return list(self._in_hand.values())

    def in_engine(self, state: RequestState) -> bool:
        """Whether its outputs are still taken (it has not finished in the engine)."""
        return self._states.get(state.engine_id) is state

    def add(self, state: RequestState) -> None:
        self._in_hand[state.request_id] = state
        self._states[state.engine_id] = state

    def drop(self, state: RequestState) -> bool:
        """Forget the request: no more outputs taken, out of the registry. True if the
        engine was still running it (the caller cancels it there)."""
        if self._in_hand.get(state.request_id) is state:
            del self._in_hand[state.request_id]
        return self._states.pop(state.engine_id, None) is not None

    def settle(self, state: RequestState) -> None:
        """Its terminal entry is stored: the request is no longer in hand."""
        if self._in_hand.get(state.request_id) is state:
            del self._in_hand[state.request_id]

    def process(self, outputs: Sequence[EngineOutput]) -> ProcessedBatch:
        """Turn outputs into writes. Outputs of requests no longer registered (stopped,
        handed back) are dropped: an engine may deliver a step after an abort."""
        batch = ProcessedBatch(
            WriteBatch(cluster=self._cluster, usage=self._usage, model=self._model)
        )
        write = batch.write
        states = self._states
        for output in outputs:
            state = states.get(output.id)
            if state is None:
                continue
            token_ids = output.token_ids
            if (
                output.finish is None
                and output.error is None
                and state.plain
                and token_ids
                and (not state.end_ids or state.end_ids.isdisjoint(token_ids))
            ):
                # the common step: tokens that end nothing, whole pieces of the table
                texts = state.pieces(token_ids)
                if texts is not None:
                    seq = state.next_index + 1
                    if seq == 1:
                        batch.first_tokens.append(state)
                    write.plain(state.script_keys, state.slot, state.lease, seq, token_ids, texts)
                    state.texts += texts
                    state.next_index += len(texts)
                    batch.tokens += len(texts)
                    continue
            if output.error is not None:
                self._finish(state, error_fields(ENGINE_ERROR, output.error), batch)
                continue
            try:
                self._tokens(state, output, batch)
            except Exception as exc:
                # One request's bad output (a decoder failure) must not stop the others.
                log.exception("request %s: processing its output failed", state.request_id)
                if output.id not in states:
                    continue
                if output.finish is None:
                    batch.aborts.append(state.engine_id)
                self._finish(state, error_fields(INTERNAL_ERROR, f"output failed: {exc}"), batch)
        return batch

    def _tokens(self, state: RequestState, output: EngineOutput, batch: ProcessedBatch) -> None:
        token_ids = output.token_ids
        args = None
        if token_ids:
            if state.next_index == 0:
                batch.first_tokens.append(state)
            before = len(state.texts)
            args = batch.write.begin(state.script_keys, state.slot, state.lease, before + 1)
            try:
                state.take(token_ids, final=output.finish is not None)
            finally:  # what was taken is published, even if a decoder failure follows
                taken = len(state.texts) - before
                if taken:
                    batch.write.tokens(
                        args,
                        token_ids if taken == len(token_ids) else token_ids[:taken],
                        state.texts[before:],
                        _logprobs(output.logprobs, taken) if state.return_logprobs else None,
                        _tops(output.top_logprobs, taken) if state.top_logprobs else None,
                    )
                batch.tokens += taken
            if state.stopped:
                if output.finish is None:
                    batch.aborts.append(state.engine_id)
                self._finish(state, state.done_fields(FinishReason.STOP_SEQUENCE), batch, args)
                return
        if output.finish is not None:
            finish = output.finish
            if finish is FinishReason.CANCELLED and state.abort_cause is not None:
                finish = state.abort_cause
            self._finish(state, state.done_fields(finish), batch, args)

    def _finish(
        self,
        state: RequestState,
        fields: Fields,
        batch: ProcessedBatch,
        args: list[Any] | None = None,
    ) -> None:
        """End the request in the batch: in its open part (`args`), else in a new one."""
        del self._states[state.engine_id]
        if args is None:
            seq = state.next_index + 1
            args = batch.write.begin(state.script_keys, state.slot, state.lease, seq)
        # an engine error counts the prompt too: the engine had it
        batch.write.end(
            args,
            entry_id(state.next_index + 1),
            fields,
            state.tenant,
            state.input_tokens,
            state.adapter,
        )
        batch.finished.append((state, Terminal(fields, state.next_index)))
