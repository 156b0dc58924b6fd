"""The grants docs/security.md lists are what `trtllm-worker acl` prints for the defaults."""

from __future__ import annotations

import json
import re
from pathlib import Path

from trtllm_worker.config import Settings
from trtllm_worker.connect.grants import (
    GATEWAY,
    GATEWAY_COMMANDS,
    as_json,
    as_text,
    rabbitmq_permissions,
    redis_rules,
)
from trtllm_worker.contract.batches import (
    batch_key,
    counts_key,
    file_data_key,
    file_index_key,
    file_key,
    index_key,
    invalid_key,
    line_key,
    line_request_id,
    submitter_key,
)
from trtllm_worker.contract.stream import (
    cancel_key,
    deliveries_key,
    lease_key,
    stream_key,
    wake_key,
)
from trtllm_worker.gateway.grants import PROBED
from trtllm_worker.streams.usage import usage_key

SECURITY_PAGE = Path(__file__).parents[2] / "docs" / "security.md"


def test_the_docs_list_the_grants_as_acl_prints_them() -> None:
    text = SECURITY_PAGE.read_text(encoding="utf-8")
    listed = text.split("```text\n", 1)[1].split("```", 1)[0]
    defaults = Settings(
        _env_file=None, queue="generate", stream_prefix="gen:", amqp_url="amqp://h:5672/"
    )  # whatever WORKER_* the environment holds
    assert listed == as_text(defaults)


# -- the gateway's role ---------------------------------------------------------------------


def redis_glob(pattern: str) -> re.Pattern[str]:
    """A Redis glob (`*`, `?`, `[...]` with `^` and ranges, `\\` escapes) as a regex."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end]
            negate = body.startswith("^")
            body = body[1:] if negate else body
            out.append("[" + ("^" if negate else "") + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out), re.DOTALL)


def key_access(rules: list[str]) -> list[tuple[re.Pattern[str], bool]]:
    """(pattern, writable) per key rule: `~` reads and writes, `%R~` only reads."""
    found = []
    for rule in rules:
        if rule.startswith("~"):
            found.append((redis_glob(rule[1:]), True))
        elif rule.startswith("%R~"):
            found.append((redis_glob(rule[3:]), False))
        else:
            assert not rule.startswith(("%", "allkeys")), rule
    return found


def can(rules: list[str], key: str, *, write: bool) -> bool:
    return any(p.fullmatch(key) and (w or not write) for p, w in key_access(rules))


PREFIX = "gen:"


def gateway_rules(prefix: str = PREFIX) -> list[str]:
    settings = Settings(_env_file=None, queue="generate", stream_prefix=prefix)
    return redis_rules(settings)[GATEWAY]


def test_the_gateway_reaches_every_key_it_uses_and_writes_where_it_writes() -> None:
    rules = gateway_rules()
    stream = stream_key(PREFIX, "req-1")
    line = stream_key(PREFIX, line_request_id("batch-1", 7))
    written = [
        stream,  # a batch line's end, by its cancel or expiry (the write script)
        line,
        cancel_key(stream),
        line_key(line),
        file_key(PREFIX, "file-abc"),
        file_data_key(PREFIX, "file-abc"),
        batch_key(PREFIX, "batch-1"),
        invalid_key(PREFIX, "batch-1"),
        counts_key(PREFIX, "batch-1"),
        counts_key(PREFIX, "batch-1", "a"),  # Redis Cluster: one per slot
        submitter_key(PREFIX, "batch-1"),
        index_key(PREFIX),
        file_index_key(PREFIX),
        wake_key(PREFIX, "0123abcd"),  # its stream reader's wake stream
    ]
    # the write script's fence (EXISTS): a key the script declares needs write access too
    for key in [*written, lease_key(line)]:
        assert can(rules, key, write=True), key


def test_the_gateway_may_not_touch_usage_counters_or_delivery_counts() -> None:
    rules = gateway_rules()
    stream = stream_key(PREFIX, "req-1")
    for key in (
        usage_key(PREFIX, "2026-01-01"),
        usage_key(PREFIX, "2026-01-01", "a"),
        deliveries_key(stream),
        "other-app:secret",
        "gen",
        "{other:req-1}:cancel",
        "other:_file:file-abc",
    ):
        assert not can(rules, key, write=False), key


def test_the_gateway_runs_named_commands_and_no_others() -> None:
    rules = gateway_rules()
    commands = {rule for rule in rules if rule.startswith(("+", "-"))}
    assert all(rule.startswith("+") and "@" not in rule for rule in commands)
    for refused in ("+eval", "+keys", "+scan", "+type", "+flushall", "+config", "+xtrim",
                    "+incrby", "+pexpire", "+wait", "+script|flush", "+publish"):  # fmt: skip
        assert refused not in commands, refused
    assert rules[:4] == ["reset", "on", ">PASSWORD", "resetchannels"]


def test_a_prefix_with_glob_characters_is_literal_in_the_gateways_keys() -> None:
    rules = gateway_rules("llm[a]*:")
    assert can(rules, "llm[a]*:req-1", write=True)
    assert can(rules, "llm[a]*:_file:file-1", write=True)
    assert not can(rules, "llmaX:req-1", write=False)
    assert not can(rules, "llm[a]*:_usage:2026-01-01", write=False)


def test_the_gateway_publishes_and_cancels_and_configures_and_reads_nothing() -> None:
    settings = Settings(_env_file=None, queue="jobs.v1", stream_prefix=PREFIX)
    gateway = rabbitmq_permissions(settings)[GATEWAY]
    assert gateway.configure == gateway.read == "^$"
    for name in ("amq.default", "jobs.v1.cancel"):
        assert re.search(gateway.write, name), name
    for name in ("jobs.v1", "jobs.v1.dead", "jobsXv1.cancel", "jobs.v1.cancel.0123456789ab",
                 "amq.direct", ""):  # fmt: skip
        assert not re.search(gateway.write, name), name


def test_acl_prints_the_gateway_in_both() -> None:
    settings = Settings(_env_file=None, queue="generate", stream_prefix=PREFIX)
    text = as_text(settings)
    assert f"ACL SETUSER {GATEWAY} reset on" in text
    assert f"rabbitmqctl add_user {GATEWAY} PASSWORD" in text
    grants = json.loads(as_json(settings))
    assert GATEWAY in grants["redis"]
    assert grants["rabbitmq"][GATEWAY] == {
        "configure": "^$",
        "write": r"^(amq\.default|generate\.cancel)$",
        "read": "^$",
    }


def test_the_gateway_probes_every_command_it_is_granted() -> None:
    """The start-time probe runs each command of `GATEWAY_COMMANDS`, no other: a command
    added to the gateway is probed, or this fails."""
    granted = {rule.removeprefix("+").replace("|", " ").upper() for rule in GATEWAY_COMMANDS}
    assert set(PROBED) == granted
