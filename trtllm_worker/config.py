"""Settings from the environment (prefix `WORKER_`, `.env` read too): one frozen object,
built once at start and passed down. A bad value stops the worker with one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import parse_qsl, unquote_plus, urlsplit, urlunsplit

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.contract.queues import cancel_exchange_name, dead_queue_name

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
    """Every `WORKER_*` setting of the contract (and a few of our own). Each field's
    `description` is its row in docs/settings.md, which `make docs` generates."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        env_ignore_empty=True,
        frozen=True,
    )

    amqp_url: str = Field(
        "amqp://guest:guest@localhost:5672/",
        description="broker (`amqp://` or `amqps://`); several comma-separated URLs name "
        "the nodes of one RabbitMQ cluster, tried in turn",
    )
    redis_url: str = Field(
        "redis://localhost:6379/0",
        description="stream store (`redis://`, `rediss://`, `unix://`): a single node, or "
        "any node of a Redis Cluster",
    )
    queue: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,200}$")] = Field(
        "generate", description="job queue; `<queue>.cancel` and `<queue>.dead` derive from it"
    )
    stream_prefix: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^{}]*$")] = Field(
        "gen:", description="stream key = prefix + request_id; no braces"
    )
    stream_ttl_s: Annotated[int, Field(ge=1, le=REDIS_MAX_TTL_S)] = Field(
        3600,
        description="a finished stream expires this long after its terminal entry; also "
        "the life of a cancel mark; at most 10^15 (Redis refuses an expiry past about "
        "9.2·10^15 s)",
    )
    stream_compact_after_s: Annotated[float, Field(gt=0, le=REDIS_MAX_TTL_S)] | None = Field(
        None,
        description="this long after its terminal entry, a finished stream is trimmed to "
        "that entry, which holds `generated_text`, until the TTL; at most 10^15",
    )
    usage_ttl_s: Annotated[int, Field(ge=1, le=REDIS_MAX_TTL_S)] = Field(
        7_776_000,
        description="how long a UTC day's per-tenant usage counters are kept after their "
        "last write (default 90 days; `trtllm-worker usage` reads them); at most 10^15",
    )
    batch_ttl_s: Annotated[int, Field(ge=1, le=REDIS_MAX_TTL_S)] = Field(
        2_592_000,
        description="how long a batch's results are kept after it ends (completed, "
        "cancelled or expired; default 30 days), whatever `WORKER_STREAM_TTL_S` is; at "
        "most 10^15",
    )
    model_name: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None,
        description="the model's public name: `model` in batch results (and the gateway's "
        "`/v1/models`). Unset: the folder name of `WORKER_MODEL` (or of "
        "`WORKER_ENGINE_DIR`), else `echo`",
    )
    gateway_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        8000,
        description="`trtllm-worker gateway`: the OpenAI-compatible API's port (`/v1/...`, "
        "with `/healthz`, `/readyz`, `/metrics` of its own); `0` picks a free port",
    )
    gateway_host: str = Field("0.0.0.0", description="address the gateway binds")
    gateway_keys_file: Path | None = Field(
        None,
        description='the gateway\'s API keys: a JSON object, key → `{"tenant": str, '
        '"priority": 0-9}`, read again when the file changes. Unset: no authentication '
        "(the gateway logs a warning at start)",
    )
    gateway_max_queued: Annotated[int, Field(ge=0)] = Field(
        0,
        description="the gateway answers 429 (with `Retry-After`) to new requests while "
        "the queue holds more than this many ready jobs; `0`: no limit (RabbitMQ's own "
        "refusals still give 429)",
    )
    gateway_cors_origins: str = Field(
        "",
        description="origins (comma-separated, or `*`) whose browser pages may call the "
        "gateway (CORS), e.g. an `EventSource` on `/v1/streams/{id}`; empty: none",
    )
    engine: Literal["echo", "trtllm", "trtllm-executor"] = Field(
        "echo",
        description="`echo` (built in, CPU, no model), `trtllm` (TensorRT-LLM LLM API, "
        "PyTorch backend, HF checkpoint in `WORKER_MODEL`) or `trtllm-executor` "
        "(TensorRT-LLM 1.2.x C++ Executor, prebuilt engine in `WORKER_ENGINE_DIR`)",
    )
    tokenizer: Path | None = Field(
        None,
        description="a `tokenizer.json`, or a model folder holding one (the EOS ids: every "
        "`eos_token_id` of its `generation_config.json` and the `eos_token` of its "
        "`tokenizer_config.json`, which also gives the special tokens and the chat "
        "template); required with `trtllm-executor`. Unset: `WORKER_MODEL` with `trtllm`, "
        "else the built-in byte-level tokenizer",
    )
    eos_token: Annotated[str, Field(min_length=1)] | None = Field(
        None,
        description="end-of-sequence token as its string (e.g. `</s>`); when set, the only "
        "EOS. Unset: from the model folder, else none",
    )
    max_input_tokens: TokenCount = Field(
        4096, description="longer prompts fail with `input_too_long` unless `truncate` is given"
    )
    max_new_tokens: TokenCount = Field(
        2048,
        description="upper bound for `max_new_tokens`; this, `WORKER_MAX_INPUT_TOKENS`, "
        "their sum, `WORKER_MAX_NUM_TOKENS` and `WORKER_MAX_SEQ_LEN` are at most 2^31-1 "
        "(TensorRT-LLM's 32-bit token counts)",
    )
    default_max_new_tokens: TokenCount = Field(
        256, description="used when a job gives none; at most `WORKER_MAX_NEW_TOKENS`"
    )
    max_batch: Annotated[int, Field(ge=1, le=65535)] = Field(
        64, description="requests in flight in the engine at once; also the broker prefetch"
    )
    http_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        8080,
        description="`/healthz`, `/readyz`, `/metrics`; `0` picks a free port. Bound first "
        "at start (the probes answer 503 until the worker is ready): a port already taken "
        "stops the worker with one line and exit 2, before it loads the engine or takes a "
        "job",
    )
    http_host: str = Field("0.0.0.0", description="address the HTTP server binds")
    echo_step_ms: Annotated[float, Field(ge=0, le=60_000)] = Field(
        0,
        description="echo engine: time one decoding step takes (all in-flight requests "
        "advance together)",
    )
    echo_tokens_per_step: Annotated[int, Field(ge=1, le=64)] = Field(
        1,
        description="echo engine: tokens each request gains per step (1-64), as "
        "TensorRT-LLM hands over with speculative decoding or MTP; a stop, an EOS or "
        "`max_new_tokens` may fall mid-step",
    )
    echo_fault_token_id: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="test switch: an echo request whose prompt holds this id fails with "
        "`engine_error`",
    )
    echo_crash_token_id: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="test switch: a prompt holding this id crashes the echo engine (as a "
        "dead GPU would)",
    )
    queue_type: Literal["quorum", "classic"] = Field(
        "quorum",
        description="`quorum` or `classic`, for the job queue and dead-letter queue the "
        "worker declares",
    )
    delivery_limit: PositiveInt = Field(
        3,
        description="deliveries of one message before it is dead-lettered; at most 20 on a "
        "quorum queue (RabbitMQ 4.0 drops a message past 20 deliveries on its own)",
    )
    preempt_priority: Annotated[int, Field(ge=0, le=10)] = Field(
        5,
        description="a job of at least this priority (0-9) pauses a running job of lower "
        "priority when every engine slot is busy; `10` turns pausing off",
    )
    drain_timeout_s: Annotated[float, Field(ge=0, le=86_400)] = Field(
        30, description="on SIGTERM, how long running jobs may finish"
    )
    lease_ttl_s: Annotated[float, Field(ge=0.5, le=3600)] = Field(
        10,
        description="a request's lease expires this long after its worker stops renewing "
        "it (a redelivered job may wait this long)",
    )
    redis_buffer_entries: PositiveInt = Field(
        100_000,
        description="entries kept in memory while Redis is unreachable before running jobs "
        "are handed back",
    )
    amqp_ca_file: Path | None = Field(
        None, description="`amqps://`: CA to trust (or the URL's `cafile` query parameter)"
    )
    amqp_cert_file: Path | None = Field(
        None,
        description="`amqps://`: client certificate (or the URL's `certfile` query parameter)",
    )
    amqp_key_file: Path | None = Field(
        None, description="`amqps://`: client key (or the URL's `keyfile` query parameter)"
    )
    redis_sentinels: str | None = Field(
        None,
        description="Redis under Sentinel: the Sentinels, `host:port,...`; "
        "`WORKER_REDIS_URL` then gives only scheme, password and database",
    )
    redis_sentinel_master: Annotated[str, Field(min_length=1)] = Field(
        "mymaster", description="the master's name in the Sentinels' configuration"
    )
    redis_sentinel_password: str | None = Field(
        None,
        description="the Sentinels' own password (the chart takes it from its Secret)",
    )
    redis_min_replicas: Annotated[int, Field(ge=0, le=16)] = Field(
        0,
        description="a job is acknowledged only once its terminal entry is on this many "
        "replicas (Redis `WAIT`); 1 with Sentinel; not on Redis Cluster",
    )
    redis_ca_file: Path | None = Field(
        None,
        description="`rediss://`: CA to trust (or the URL's `ssl_ca_certs` query parameter)",
    )
    redis_cert_file: Path | None = Field(
        None,
        description="`rediss://`: client certificate (or the URL's `ssl_certfile` query parameter)",
    )
    redis_key_file: Path | None = Field(
        None,
        description="`rediss://`: client key (or the URL's `ssl_keyfile` query parameter)",
    )
    chat_template: Path | None = Field(
        None,
        description="a Jinja chat template file; overrides the model folder's "
        "(`chat_template.jinja` or `tokenizer_config.json`). Unset: the model's own",
    )
    guided_decoding: Literal["xgrammar", "llguidance", "none"] = Field(
        "xgrammar",
        description="TensorRT-LLM's guided-decoding backend: `xgrammar`, `llguidance` (LLM "
        "API only) or `none` (jobs with a `grammar` are refused)",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="`DEBUG`, `INFO`, `WARNING`, `ERROR` (any case)"
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="`text` or `json` (one object per line); a line about a job carries its "
        "`request_id` (a JSON field, or ` request_id=…` at the end of a text line)",
    )
    event_loop: Literal["auto", "asyncio", "uvloop"] = Field(
        "auto",
        description="`auto`: uvloop when it is installed (the `uvloop` extra; the image has "
        "it), else asyncio's own loop; `asyncio` or `uvloop` to choose (`uvloop` without it "
        "installed: exit 2). The startup line names the loop",
    )

    lora_dir: Path | None = Field(
        None,
        description="a folder whose subfolders are LoRA adapters (Hugging Face PEFT layout: "
        "`adapter_config.json` and `adapter_model.safetensors` or `.bin`); a job names one "
        "by its folder name in `adapter`. Read at start: a folder that does not load stops "
        "the worker. `trtllm` and `echo` only (the echo engine checks the name and "
        "ignores it). Unset: no adapters",
    )

    # TensorRT-LLM engines (ignored by echo)
    model: Path | None = Field(
        None, description="`trtllm`: Hugging Face checkpoint folder (required)"
    )
    engine_dir: Path | None = Field(
        None, description="`trtllm-executor`: folder of a prebuilt TensorRT engine (required)"
    )
    tensor_parallel_size: PositiveInt = Field(1, description="`trtllm`: GPUs per model")
    max_num_tokens: TokenCount | None = Field(
        None,
        description="tokens the engine batches in one step; without chunked prefill also "
        "the longest prompt, and a job's `input tokens + max_new_tokens - 1` (its longest "
        "resume) must fit it. Unset: the engine's default",
    )
    max_seq_len: TokenCount | None = Field(
        None,
        description="`trtllm`: longest sequence. Unset: `WORKER_MAX_INPUT_TOKENS + "
        "WORKER_MAX_NEW_TOKENS`",
    )
    kv_cache_free_gpu_memory_fraction: Annotated[float, Field(gt=0, le=1)] = Field(
        0.9,
        description="fraction of free GPU memory for the KV cache (lower it if the GPU runs "
        "out of memory)",
    )
    kv_cache_block_reuse: bool = Field(
        True, description="reuse the KV cache of shared prompt prefixes"
    )
    llm_extra_options: Path | None = Field(
        None,
        description="`trtllm`: a YAML or JSON file of extra `LLM(...)` arguments, as "
        "trtllm-serve's `--extra_llm_api_options`; they override the worker's",
    )
    scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = Field(
        "guaranteed_no_evict",
        description="`trtllm-executor`: `guaranteed_no_evict` or `max_utilization`",
    )
    sampler: Literal["TRTLLMSampler", "TorchSampler", "auto"] = Field(
        "TRTLLMSampler",
        description="`trtllm`: TensorRT-LLM's sampler, `TRTLLMSampler`, `TorchSampler` or "
        "`auto` (what each honours: Running on a GPU). The 1.4 line has TorchSampler only: "
        "unset, nothing is passed there",
    )
    executor_worker_path: Path | None = Field(
        None,
        description="`trtllm-executor` on several GPUs. Unset: the package's `bin/executorWorker`",
    )
    engine_start_timeout_s: Annotated[float, Field(gt=0)] = Field(
        1800, description="loading the engine may take this long; then the worker exits 69"
    )
    engine_stats_interval_s: Annotated[float, Field(gt=0)] = Field(
        5, description="how often engine statistics are sampled for `/metrics`"
    )
    engine_stall_timeout_s: Annotated[float, Field(gt=0)] = Field(
        300,
        description="requests in flight and no output for this long: the engine is taken "
        "for dead (jobs handed back, exit 3)",
    )
    engine_cancel_timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        5,
        description="a cancelled request the engine says nothing more about is ended "
        "(`cancelled`) this long after its cancel",
    )

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
        _check_url(value, ("redis", "rediss", "unix"))
        parts = urlsplit(value)
        tls_only = sorted({name for name, _ in parse_qsl(parts.query) if name.startswith("ssl_")})
        if tls_only and parts.scheme != "rediss":
            # redis-py would fail deep inside with a TypeError on every connection
            raise ValueError(f"{', '.join(tls_only)} is for rediss:// URLs only")
        return value

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
            if self.lora_dir is not None:
                # the Executor takes an adapter's weights with each request, in the
                # engine's own format: not done by the worker
                raise _SettingError(
                    "lora_dir",
                    "LoRA adapters are served with WORKER_ENGINE=trtllm (the LLM API loads "
                    "them from their folders), not with WORKER_ENGINE=trtllm-executor",
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
    def served_model_name(self) -> str:
        """`WORKER_MODEL_NAME`, else the model folder's name, else `echo`."""
        if self.model_name is not None:
            return self.model_name
        folder = self.model if self.engine == "trtllm" else self.engine_dir
        if self.engine != "echo" and folder is not None and folder.name:
            return folder.name
        return "echo"

    @property
    def effective_max_seq_len(self) -> int:
        return self.max_seq_len or self.max_input_tokens + self.max_new_tokens

    @property
    def cancel_exchange(self) -> str:
        return cancel_exchange_name(self.queue)

    @property
    def dead_queue(self) -> str:
        return dead_queue_name(self.queue)


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
