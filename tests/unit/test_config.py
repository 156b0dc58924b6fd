"""Settings: the contract's names and defaults, overrides from the environment and `.env`,
and one clear line naming the variable for every bad value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pydantic
import pytest

import trtllm_worker
from trtllm_worker.config import ENV_PREFIX, REDIS_MAX_TTL_S, Settings, load_settings, redact_url
from trtllm_worker.contract.errors import ConfigError

PASSWORD = "s3cr3t-Pa55"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No WORKER_* variable from the outside, and a working directory without `.env`."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def config_error(monkeypatch: pytest.MonkeyPatch, **env: str) -> ConfigError:
    """The `ConfigError` load_settings raises with `env` set; checks it is one line."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert message.strip()
    assert "\n" not in message, "the message must be one line"
    return info.value


# --- defaults -------------------------------------------------------------------------------


CONTRACT_DEFAULTS: list[tuple[str, object]] = [
    ("WORKER_AMQP_URL", "amqp://guest:guest@localhost:5672/"),
    ("WORKER_REDIS_URL", "redis://localhost:6379/0"),
    ("WORKER_QUEUE", "generate"),
    ("WORKER_STREAM_PREFIX", "gen:"),
    ("WORKER_STREAM_TTL_S", 3600),
    ("WORKER_ENGINE", "echo"),
    ("WORKER_TOKENIZER", None),
    ("WORKER_EOS_TOKEN", None),
    ("WORKER_MAX_INPUT_TOKENS", 4096),
    ("WORKER_MAX_NEW_TOKENS", 2048),
    ("WORKER_DEFAULT_MAX_NEW_TOKENS", 256),
    ("WORKER_MAX_BATCH", 64),
    ("WORKER_HTTP_PORT", 8080),
    ("WORKER_ECHO_STEP_MS", 0),
    ("WORKER_QUEUE_TYPE", "quorum"),
    ("WORKER_DELIVERY_LIMIT", 3),
    ("WORKER_DRAIN_TIMEOUT_S", 30),
]


def attribute(variable: str) -> str:
    return variable.removeprefix(ENV_PREFIX).lower()


@pytest.mark.parametrize(
    ("variable", "default"), [pytest.param(v, d, id=v) for v, d in CONTRACT_DEFAULTS]
)
def test_contract_default(variable: str, default: object) -> None:
    assert getattr(load_settings(), attribute(variable)) == default


def test_every_contract_variable_is_a_setting() -> None:
    fields = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    missing = {variable for variable, _ in CONTRACT_DEFAULTS} - fields
    assert not missing


def test_derived_names() -> None:
    settings = load_settings()
    assert settings.cancel_exchange == f"{settings.queue}.cancel"
    assert settings.dead_queue == f"{settings.queue}.dead"


def test_settings_are_frozen() -> None:
    settings = load_settings()
    with pytest.raises(pydantic.ValidationError):
        settings.max_batch = 1  # type: ignore[misc]


# --- overrides ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "raw", "expected"),
    [
        pytest.param(
            "WORKER_AMQP_URL", "amqps://u:p@broker:5671/vhost", "amqps://u:p@broker:5671/vhost"
        ),
        pytest.param("WORKER_REDIS_URL", "rediss://:pw@cache:6380/2", "rediss://:pw@cache:6380/2"),
        pytest.param("WORKER_REDIS_URL", "unix:///run/redis.sock", "unix:///run/redis.sock"),
        pytest.param("WORKER_QUEUE", "jobs.v2", "jobs.v2"),
        pytest.param("WORKER_STREAM_PREFIX", "tokens:", "tokens:"),
        pytest.param("WORKER_STREAM_TTL_S", "60", 60),
        pytest.param("WORKER_TOKENIZER", "/models/llama", Path("/models/llama")),
        pytest.param("WORKER_EOS_TOKEN", "<|eot_id|>", "<|eot_id|>"),
        pytest.param("WORKER_MAX_INPUT_TOKENS", "8192", 8192),
        pytest.param("WORKER_MAX_NEW_TOKENS", "4096", 4096),
        pytest.param("WORKER_DEFAULT_MAX_NEW_TOKENS", "2048", 2048),
        pytest.param("WORKER_MAX_BATCH", "1", 1),
        pytest.param("WORKER_HTTP_PORT", "9000", 9000),
        pytest.param("WORKER_ECHO_STEP_MS", "2.5", 2.5),
        pytest.param("WORKER_QUEUE_TYPE", "classic", "classic"),
        pytest.param("WORKER_DELIVERY_LIMIT", "10", 10),
        pytest.param("WORKER_DRAIN_TIMEOUT_S", "0", 0),
        pytest.param("WORKER_DRAIN_TIMEOUT_S", "1.5", 1.5),
    ],
)
def test_env_override(
    monkeypatch: pytest.MonkeyPatch, variable: str, raw: str, expected: object
) -> None:
    monkeypatch.setenv(variable, raw)
    settings = load_settings()
    assert getattr(settings, attribute(variable)) == expected


