"""Settings from the environment (prefix `WORKER_`, `.env` read too): one frozen object,
built once at start and passed down. A bad value stops the worker with one line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.errors import ConfigError

ENV_PREFIX = "WORKER_"

PositiveInt = Annotated[int, Field(ge=1)]


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
    stream_prefix: Annotated[str, Field(min_length=1, max_length=200)] = "gen:"
    stream_ttl_s: PositiveInt = 3600
    engine: Literal["echo", "trtllm", "trtllm-executor"] = "echo"
    tokenizer: Path | None = None
    eos_token: Annotated[str, Field(min_length=1)] | None = None
    max_input_tokens: PositiveInt = 4096
    max_new_tokens: PositiveInt = 2048
    default_max_new_tokens: PositiveInt = 256
    max_batch: Annotated[int, Field(ge=1, le=65535)] = 64
    http_port: Annotated[int, Field(ge=0, le=65535)] = 8080
    http_host: str = "0.0.0.0"
    echo_step_ms: Annotated[float, Field(ge=0, le=60_000)] = 0
    queue_type: Literal["quorum", "classic"] = "quorum"
    delivery_limit: PositiveInt = 3
    drain_timeout_s: Annotated[float, Field(ge=0, le=86_400)] = 30
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"

    @field_validator("amqp_url")
    @classmethod
    def _amqp_scheme(cls, value: str) -> str:
        return _check_url(value, ("amqp", "amqps"))

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        return _check_url(value, ("redis", "rediss", "unix"))

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

    @property
    def cancel_exchange(self) -> str:
        return f"{self.queue}.cancel"

    @property
    def dead_queue(self) -> str:
        return f"{self.queue}.dead"


def _check_url(value: str, schemes: tuple[str, ...]) -> str:
    parts = urlsplit(value)
    if parts.scheme not in schemes:
        raise ValueError(f"scheme must be one of {', '.join(schemes)}")
    try:
        parts.port  # noqa: B018  (urlsplit checks the port only when asked)
    except ValueError:
        raise ValueError("the port is not a number in 0..65535") from None
    return value


def redact_url(url: str) -> str:
    """The URL with any password replaced, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def load_settings(**overrides: object) -> Settings:
    """Build the settings, turning the first validation error into one line that names
    the variable (never echoing a value, which may hold a password)."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = first.get("loc", ())
        name = ENV_PREFIX + str(loc[0]).upper() if loc else "settings"
        message = str(first.get("msg", "invalid value"))
        message = message.removeprefix("Value error, ")
        if not loc:
            raise ConfigError(f"invalid settings: {message}") from None
        raise ConfigError(f"invalid setting {name}: {message}") from None
