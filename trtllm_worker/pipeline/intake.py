"""A job's way in: message bytes → `Job` (validated against the settings' limits) →
prompt token ids and budgets (tokenize, truncate, check the length limits)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from trtllm_worker.config import Settings
from trtllm_worker.contract.errors import InputTooLong, InvalidJob
from trtllm_worker.contract.job import Job, JobLimits, parse_job
from trtllm_worker.engine.base import EngineLimits
from trtllm_worker.engine.lora import Adapter, Adapters
from trtllm_worker.pipeline.chat import render_chat
from trtllm_worker.pipeline.grammar import CompiledGrammar, compile_grammar
from trtllm_worker.tokenizer import TokenizerInfo

TOKENIZE_IN_THREAD_CHARS = 4096
"""Prompts longer than this are tokenized off the event loop, so a huge prompt cannot
stall the AMQP heartbeats."""


@dataclass(frozen=True, slots=True)
class PreparedInput:
    prompt_ids: list[int]
    max_new_tokens: int
    min_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    grammar: CompiledGrammar | None = None


def prepare_input(
    job: Job,
    tokenizer: TokenizerInfo,
    settings: Settings,
    limits: EngineLimits | None = None,
) -> PreparedInput:
    """Raises `InvalidJob` / `InputTooLong` naming the field at fault. `limits` are
    the built engine's: a job it would cut short or ignore in part fails here."""
    params = job.parameters
    engine = limits or EngineLimits()
    for name, why in engine.ignored_parameters.items():
        if getattr(params, name) is not None:
            raise InvalidJob(f"parameters.{name}: {why}", request_id=job.request_id)
    _check_top_logprobs(params.top_logprobs, engine, job.request_id)
    field = "inputs"
    if job.input_ids is not None:
        field = "input_ids"
        _check_vocabulary(job.input_ids, tokenizer, field, job.request_id)
        ids = list(job.input_ids)
    elif job.messages is not None:
        field = "messages"
        template = tokenizer.chat_template
        if job.tools is not None and tokenizer.tool_chat_template is not None:
            template = tokenizer.tool_chat_template
        text = render_chat(
            template,
            [message.model_dump(exclude_none=True) for message in job.messages],
            special_tokens=tokenizer.special_tokens,
            tools=job.tools,
            template_kwargs=job.chat_template_kwargs,
            request_id=job.request_id,
        )
        # the template wrote the special tokens itself (as transformers does)
        ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    else:
        assert job.inputs is not None  # the schema guarantees exactly one prompt
        ids = tokenizer.tokenizer.encode(
            job.inputs, add_special_tokens=params.add_special_tokens
        ).ids
    if not ids:
        raise InvalidJob(f"{field}: the prompt has no tokens", request_id=job.request_id)
    if params.truncate is not None and len(ids) > params.truncate:
        ids = ids[-params.truncate :]
    if len(ids) > settings.max_input_tokens:
        hint = "" if params.truncate is not None else "; set parameters.truncate to keep the end"
        raise InputTooLong(
            f"{field}: {len(ids)} tokens, the limit is {settings.max_input_tokens}{hint}",
            request_id=job.request_id,
        )
    max_new = job.max_new_tokens(job_limits(settings))
    _check_engine_limits(len(ids), max_new, engine, field, job.request_id)
    stop_ids = params.stop_token_ids or []
    _check_vocabulary(stop_ids, tokenizer, "parameters.stop_token_ids", job.request_id)
    grammar = None
    if params.grammar is not None:
        grammar = compile_grammar(params.grammar, settings.guided_decoding, job.request_id)
    # The schema bounds max_new_tokens by WORKER_MAX_NEW_TOKENS and the check above the
    # prompt by WORKER_MAX_INPUT_TOKENS, so their sum is within the contract's total.
    return PreparedInput(ids, max_new, params.min_new_tokens or 0, frozenset(stop_ids), grammar)


def _check_top_logprobs(wanted: int | None, limits: EngineLimits, request_id: str) -> None:
    """A job asking for more top logprobs than the engine returns is refused: fewer (or
    none) would look like a model that had no other candidates."""
    if wanted is None or wanted <= limits.max_top_logprobs:
        return
    if limits.max_top_logprobs == 0:
        raise InvalidJob(
            f"parameters.top_logprobs: this engine cannot return top logprobs "
            f"({limits.top_logprobs_why})",
            request_id=request_id,
        )
    raise InvalidJob(
        f"parameters.top_logprobs: {wanted} is more than this engine returns "
        f"({limits.max_top_logprobs}; {limits.top_logprobs_why})",
        request_id=request_id,
    )