@pytest.mark.parametrize(
    ("engine", "needs", "given"),
    [
        ("trtllm", "WORKER_MODEL", {}),
        ("trtllm-executor", "WORKER_ENGINE_DIR", {"WORKER_TOKENIZER": "/models/llama"}),
        ("trtllm-executor", "WORKER_TOKENIZER", {"WORKER_ENGINE_DIR": "/engines/llama"}),
    ],
)
def test_tensorrt_llm_engine_needs_its_model(
    monkeypatch: pytest.MonkeyPatch, engine: str, needs: str, given: dict[str, str]
) -> None:
    monkeypatch.setenv("WORKER_ENGINE", engine)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert str(caught.value).startswith(f"invalid setting {needs}:")
    monkeypatch.setenv(needs, "/somewhere")
    assert load_settings().engine == engine


def test_trtllm_tokenizer_defaults_to_the_model_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_ENGINE", "trtllm")
    monkeypatch.setenv("WORKER_MODEL", "/models/llama")
    assert load_settings().tokenizer_source == Path("/models/llama")
    monkeypatch.setenv("WORKER_TOKENIZER", "/tok/tokenizer.json")
    assert load_settings().tokenizer_source == Path("/tok/tokenizer.json")


def test_queue_override_moves_derived_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_QUEUE", "jobs")
    settings = load_settings()
    assert settings.cancel_exchange == "jobs.cancel"
    assert settings.dead_queue == "jobs.dead"


def test_dotenv_is_read(clean_env: Path) -> None:
    (clean_env / ".env").write_text("WORKER_MAX_BATCH=7\nWORKER_QUEUE_TYPE=classic\n")
    settings = load_settings()
    assert settings.max_batch == 7
    assert settings.queue_type == "classic"


