"""The `gateway` benchmark's pure parts: its percentiles and added-latency arithmetic,
the most streams within the bound, and the load generator's HTTP chunked decoding and
server-sent event parsing (bench/gateway_stats.py, bench/sse_client.py)."""

from __future__ import annotations

import json

import pytest

from bench.gateway_stats import (
    Window,
    added_latency,
    holds,
    most_streams,
    paired_added,
    percentile,
    relay_added,
    shares,
)
from bench.sse_client import ChunkedDecoder, ProtocolError, SseEvent, SseParser, chat_tokens


def test_percentile_is_the_nearest_rank_as_the_harness_takes_it() -> None:
    values = [float(v) for v in range(1, 101)]  # 1 .. 100
    assert percentile(values, 0.5) == 51.0
    assert percentile(values, 0.99) == 100.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) is None
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 0)


def test_added_latency_is_the_difference_of_each_sides_percentiles() -> None:
    through = [10.0 + v for v in range(100)]  # p50 60, p99 109
    direct = [8.0 + v / 2 for v in range(100)]  # p50 33, p99 57.5
    figures = added_latency(through, direct)
    assert figures["answers"] == figures["direct_answers"] == 100
    assert figures["gateway_ms_p50"] == 60.0
    assert figures["direct_ms_p50"] == 33.0
    assert figures["added_ms_p50"] == 27.0
    assert figures["gateway_ms_p99"] == 109.0
    assert figures["direct_ms_p99"] == 57.5
    assert figures["added_ms_p99"] == 51.5


def test_added_latency_without_answers_on_a_side_is_none() -> None:
    figures = added_latency([], [1.0, 2.0])
    assert figures["added_ms_p50"] is None
    assert figures["added_ms_p99"] is None
    assert figures["direct_ms_p50"] == 2.0


def test_paired_added_takes_each_pairs_difference() -> None:
    """A pair's difference, not the difference of the sides' percentiles: a slow pair
    on both sides adds nothing."""
    pairs = [(5.0, 3.0)] * 98 + [(100.0, 99.0), (9.0, 3.0)]
    figures = paired_added(pairs)
    assert figures["paired_added_ms_p50"] == 2.0
    assert figures["paired_added_ms_p99"] == 6.0  # the largest difference of the 100
    assert figures["added_ms_p99"] == 1.0  # 100 - 99, the sides' p99s


def test_relay_added_pairs_each_token_with_its_entry() -> None:
    through = [1.000, 1.050, 1.1015]  # the k-th token's chunk
    direct = {1: 1.049, 2: 1.100, 5: 2.0}  # token 0 was in the stream before the reader
    assert relay_added(through, direct) == [1.0, 1.5]
    assert relay_added([], direct) == []


def level(streams: int, added_p99: float | None, **more: object) -> dict[str, object]:
    return {"streams": streams, "relay_added_ms_p99": added_p99, "answers": 10, "errors": {},
            "short_answers": 0, **more}  # fmt: skip


def test_a_level_holds_under_the_bound_with_every_answer_whole() -> None:
    assert holds(level(20, 49.9), 50)
    assert not holds(level(20, 50.0), 50)
    assert not holds(level(20, None), 50)
    assert not holds(level(20, 1.0, errors={"ProtocolError": 1}), 50)
    assert not holds(level(20, 1.0, short_answers=2), 50)
    assert not holds(level(20, 1.0, answers=0), 50)


def test_most_streams_is_the_last_level_held_before_the_first_that_did_not() -> None:
    points = [level(500, 80.0), level(20, 3.0), level(100, 12.0), level(1000, 4.0)]
    assert most_streams(points, 50) == 100  # 1000 held, but 500 did not
    assert most_streams([level(20, 60.0)], 50) is None
    assert most_streams([], 50) is None


def test_clients_are_shared_evenly_over_the_fewest_processes() -> None:
    assert shares(20, 250) == [20]
    assert shares(250, 250) == [250]
    assert shares(500, 250) == [250, 250]
    assert shares(1000, 300) == [250, 250, 250, 250]
    assert shares(7, 3) == [3, 2, 2]
    assert sum(shares(999, 250)) == 999


