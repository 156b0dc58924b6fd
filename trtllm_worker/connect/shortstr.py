"""AMQP short strings that are not UTF-8 must not cost the connection.

The defect (pamqp 4.0.1, aiormq 7.2.4; issue 25, item 1): pamqp decodes every AMQP
`shortstr` with strict UTF-8: the content header's `content_type`, `content_encoding`,
`message_id`, `correlation_id`, `reply_to`, `type`, `app_id`, `user_id`,
`expiration`, `cluster_id`, the key of every field table entry (`headers`, nested
tables included), and a method's `exchange` or `routing_key` (`Basic.Deliver`).
RabbitMQ (3.10.8 here) passes such bytes through (it refuses only a bad `user_id` or
`expiration`), so one message published with `message_id=b"\\xff"` makes
`pamqp.decode.short_str` (or `field_table`) raise `UnicodeDecodeError`, which
`pamqp.frame.unmarshal` turns into `UnmarshalingException` and aiormq's frame reader
into `InvalidFrameError`: the reader task ends and the connection with it. The broker
requeues the message and delivers it again after the reconnect, forever; on the cancel
fanout every worker drops at once.

The guard: `install()` (called by `trtllm_worker.broker.consumer` at import: in the worker's
process, not in a client SDK user's) replaces those two decoders with copies of pamqp
4.0.1's that decode with `errors="surrogateescape"`: the message arrives, and each
undecodable byte is a lone surrogate (U+DC80..U+DCFF) in its string, which strict
UTF-8 never yields, so `undecodable(text)` tells such a string apart and `raw(text)`
gives back its exact bytes. The worker dead-letters such a job (`invalid_request`,
naming the field and its bytes) and publishes the dead letter without the undecodable
strings (pamqp's encoder refuses them: `UnicodeEncodeError`); a cancel is read from its
body alone.

The copies are only right for the pamqp they were copied from: `install()` refuses any
other version (`PAMQP_VERSION`, the distribution's version: `pamqp.__version__` still
says 4.0.0 in 4.0.1), so an upgrade stops here until someone reads the new
`pamqp/decode.py` again (and drops this module once pamqp decodes such bytes itself).
That the copies decode valid input as pamqp's own do is tested in
tests/unit/test_shortstr.py."""

from __future__ import annotations

import struct
from importlib.metadata import version
from typing import Final

from pamqp import common, decode

PAMQP_VERSION: Final = "4.0.1"
"""The pamqp whose `decode.short_str` and `decode.field_table` are copied below."""

ERRORS: Final = "surrogateescape"


def undecodable(text: str) -> bool:
    """True if `text` holds bytes that were not UTF-8 (decoded by the guard)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def raw(text: str) -> bytes:
    """The bytes `text` was decoded from."""
    return text.encode("utf-8", ERRORS)


def short_str(value: bytes) -> tuple[int, str]:
    """pamqp 4.0.1's `decode.short_str`, tolerant of bytes that are not UTF-8."""
    try:
        length = common.Struct.byte.unpack(value[0:1])[0]
        return length + 1, value[1 : length + 1].decode("utf-8", ERRORS)
    except (struct.error, TypeError) as err:
        raise ValueError("Could not unpack short string value") from err


def field_table(value: bytes) -> tuple[int, common.FieldTable]:
    """pamqp 4.0.1's `decode.field_table`, tolerant of keys that are not UTF-8."""
    try:
        length = common.Struct.integer.unpack(value[0:4])[0]
        offset = 4
        data = {}
        field_table_end = offset + length
        if field_table_end > len(value):
            raise ValueError("Field table length exceeds available data")
        while offset < field_table_end:
            key_length = common.Struct.byte.unpack_from(value, offset)[0]
            offset += 1
            if offset + key_length > field_table_end:
                raise ValueError("Field table key length exceeds data")
            key = value[offset : offset + key_length].decode("utf-8", ERRORS)
            offset += key_length
            consumed, result = decode.embedded_value(value[offset:])
            offset += consumed
            data[key] = result
        return field_table_end, data
    except (struct.error, TypeError) as err:
        raise ValueError("Could not unpack data") from err


def install() -> None:
    """Make pamqp decode short strings tolerantly, in this process (idempotent).
    `RuntimeError` if pamqp is not the version the decoders were copied from."""
    found = version("pamqp")
    if found != PAMQP_VERSION:
        raise RuntimeError(
            f"pamqp {found} is installed; trtllm_worker/connect/shortstr.py replaces decoders "
            f"copied from pamqp {PAMQP_VERSION}: compare them with the new "
            "pamqp/decode.py and update PAMQP_VERSION (or drop the guard if pamqp "
            "decodes short strings that are not UTF-8 itself)"
        )
    # where pamqp looks them up: `decode.by_type` in METHODS (method arguments, content
    # header properties), `decode.embedded_value` in TABLE_MAPPING (nested tables)
    decode.METHODS["shortstr"] = short_str
    decode.METHODS["table"] = field_table
    decode.TABLE_MAPPING[b"F"] = field_table
    decode.short_str = short_str
    decode.field_table = field_table


def installed() -> bool:
    return (
        decode.METHODS["shortstr"] is short_str
        and decode.METHODS["table"] is field_table
        and decode.TABLE_MAPPING[b"F"] is field_table
    )