def test_environment_wins_over_dotenv(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (clean_env / ".env").write_text("WORKER_MAX_BATCH=7\n")
    monkeypatch.setenv("WORKER_MAX_BATCH", "9")
    assert load_settings().max_batch == 9


def test_bad_value_in_dotenv(clean_env: Path) -> None:
    (clean_env / ".env").write_text("WORKER_MAX_BATCH=zero\n")
    with pytest.raises(ConfigError, match="WORKER_MAX_BATCH"):
        load_settings()


def test_unrelated_variables_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_NOT_A_SETTING", "whatever")
    assert load_settings().max_batch == 64


def test_keyword_overrides() -> None:
    assert load_settings(max_batch=5).max_batch == 5
    with pytest.raises(ConfigError, match="WORKER_MAX_BATCH"):
        load_settings(max_batch=0)


def test_default_max_new_tokens_may_equal_max(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_MAX_NEW_TOKENS", "100")
    monkeypatch.setenv("WORKER_DEFAULT_MAX_NEW_TOKENS", "100")
    settings = load_settings()
    assert settings.default_max_new_tokens == settings.max_new_tokens == 100


# --- bad values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        pytest.param("WORKER_MAX_BATCH", "zero", id="max_batch-word"),
        pytest.param("WORKER_MAX_BATCH", "0", id="max_batch-0"),
        pytest.param("WORKER_MAX_BATCH", "-1", id="max_batch-negative"),
        pytest.param("WORKER_MAX_BATCH", "1.5", id="max_batch-float"),
        pytest.param("WORKER_STREAM_TTL_S", "0", id="stream_ttl_s-0"),
        pytest.param("WORKER_STREAM_TTL_S", "1h", id="stream_ttl_s-unit"),
        # what Redis refuses: EXPIRE overflow ("invalid expire time")
        pytest.param("WORKER_STREAM_TTL_S", "9223372036854776", id="stream_ttl_s-redis-overflow"),
        pytest.param("WORKER_STREAM_TTL_S", "1000000000000001", id="stream_ttl_s-over-bound"),
        pytest.param("WORKER_STREAM_COMPACT_AFTER_S", "1e16", id="compact_after_s-over-bound"),
        # TensorRT-LLM's 32-bit token counts
        pytest.param("WORKER_MAX_NEW_TOKENS", "2147483648", id="max_new_tokens-over-int32"),
        pytest.param("WORKER_MAX_INPUT_TOKENS", "2147483648", id="max_input_tokens-over-int32"),
        pytest.param("WORKER_MAX_NUM_TOKENS", "2147483648", id="max_num_tokens-over-int32"),
        pytest.param("WORKER_MAX_SEQ_LEN", "2147483648", id="max_seq_len-over-int32"),
        pytest.param("WORKER_MAX_INPUT_TOKENS", "2147483000", id="default-max-seq-len-over-int32"),
        pytest.param("WORKER_MAX_INPUT_TOKENS", "0", id="max_input_tokens-0"),
        pytest.param("WORKER_MAX_INPUT_TOKENS", "many", id="max_input_tokens-word"),
        pytest.param("WORKER_MAX_NEW_TOKENS", "0", id="max_new_tokens-0"),
        pytest.param("WORKER_DEFAULT_MAX_NEW_TOKENS", "0", id="default_max_new_tokens-0"),
        pytest.param("WORKER_DELIVERY_LIMIT", "0", id="delivery_limit-0"),
        pytest.param("WORKER_HTTP_PORT", "65536", id="http_port-too-big"),
        pytest.param("WORKER_HTTP_PORT", "-1", id="http_port-negative"),
        pytest.param("WORKER_HTTP_PORT", "http", id="http_port-word"),
        pytest.param("WORKER_ECHO_STEP_MS", "-1", id="echo_step_ms-negative"),
        pytest.param("WORKER_ECHO_STEP_MS", "fast", id="echo_step_ms-word"),
        pytest.param("WORKER_DRAIN_TIMEOUT_S", "-1", id="drain_timeout_s-negative"),
        pytest.param("WORKER_DRAIN_TIMEOUT_S", "30s", id="drain_timeout_s-unit"),
        pytest.param("WORKER_ENGINE", "vllm", id="engine-unknown"),
        pytest.param("WORKER_ENGINE", "tensorrt", id="engine-near-miss"),
        pytest.param("WORKER_QUEUE_TYPE", "stream", id="queue_type-stream"),
        pytest.param("WORKER_QUEUE_TYPE", "durable", id="queue_type-unknown"),
        pytest.param("WORKER_QUEUE", "my queue", id="queue-space"),
        pytest.param("WORKER_AMQP_URL", "http://localhost:5672/", id="amqp-http"),
        pytest.param("WORKER_AMQP_URL", "redis://localhost:6379/0", id="amqp-redis-scheme"),
        pytest.param("WORKER_AMQP_URL", "localhost:5672", id="amqp-no-scheme"),
        pytest.param("WORKER_REDIS_URL", "amqp://localhost/", id="redis-amqp-scheme"),
        pytest.param("WORKER_REDIS_URL", "localhost:6379", id="redis-no-scheme"),
    ],
)
def test_bad_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, raw: str
) -> None:
    error = config_error(monkeypatch, **{variable: raw})
    assert variable in str(error)


def test_the_longest_stream_ttl_redis_accepts_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_STREAM_TTL_S", str(REDIS_MAX_TTL_S))
    assert load_settings().stream_ttl_s == REDIS_MAX_TTL_S


