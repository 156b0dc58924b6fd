"""The gateway's keys file: what it accepts, what it refuses (naming the file, never a
key), and how a change is taken or, when the new file is bad, not taken."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from trtllm_worker.contract.errors import ConfigError
from trtllm_worker.gateway.keys import Caller, KeyRing, read_keys

OPEN = Caller(None, 5)


def write(path: Path, data: Any) -> Path:
    fresh = path.with_suffix(".new")
    fresh.write_text(data if isinstance(data, str) else json.dumps(data))
    os.replace(fresh, path)  # a new inode, as a Secret update or an editor's save
    return path


def test_a_listed_key_gives_its_tenant_and_priority(tmp_path: Path) -> None:
    path = write(tmp_path / "keys.json", {"sk-a": {"tenant": "acme", "priority": 7}})
    ring = KeyRing(path, OPEN)
    assert ring.lookup("sk-a") == Caller("acme", 7)
    assert ring.lookup("sk-b") is None
    assert ring.lookup("sk-") is None
    assert ring.lookup("") is None
    assert ring.lookup(None) is None
    assert not ring.is_open


def test_without_a_file_every_request_is_the_open_caller() -> None:
    ring = KeyRing(None, OPEN)
    assert ring.is_open
    assert ring.lookup(None) == OPEN


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{nope", "not JSON"),
        ("[1]", "must be a JSON object"),
        ({"sk-secret": {"tenant": "a"}}, "priority"),
        ({"sk-secret": {"tenant": "a", "priority": 10}}, "priority"),
        ({"sk-secret": {"tenant": "", "priority": 1}}, "tenant"),
        ({"sk-secret": {"tenant": "a", "priority": 1, "role": "x"}}, "role"),
        ({" sk-secret": {"tenant": "a", "priority": 1}}, "surrounding spaces"),
    ],
)
def test_a_bad_file_is_refused_naming_the_file_never_the_key(
    tmp_path: Path, content: Any, says: str
) -> None:
    path = write(tmp_path / "keys.json", content)
    with pytest.raises(ConfigError) as refused:
        read_keys(path)
    assert str(path) in str(refused.value)
    assert says in str(refused.value)
    assert "sk-secret" not in str(refused.value)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        KeyRing(tmp_path / "absent.json", OPEN)


def test_a_changed_file_is_read_again_and_a_bad_one_keeps_the_keys(tmp_path: Path) -> None:
    path = write(tmp_path / "keys.json", {"sk-old": {"tenant": "a", "priority": 1}})
    ring = KeyRing(path, OPEN)
    write(path, {"sk-new": {"tenant": "b", "priority": 2}})
    assert ring.lookup("sk-old") == Caller("a", 1), "looked at no more than once a second"
    ring.force_check()
    assert ring.lookup("sk-old") is None
    assert ring.lookup("sk-new") == Caller("b", 2)
    write(path, "{broken")
    ring.force_check()
    assert ring.lookup("sk-new") == Caller("b", 2)
    assert ring.reloads == 1
    path.unlink()  # a file gone: the keys in force stay too
    ring.force_check()
    assert ring.lookup("sk-new") == Caller("b", 2)
