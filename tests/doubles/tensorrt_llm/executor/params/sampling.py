# mirrors tensorrt_llm/sampling_params.py of 1.2.x (checked against the 1.2.0rc2 tag b35ac1b6),
# which the 1.4 line moved to tensorrt_llm/executor/params/sampling.py (@ 1f064c46).
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    """One guide per request (sampling_params.py @ b35ac1b6): a JSON Schema (str, dict or
    pydantic model), a regex, an EBNF grammar, any JSON object, or a structural tag."""

    json: str | Any | dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def _validate(self) -> None:
        count = sum(
            1
            for v in (self.json, self.regex, self.grammar, self.json_object, self.structural_tag)
            if v
        )
        if count > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {count}.")


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """LLM API sampling parameters.  None means "C++ runtime default" for the sampling fields
    (top_k 0 = all logits, top_p 0, temperature 1.0, min_tokens 1, seed 0)."""

    end_id: int | None = None
    pad_id: int | None = None  # set to end_id by __post_init__ when None
    max_tokens: int = 32
    bad: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    _bad_word_ids: list[list[int]] | None = field(default=None, init=False, repr=False)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    _stop_word_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    embedding_bias: Any | None = None
    logits_processor: Any | None = None
    apply_batched_logits_processor: bool = False

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False

    top_k: int | None = None
    top_p: float | None = None
    top_p_min: float | None = None
    top_p_reset_ids: int | None = None
    top_p_decay: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    beam_search_diversity_rate: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    prompt_ignore_length: int | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    no_repeat_ngram_size: int | None = None
    min_p: float | None = None
    beam_width_array: list[int] | None = None

    # logprobs = K: the top-K logprobs per output token; 0 and None both mean "none"
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: list[str] | None = None

    lookahead_config: Any | None = None
    guided_decoding: GuidedDecodingParams | None = None

    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        self._validate()

    def _validate(self) -> None:
        if self.top_p is not None and (self.top_p < 0 or self.top_p > 1):
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        greedy_many = self.best_of is not None and self.best_of > 1 and self._greedy_decoding
        if greedy_many and not os.environ.get("TLLM_ALLOW_N_GREEDY_DECODING"):
            raise ValueError(
                "Greedy decoding in the LLM API does not allow multiple returns. "
                f"Please set to best_of=1, got best_of={self.best_of}."
            )
        if self.guided_decoding is not None:
            self.guided_decoding._validate()
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}"
            )
        # logprobs=True means top-1; note ``0 and int(0)`` stays 0, i.e. no logprobs at all
        self.logprobs = self.logprobs and int(self.logprobs)
        self.prompt_logprobs = self.prompt_logprobs and int(self.prompt_logprobs)

    @property
    def _greedy_decoding(self) -> bool:
        t, p, k = self.temperature, self.top_p, self.top_k
        implied = (t is None and p is None and k is None) or k == 1 or p == 0.0 or t == 0
        return not self.use_beam_search and implied

    def _get_stop_words(self) -> list[list[int]]:
        words = [[i] for i in self.stop_token_ids] if self.stop_token_ids else []
        if self.stop is None:
            return words
        if self._stop_word_ids is None:
            raise RuntimeError(
                f"{self.__class__.__name__}.stop ({self.stop}) is not processed by tokenizer, "
                "please call the setup method."
            )
        return words + self._stop_word_ids

    def _get_stop_reasons_and_words(self) -> list[tuple[int | str, list[int]]]:
        reasons: list[int | str] = list(self.stop_token_ids or [])
        if self.stop is not None:
            reasons += [self.stop] if isinstance(self.stop, str) else self.stop
        return list(zip(reasons, self._get_stop_words(), strict=False))