def test_the_window_counts_tokens_within_it() -> None:
    window = Window(10.0, 20.0)
    for now, n in ((9.99, 5), (10.0, 1), (15.0, 2), (20.0, 7)):
        window.add(now, n)
    assert window.tokens == 3
    assert window.holds(10.0)
    assert not window.holds(20.0)


# -- HTTP/1.1 chunked bodies -----------------------------------------------------------


def chunked(*payloads: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in payloads) + b"0\r\n\r\n"


def test_chunked_payloads_come_out_whole_however_the_bytes_are_split() -> None:
    body = chunked(b"data: one\r\n\r\n", b"x" * 300, b"data: \xc3\xa9\r\n\r\n")
    for size in (1, 2, 3, 7, 64, len(body)):
        decoder = ChunkedDecoder()
        out = [
            p
            for start in range(0, len(body), size)
            for p in decoder.feed(body[start : start + size])
        ]
        assert decoder.done, size
        assert b"".join(out) == b"data: one\r\n\r\n" + b"x" * 300 + b"data: \xc3\xa9\r\n\r\n"
        assert decoder.leftover == b""


def test_chunk_extensions_are_ignored_and_a_bad_size_is_refused() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"3;name=value\r\nabc\r\n0\r\n\r\n") == [b"abc"]
    assert decoder.done
    with pytest.raises(ProtocolError, match="chunk size"):
        ChunkedDecoder().feed(b"zz\r\nabc\r\n")
    with pytest.raises(ProtocolError, match="CRLF"):
        ChunkedDecoder().feed(b"3\r\nabcXY")


def test_the_decoder_waits_for_the_blank_line_after_the_last_chunk() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"2\r\nab\r\n0\r\n") == [b"ab"]
    assert not decoder.done
    decoder.feed(b"\r\n")
    assert decoder.done


# -- server-sent events ----------------------------------------------------------------


def test_events_are_dispatched_on_a_blank_line_whatever_the_line_ends() -> None:
    text = "data: a\r\n\r\ndata: b\n\ndata: c\r\rid: 7\nevent: error\ndata: d\n\n"
    assert SseParser().feed(text) == [
        SseEvent("a"),
        SseEvent("b"),
        SseEvent("c"),
        SseEvent("d", event="error", id="7"),
    ]


def test_a_line_split_across_feeds_and_a_split_crlf_are_read_once() -> None:
    text = 'data: {"x": 1}\r\n\r\n: ping - 2026-01-01\r\n\r\ndata: [DONE]\r\n\r\n'
    for size in (1, 2, 5, 17):
        parser = SseParser()
        events = [
            e
            for start in range(0, len(text), size)
            for e in parser.feed(text[start : start + size])
        ]
        assert events == [SseEvent('{"x": 1}'), SseEvent("[DONE]")], size


def test_comments_are_skipped_and_data_lines_join() -> None:
    parser = SseParser()
    assert parser.feed(": keep-alive\n\n") == []
    assert parser.feed("data:first\ndata: second\n\n") == [SseEvent("first\nsecond")]
    assert parser.feed("data: open") == []  # not dispatched without its blank line


def chat_chunk(content: str | None, role: bool = False) -> str:
    delta: dict[str, str] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]})


def test_a_chunk_with_text_is_a_token_and_done_ends() -> None:
    assert chat_tokens(chat_chunk("hé", role=True)) == (1, False, "chatcmpl-1")
    assert chat_tokens(chat_chunk("")) == (0, False, "chatcmpl-1")
    assert chat_tokens(chat_chunk(None)) == (0, False, "chatcmpl-1")  # the finish chunk
    assert chat_tokens(json.dumps({"id": "c", "choices": [], "usage": {}})) == (0, False, "c")
    assert chat_tokens("[DONE]") == (0, True, None)
    with pytest.raises(ProtocolError, match="error event"):
        chat_tokens(json.dumps({"error": {"message": "boom"}}))
