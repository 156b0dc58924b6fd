"""The pamqp guard (`trtllm_worker/connect/shortstr.py`): frames whose short strings are not
UTF-8 decode instead of raising, and everything else decodes exactly as pamqp's own
decoders do (compared with a fresh, unpatched copy of `pamqp.decode`). The broker-side
behaviour is tested in tests/integration/test_undecodable.py."""

from __future__ import annotations

import importlib.util
from importlib.metadata import version
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import commands, encode, frame, header

import trtllm_worker.broker.consumer  # noqa: F401  (installs the guard, as the worker does)
from tests.raw_amqp import patched
from trtllm_worker.connect import shortstr
from trtllm_worker.connect.messages import decodable_table

BAD = b"\xff\xfe\xc3\x28"


def pristine_decode() -> ModuleType:
    """pamqp's `decode` module loaded anew from its file: the guard does not touch it."""
    import pamqp.decode

    spec = importlib.util.spec_from_file_location("pamqp_decode_pristine", pamqp.decode.__file__)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PRISTINE = pristine_decode()


def test_installed_for_the_pinned_pamqp() -> None:
    assert shortstr.installed()
    # a pamqp upgrade (uv.lock) fails here first: the decoders are copies of this version's
    assert version("pamqp") == shortstr.PAMQP_VERSION


def test_another_pamqp_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shortstr, "version", lambda _: "4.1.0")
    with pytest.raises(RuntimeError, match=r"pamqp 4\.1\.0 is installed.*shortstr\.py"):
        shortstr.install()


def test_pamqp_itself_still_fails_on_these_bytes() -> None:
    """The defect the guard is for (if pamqp fixes it, the guard can go)."""
    with pytest.raises(UnicodeDecodeError):
        PRISTINE.short_str(bytes([len(BAD)]) + BAD)


def bad_frames(properties: commands.Basic.Properties, routing_key: str = "rk") -> bytes:
    deliver = commands.Basic.Deliver("ctag", 1, False, "", routing_key)
    frames = frame.marshal(deliver, 1) + frame.marshal(header.ContentHeader(0, 2, properties), 1)
    return patched(frames, {b"@@@@": BAD})


@pytest.mark.parametrize(
    ("properties", "routing_key"),
    [
        (commands.Basic.Properties(message_id="@@@@"), "rk"),
        (commands.Basic.Properties(content_type="@@@@", app_id="ok"), "rk"),
        (commands.Basic.Properties(headers={"@@@@": "v", "ok": 1}), "rk"),
        (commands.Basic.Properties(headers={"a": [{"@@@@": 1}]}), "rk"),
        (commands.Basic.Properties(message_type="x"), "@@@@"),
    ],
    ids=["message_id", "content_type", "header-key", "nested-key", "routing-key"],
)
def test_undecodable_frames_decode(properties: commands.Basic.Properties, routing_key: str) -> None:
    data = bad_frames(properties, routing_key)
    used, _, deliver = frame.unmarshal(data)
    _, _, content = frame.unmarshal(data[used:])
    assert isinstance(deliver, commands.Basic.Deliver)
    assert isinstance(content, header.ContentHeader)
    found = [
        value
        for value in (deliver.routing_key, *vars_of(content.properties))
        if isinstance(value, str) and shortstr.undecodable(value)
    ]
    keys = list(table_keys(content.properties.headers or {}))
    found += [key for key in keys if shortstr.undecodable(key)]
    assert len(found) == 1
    assert shortstr.raw(found[0]) == BAD
    # what pamqp cannot encode again, and why the dead letter leaves it out
    with pytest.raises(UnicodeEncodeError):
        encode.short_string(found[0])
    clean = decodable_table(content.properties.headers or {})
    encode.field_table(clean)
    assert not any(shortstr.undecodable(key) for key in table_keys(clean))


def vars_of(properties: commands.Basic.Properties) -> list[Any]:
    return [getattr(properties, name) for name in properties.__slots__]


def table_keys(value: object) -> list[str]:
    if isinstance(value, dict):
        return [k for key, item in value.items() for k in (key, *table_keys(item))]
    if isinstance(value, list):
        return [k for item in value for k in table_keys(item)]
    return []


def test_undecodable_tells_only_escaped_bytes() -> None:
    for text in ("", "application/json", "日本語", "😀"):
        assert not shortstr.undecodable(text)
    escaped = BAD.decode("utf-8", "surrogateescape")
    assert shortstr.undecodable(escaped)
    assert shortstr.raw(escaped) == BAD


keys = st.text(min_size=0, max_size=20)
leaves = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.text(max_size=30),
    st.none(),
)
tables = st.recursive(
    st.dictionaries(keys, leaves, max_size=4),
    lambda children: st.dictionaries(
        keys, st.one_of(leaves, children, st.lists(children, max_size=3)), max_size=4
    ),
    max_leaves=12,
)


@given(text=st.text(max_size=80).filter(lambda t: len(t.encode()) <= 255), table=tables)
def test_sound_input_decodes_exactly_as_pamqp_does(text: str, table: dict[str, Any]) -> None:
    encoded_text = encode.short_string(text)
    encoded_table = encode.field_table(table)
    assert shortstr.short_str(encoded_text) == PRISTINE.short_str(encoded_text)
    assert shortstr.field_table(encoded_table) == PRISTINE.field_table(encoded_table)
    # truncated input fails the same way too
    for cut in (encoded_table[:3], encoded_table[: len(encoded_table) // 2]):
        assert outcome(shortstr.field_table, cut) == outcome(PRISTINE.field_table, cut)
    assert outcome(shortstr.short_str, b"") == outcome(PRISTINE.short_str, b"")


def outcome(decoder: Any, data: bytes) -> object:
    try:
        return decoder(data)
    except ValueError as exc:
        return (type(exc), str(exc))