def _check_engine_limits(
    prompt: int, max_new: int, limits: EngineLimits, field: str, request_id: str
) -> None:
    """TensorRT-LLM rejects only a prompt over `max_num_tokens`; past `max_seq_len` it
    stops generating and reports `length`, a short stream that looks complete.

    A job resumed after a redelivery submits its prompt with the tokens already
    published, at most `max_new - 1` of them (with all of them it ends at once): that
    longest resume must fit `max_num_tokens` too, or the job would fail with
    `engine_error` only because it was resumed. It is refused here instead, whether or
    not it would ever be resumed, so a job's fate does not depend on a redelivery."""
    if limits.max_num_tokens is not None and prompt > limits.max_num_tokens:
        raise InputTooLong(
            f"{field}: {prompt} tokens, the engine takes prompts of at most "
            f"{limits.max_num_tokens} (max_num_tokens)",
            request_id=request_id,
        )
    if limits.max_num_tokens is not None and prompt + max_new - 1 > limits.max_num_tokens:
        raise InputTooLong(
            f"{field}: {prompt} tokens + max_new_tokens {max_new} - 1 = {prompt + max_new - 1}, "
            f"over the engine's max_num_tokens {limits.max_num_tokens} (a job resumed after a "
            "redelivery submits its prompt with the tokens already generated); lower "
            f"max_new_tokens to {limits.max_num_tokens - prompt + 1} or set parameters.truncate",
            request_id=request_id,
        )
    if limits.max_seq_len is not None and prompt + max_new > limits.max_seq_len:
        raise InputTooLong(
            f"{field}: {prompt} tokens + max_new_tokens {max_new} = {prompt + max_new}, over "
            f"the engine's max_seq_len {limits.max_seq_len}; lower max_new_tokens or set "
            "parameters.truncate",
            request_id=request_id,
        )


def _check_vocabulary(
    ids: Sequence[int], tokenizer: TokenizerInfo, field: str, request_id: str
) -> None:
    bad = next((i for i in ids if i >= tokenizer.vocab_size), None)
    if bad is not None:
        raise InvalidJob(
            f"{field}: id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})",
            request_id=request_id,
        )


def check_adapter(job: Job, adapters: Adapters) -> Adapter | None:
    """The job's LoRA adapter; `InvalidJob` naming `adapter` when the worker has no
    such adapter (with no `WORKER_LORA_DIR` it has none)."""
    if job.adapter is None:
        return None
    adapter = adapters.get(job.adapter)
    if adapter is None:
        known = ", ".join(adapters) if adapters else "none (WORKER_LORA_DIR is unset or empty)"
        raise InvalidJob(
            f"adapter: unknown adapter {job.adapter!r}; this worker's adapters: {known}",
            request_id=job.request_id,
            tenant=job.tenant,
        )
    return adapter


def job_limits(settings: Settings) -> JobLimits:
    return JobLimits(settings.max_new_tokens, settings.default_max_new_tokens)


class Intake:
    """Validates and tokenizes jobs with one worker's settings and tokenizer."""

    def __init__(
        self,
        settings: Settings,
        tokenizer: TokenizerInfo,
        engine: EngineLimits | None = None,
        adapters: Adapters | None = None,
    ) -> None:
        self._settings = settings
        self._limits = job_limits(settings)
        self._engine = engine or EngineLimits()
        self.tokenizer = tokenizer
        self.adapters = adapters or Adapters()

    def read(self, body: bytes, *, content_type: str | None, message_id: str | None) -> Job:
        """The job in a message body; `InvalidJob` naming the field (an unknown
        `adapter` included: it can never run here, so it is dead-lettered)."""
        job = parse_job(body, content_type=content_type, message_id=message_id, limits=self._limits)
        check_adapter(job, self.adapters)
        return job

    async def prepare(self, job: Job) -> PreparedInput:
        """Render and tokenize: off the event loop for long prompts."""
        if _prompt_chars(job) > TOKENIZE_IN_THREAD_CHARS:
            return await asyncio.to_thread(
                prepare_input, job, self.tokenizer, self._settings, self._engine
            )
        return prepare_input(job, self.tokenizer, self._settings, self._engine)


def _prompt_chars(job: Job) -> int:
    if job.inputs is not None:
        return len(job.inputs)
    if job.messages is not None:
        return sum(len(m.content) for m in job.messages)
    return 0
