"""The store's Lua files (`trtllm_worker/streams/lua/`): found as package resources, and
the two write scripts put together from one body. Running them is test_pipeline's and
the cluster tests' job; this needs no Redis."""

from __future__ import annotations

from importlib.resources import files

import pytest

from trtllm_worker.streams.scripts import lua, write_script


@pytest.mark.parametrize("name", ["write", "start", "renew", "release", "compact", "probe"])
def test_every_script_is_a_package_resource(name: str) -> None:
    assert "redis." in lua(name)


def test_both_write_scripts_run_the_one_body_after_their_keys() -> None:
    body = lua("write")
    for entry in ("write_keys", "write_node"):
        script = write_script(entry)
        assert script.endswith(body)
        assert script.count("local K = ") == 1
        assert script.index("local K = ") < script.index("local ttl = ")


def test_only_the_node_script_declares_cross_slot_keys_on_its_first_line() -> None:
    assert write_script("write_node").startswith("#!lua flags=allow-cross-slot-keys\n")
    assert "#!" not in write_script("write_keys")


def test_the_lua_directory_holds_only_scripts_that_are_read() -> None:
    on_disk = {
        entry.name.removesuffix(".lua")
        for entry in (files("trtllm_worker.streams") / "lua").iterdir()
        if entry.name.endswith(".lua")
    }
    read = {"write", "write_keys", "write_node", "start", "renew", "release", "compact", "probe"}
    read.add("reset_for_requeue")  # the SDK's requeue (client/admin.py)
    assert on_disk == read