@pytest.mark.parametrize(
    "env",
    [
        pytest.param({"WORKER_DEFAULT_MAX_NEW_TOKENS": "3000"}, id="default-above-contract-max"),
        pytest.param({"WORKER_MAX_NEW_TOKENS": "100"}, id="max-below-contract-default"),
        pytest.param(
            {"WORKER_MAX_NEW_TOKENS": "100", "WORKER_DEFAULT_MAX_NEW_TOKENS": "101"},
            id="both-set",
        ),
    ],
)
def test_default_max_new_tokens_above_max(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    message = str(config_error(monkeypatch, **env))
    assert "WORKER_DEFAULT_MAX_NEW_TOKENS" in message
    assert "WORKER_MAX_NEW_TOKENS" in message


@pytest.mark.parametrize(
    "url",
    [
        pytest.param(f"http://guest:{PASSWORD}@localhost:5672/", id="wrong-scheme"),
        pytest.param(f"guest:{PASSWORD}@localhost:5672/", id="no-scheme"),
        pytest.param(f"amqp://guest:{PASSWORD}@[::1/", id="broken-ipv6"),
        pytest.param(f"amqp//guest:{PASSWORD}@localhost/", id="missing-colon"),
    ],
)
def test_amqp_password_is_never_echoed(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    error = config_error(monkeypatch, WORKER_AMQP_URL=url)
    assert "WORKER_AMQP_URL" in str(error)
    assert PASSWORD not in str(error)
    assert PASSWORD not in repr(error)


def test_redis_password_is_never_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    error = config_error(monkeypatch, WORKER_REDIS_URL=f"http://:{PASSWORD}@cache:6379/0")
    assert "WORKER_REDIS_URL" in str(error)
    assert PASSWORD not in str(error)


def test_password_not_echoed_when_another_setting_is_bad(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    error = config_error(
        monkeypatch,
        WORKER_AMQP_URL=f"amqp://guest:{PASSWORD}@localhost:5672/",
        WORKER_MAX_BATCH="zero",
    )
    assert "WORKER_MAX_BATCH" in str(error)
    assert PASSWORD not in str(error)


# --- redact_url -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        pytest.param(
            "amqp://guest:guest@localhost:5672/", "amqp://guest:***@localhost:5672/", id="default"
        ),
        pytest.param(
            f"amqps://worker:{PASSWORD}@broker.example:5671/vhost",
            "amqps://worker:***@broker.example:5671/vhost",
            id="amqps-vhost",
        ),
        pytest.param(
            f"redis://:{PASSWORD}@cache:6379/0", "redis://:***@cache:6379/0", id="no-username"
        ),
        pytest.param(
            f"amqp://u:{PASSWORD}@h/v?heartbeat=30#frag",
            "amqp://u:***@h/v?heartbeat=30#frag",
            id="query-fragment",
        ),
        pytest.param("amqp://u:p%40ss@h:5672/", "amqp://u:***@h:5672/", id="percent-encoded"),
        pytest.param("amqp://u:@h/", "amqp://u:***@h/", id="empty-password"),
        pytest.param(
            f"amqp://u:{PASSWORD}@[::1]:5672/",
            "amqp://u:***@[::1]:5672/",
            id="ipv6-host",
        ),
        pytest.param(
            f"amqp://u:{PASSWORD}@[2001:db8::7]/",
            "amqp://u:***@[2001:db8::7]/",
            id="ipv6-no-port",
        ),
        pytest.param("amqp://u@h:5672/", "amqp://u@h:5672/", id="username-only"),
        pytest.param("amqp://localhost:5672/", "amqp://localhost:5672/", id="no-userinfo"),
        pytest.param("unix:///run/redis.sock", "unix:///run/redis.sock", id="unix-socket"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    redacted = redact_url(url)
    assert redacted == expected
    original, parts = urlsplit(url), urlsplit(redacted)
    if original.password is None:
        assert parts.password is None
    else:
        assert parts.password == "***"
        assert PASSWORD not in redacted
    assert (parts.scheme, parts.hostname, parts.port, parts.username, parts.path) == (
        original.scheme,
        original.hostname,
        original.port,
        original.username,
        original.path,
    )


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        pytest.param(
            f"redis://cache:6379/0?password={PASSWORD}",
            "redis://cache:6379/0?password=***",
            id="redis-password",
        ),
        pytest.param(
            f"rediss://:{PASSWORD}@cache:6380/0?ssl_password={PASSWORD}&ssl_cert_reqs=required",
            "rediss://:***@cache:6380/0?ssl_password=***&ssl_cert_reqs=required",
            id="ssl-password-and-userinfo",
        ),
        pytest.param(
            f"redis://cache/0?socket_timeout=5&username=app&Password={PASSWORD}&db=1",
            "redis://cache/0?socket_timeout=5&username=app&Password=***&db=1",
            id="case-and-neighbours-kept",
        ),
        pytest.param(
            f"http://otel:4318/v1/traces?token={PASSWORD}",
            "http://otel:4318/v1/traces?token=***",
            id="otlp-token",
        ),
        pytest.param(
            f"https://h/x?api_key={PASSWORD};access_token={PASSWORD}&client_secret={PASSWORD}",
            "https://h/x?api_key=***;access_token=***&client_secret=***",
            id="api-key-access-token-secret",
        ),
        pytest.param(
            f"https://h/x?auth={PASSWORD}&X-Amz-Signature={PASSWORD}&sig={PASSWORD}&apikey={PASSWORD}",
            "https://h/x?auth=***&X-Amz-Signature=***&sig=***&apikey=***",
            id="auth-signature-apikey",
        ),
        pytest.param(
            f"https://h/x?pass%77ord={PASSWORD}#access_token={PASSWORD}&state=1",
            "https://h/x?pass%77ord=***#access_token=***&state=1",
            id="encoded-name-and-fragment",
        ),
        pytest.param(
            f"unix:///run/redis.sock?db=0&password={PASSWORD}",
            "unix:///run/redis.sock?db=0&password=***",
            id="unix-socket-password",
        ),
        pytest.param(
            f"amqp://a/?token={PASSWORD},amqp://u:{PASSWORD}@b/?heartbeat=5",
            "amqp://a/?token=***,amqp://u:***@b/?heartbeat=5",
            id="several-urls",
        ),
        pytest.param(
            "redis://cache/0?db=0&protocol=3&flag",
            "redis://cache/0?db=0&protocol=3&flag",
            id="nothing-secret",
        ),
    ],
)
def test_redact_url_hides_secret_query_parameters(url: str, expected: str) -> None:
    """redis-py reads `?password=` and `?ssl_password=` from the URL; an OTLP endpoint may
    carry `?token=`: every parameter with a secret-looking name is hidden."""
    redacted = redact_url(url)
    assert redacted == expected
    assert PASSWORD not in redacted


# --- the command ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        pytest.param("WORKER_MAX_BATCH", "zero", id="max_batch"),
        pytest.param("WORKER_AMQP_URL", f"http://guest:{PASSWORD}@localhost/", id="amqp_url"),
    ],
)
def test_command_exits_2_with_one_line(tmp_path: Path, variable: str, raw: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    source_root = str(Path(trtllm_worker.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    env[variable] = raw
    result = subprocess.run(
        [sys.executable, "-m", "trtllm_worker"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert variable in lines[0]
    assert PASSWORD not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "name",
    [
        "WORKER_MAX_BATCH",
        "WORKER_ENGINE",
        "WORKER_QUEUE",
        "WORKER_TOKENIZER",
        "WORKER_EOS_TOKEN",
        "WORKER_AMQP_URL",
    ],
)
def test_empty_variable_means_unset(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`WORKER_TOKENIZER=` in a .env file or a manifest means "not set": the default."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, "")
    settings = load_settings()
    field = name.removeprefix("WORKER_").lower()
    assert getattr(settings, field) == Settings.model_fields[field].default


def test_sentinel_addresses_and_amqp_url_lists_are_checked() -> None:
    from trtllm_worker.config import sentinel_addresses

    assert sentinel_addresses("a:1, b ,[::1]:26380") == [("a", 1), ("b", 26379), ("::1", 26380)]
    with pytest.raises(ConfigError, match="WORKER_REDIS_SENTINELS"):
        load_settings(redis_sentinels="a:notaport")
    settings = load_settings(amqp_url="amqp://a:5672/, amqps://b:5671/")
    assert settings.amqp_urls == ["amqp://a:5672/", "amqps://b:5671/"]
    with pytest.raises(ConfigError, match="WORKER_AMQP_URL"):
        load_settings(amqp_url="amqp://a:5672/,http://b/")


def test_a_quorum_delivery_limit_stays_below_rabbitmqs_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RabbitMQ 4.0 drops a quorum queue's message past 20 deliveries on its own: a higher
    WORKER_DELIVERY_LIMIT would never be reached, and the job would vanish instead of
    ending as a dead letter with its reason. Classic queues have no broker limit."""
    error = config_error(monkeypatch, WORKER_DELIVERY_LIMIT="21")
    assert str(error).startswith("invalid setting WORKER_DELIVERY_LIMIT: at most 20")
    monkeypatch.setenv("WORKER_DELIVERY_LIMIT", "20")
    assert load_settings().delivery_limit == 20
    monkeypatch.setenv("WORKER_DELIVERY_LIMIT", "50")
    monkeypatch.setenv("WORKER_QUEUE_TYPE", "classic")
    assert load_settings().delivery_limit == 50


def test_a_tls_parameter_on_a_plain_redis_url_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis-py takes `ssl_*` query parameters only for rediss://; on redis:// every
    connection failed with a TypeError deep inside it (a traceback from `check`)."""
    error = config_error(monkeypatch, WORKER_REDIS_URL="redis://localhost/0?ssl_password=s3cret")
    assert str(error) == (
        "invalid setting WORKER_REDIS_URL: ssl_password is for rediss:// URLs only"
    )
    monkeypatch.setenv("WORKER_REDIS_URL", "rediss://localhost/0?ssl_password=s3cret")
    assert load_settings().redis_url.startswith("rediss://")
