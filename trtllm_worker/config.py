"""Settings from the environment (prefix `WORKER_`, `.env` read too): one frozen object,
built once at start and passed down. A bad value stops the worker with one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import unquote_plus, urlsplit, urlunsplit

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trtllm_worker.contract.errors import ConfigError

ENV_PREFIX = "WORKER_"

PositiveInt = Annotated[int, Field(ge=1)]


QUORUM_DELIVERY_LIMIT = 20
"""RabbitMQ 4.0's default `delivery-limit` for quorum queues (none before 4.0)."""

REDIS_MAX_TTL_S = 10**15
"""The longest expiry the worker asks Redis for (EXPIRE, SET EX), about 31 million
years: Redis refuses a TTL whose milliseconds, added to the current time, overflow a
signed 64-bit integer ('invalid expire time'), from about 9.2e15 s."""

ENGINE_MAX_TOKENS = 2**31 - 1
"""TensorRT-LLM takes token counts (max_tokens, max_seq_len, max_num_tokens) as 32-bit
signed integers (`SizeType32`)."""

TokenCount = Annotated[int, Field(ge=1, le=ENGINE_MAX_TOKENS)]


class Settings(BaseSettings):
    """Every `WORKER_*` setting of the contract (and a few of our own, documented in the
    README)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        env_ignore_empty=True,
        frozen=True,
    )

    amqp_url: str = "amqp://guest:guest@localhost:5672/"
    redis_url: str = "redis://localhost:6379/0"
    queue: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,200}$")] = "generate"
    stream_prefix: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^{}]*$")] = "gen:"
    stream_ttl_s: Annotated[int, Field(ge=1, le=REDIS_MAX_TTL_S)] = 3600
    # this long after a stream's terminal entry its token entries are trimmed
    stream_compact_after_s: Annotated[float, Field(gt=0, le=REDIS_MAX_TTL_S)] | None = None
    engine: Literal["echo", "trtllm", "trtllm-executor"] = "echo"
    tokenizer: Path | None = None
    eos_token: Annotated[str, Field(min_length=1)] | None = None
    max_input_tokens: TokenCount = 4096
    max_new_tokens: TokenCount = 2048
    default_max_new_tokens: TokenCount = 256
    max_batch: Annotated[int, Field(ge=1, le=65535)] = 64
    http_port: Annotated[int, Field(ge=0, le=65535)] = 8080
    http_host: str = "0.0.0.0"
    echo_step_ms: Annotated[float, Field(ge=0, le=60_000)] = 0
    # tokens each request gains per step, as with speculative decoding or MTP
    echo_tokens_per_step: Annotated[int, Field(ge=1, le=64)] = 1
    echo_fault_token_id: Annotated[int, Field(ge=0)] | None = None
    echo_crash_token_id: Annotated[int, Field(ge=0)] | None = None
    queue_type: Literal["quorum", "classic"] = "quorum"
    delivery_limit: PositiveInt = 3
    drain_timeout_s: Annotated[float, Field(ge=0, le=86_400)] = 30
    lease_ttl_s: Annotated[float, Field(ge=0.5, le=3600)] = 10
    redis_buffer_entries: PositiveInt = 100_000
    amqp_ca_file: Path | None = None
    amqp_cert_file: Path | None = None
    amqp_key_file: Path | None = None
    redis_sentinels: str | None = None
    redis_sentinel_master: Annotated[str, Field(min_length=1)] = "mymaster"
    redis_sentinel_password: str | None = None
    redis_min_replicas: Annotated[int, Field(ge=0, le=16)] = 0
    redis_ca_file: Path | None = None
    redis_cert_file: Path | None = None
    redis_key_file: Path | None = None
    chat_template: Path | None = None
    guided_decoding: Literal["xgrammar", "llguidance", "none"] = "xgrammar"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    """auto: uvloop when it is installed (the `uvloop` extra), else asyncio's own."""

    # TensorRT-LLM engines (ignored by echo)
    model: Path | None = None
    engine_dir: Path | None = None
    tensor_parallel_size: PositiveInt = 1
    max_num_tokens: TokenCount | None = None
    max_seq_len: TokenCount | None = None
    kv_cache_free_gpu_memory_fraction: Annotated[float, Field(gt=0, le=1)] = 0.9
    kv_cache_block_reuse: bool = True
    llm_extra_options: Path | None = None
    scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = "guaranteed_no_evict"
    sampler: Literal["TRTLLMSampler", "TorchSampler", "auto"] = "TRTLLMSampler"
    executor_worker_path: Path | None = None
    engine_start_timeout_s: Annotated[float, Field(gt=0)] = 1800
    engine_stats_interval_s: Annotated[float, Field(gt=0)] = 5
    engine_stall_timeout_s: Annotated[float, Field(gt=0)] = 300
    engine_cancel_timeout_s: Annotated[float, Field(gt=0, le=600)] = 5

    @field_validator("amqp_url")
    @classmethod
    def _amqp_scheme(cls, value: str) -> str:
        urls = split_urls(value)
        if not urls:
            raise ValueError("no URL given")
        for url in urls:
            _check_url(url, ("amqp", "amqps"))
        return value

    @property
    def amqp_urls(self) -> list[str]:
        """The nodes of one RabbitMQ cluster, in the order they are tried."""
        return split_urls(self.amqp_url)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        return _check_url(value, ("redis", "rediss", "unix"))

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinel_addresses(cls, value: str | None) -> str | None:
        if value is not None:
            sentinel_addresses(value)
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> Settings:
        if self.default_max_new_tokens > self.max_new_tokens:
            raise ValueError(
                "WORKER_DEFAULT_MAX_NEW_TOKENS must not exceed WORKER_MAX_NEW_TOKENS "
                f"({self.default_max_new_tokens} > {self.max_new_tokens})"
            )
        return self

    @model_validator(mode="after")
    def _sequence_fits_the_engine(self) -> Settings:
        if self.max_seq_len is None and self.effective_max_seq_len > ENGINE_MAX_TOKENS:
            raise _SettingError(
                "max_input_tokens",
                "WORKER_MAX_INPUT_TOKENS + WORKER_MAX_NEW_TOKENS (the engine's default "
                f"max_seq_len) must be at most {ENGINE_MAX_TOKENS}",
            )
        return self

    @model_validator(mode="after")
    def _delivery_limit_reached_first(self) -> Settings:
        if self.queue_type == "quorum" and self.delivery_limit > QUORUM_DELIVERY_LIMIT:
            raise _SettingError(
                "delivery_limit",
                f"at most {QUORUM_DELIVERY_LIMIT} on a quorum queue: from RabbitMQ 4.0 on, "
                f"the broker drops a message past {QUORUM_DELIVERY_LIMIT} deliveries on "
                "its own, before the worker could dead-letter it with its reason",
            )
        return self

    @model_validator(mode="after")
    def _engine_has_its_model(self) -> Settings:
        if self.engine == "trtllm" and self.model is None:
            raise _SettingError("model", "required with WORKER_ENGINE=trtllm (an HF checkpoint)")
        if self.engine == "trtllm-executor":
            if self.engine_dir is None:
                raise _SettingError("engine_dir", "required with WORKER_ENGINE=trtllm-executor")
            if self.tokenizer is None:
                raise _SettingError(
                    "tokenizer",
                    "required with WORKER_ENGINE=trtllm-executor (the model's "
                    "tokenizer.json or its folder)",
                )
        return self

    @property
    def tokenizer_source(self) -> Path | None:
        """Where the tokenizer comes from: the setting, else the LLM API's model folder
        (an HF checkpoint holds its tokenizer), else the built-in tokenizer (None)."""
        if self.tokenizer is not None:
            return self.tokenizer
        return self.model if self.engine == "trtllm" else None

    @property
    def effective_max_seq_len(self) -> int:
        return self.max_seq_len or self.max_input_tokens + self.max_new_tokens

    @property
    def cancel_exchange(self) -> str:
        return f"{self.queue}.cancel"

    @property
    def dead_queue(self) -> str:
        return f"{self.queue}.dead"


class _SettingError(ValueError):
    """A cross-field error that belongs to one variable."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _check_url(value: str, schemes: tuple[str, ...]) -> str:
    parts = urlsplit(value)
    if parts.scheme not in schemes:
        raise ValueError(f"scheme must be one of {', '.join(schemes)}")
    try:
        parts.port  # noqa: B018  (urlsplit checks the port only when asked)
    except ValueError:
        raise ValueError("the port is not a number in 0..65535") from None
    return value


def split_urls(value: str) -> list[str]:
    """A comma-separated list of URLs (one URL is a list of one)."""
    return [url.strip() for url in value.split(",") if url.strip()]


def sentinel_addresses(value: str) -> list[tuple[str, int]]:
    """`host:port,host:port` (port 26379 when left out) as (host, port) pairs."""
    addresses: list[tuple[str, int]] = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "26379"
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{item!r} is not host:port")
        addresses.append((host.strip("[]"), int(port)))
    if not addresses:
        raise ValueError("no Sentinel address given")
    return addresses


SECRET_PARAMETER = re.compile(
    r"pass|pwd|secret|token|key|auth|credential|signature|^sig$|cookie|session", re.IGNORECASE
)
"""Query (and fragment) parameters whose value `redact_url` hides: any name holding one
of these words, case-insensitively (`password`, `ssl_password`, `passphrase`, `token`,
`access_token`, `api_key`, `apikey`, `ssl_keyfile`, `client_secret`, `auth`,
`authorization`, `credentials`, `X-Amz-Signature`, `sig`, …). It errs on the side of
hiding: a key file's path is hidden too."""

REDACTED = "***"


def redact_url(url: str) -> str:
    """The URL (or comma-separated URLs) with every secret replaced by `***`, for logs and
    error messages: the password of its userinfo, and the value of every query or fragment
    parameter whose name looks secret (`SECRET_PARAMETER`: redis-py reads `?password=`
    and `?ssl_password=`, an OTLP endpoint may carry `?token=`). Everything else is kept
    as written."""
    if "," in url:
        return ",".join(redact_url(each) for each in split_urls(url))
    head, hash_sign, fragment = url.partition("#")
    base, question_mark, query = head.partition("?")
    try:
        parts = urlsplit(base)
        password = parts.password
    except ValueError:  # not a URL that can be taken apart: show none of it
        return REDACTED
    if password is not None:
        userinfo, _, host = parts.netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        base = urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{host}"))
    query, fragment = _redact_parameters(query), _redact_parameters(fragment)
    return f"{base}{question_mark}{query}{hash_sign}{fragment}"


def _redact_parameters(text: str) -> str:
    """`a=1&password=x;token=y` as `a=1&password=***;token=***` (names and separators as
    written)."""
    if "=" not in text:
        return text
    pieces = re.split(r"([&;])", text)
    for i in range(0, len(pieces), 2):
        name, sep, _ = pieces[i].partition("=")
        if sep and SECRET_PARAMETER.search(unquote_plus(name)):
            pieces[i] = f"{name}={REDACTED}"
    return "".join(pieces)


def load_settings(**overrides: object) -> Settings:
    """Build the settings, turning the first validation error into one line that names
    the variable (never echoing a value, which may hold a password)."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = first.get("loc", ())
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, _SettingError):
            loc = (cause.field,)
        name = ENV_PREFIX + str(loc[0]).upper() if loc else "settings"
        message = str(first.get("msg", "invalid value"))
        message = message.removeprefix("Value error, ")
        if not loc:
            raise ConfigError(f"invalid settings: {message}") from None
        raise ConfigError(f"invalid setting {name}: {message}") from None
