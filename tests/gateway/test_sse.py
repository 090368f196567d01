"""The gateway's SSE parser (gateway/sse.py) on upstream byte streams cut anywhere, in every line ending, and
the JSON it writes: chunks, and a long answer encoded in pieces."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy import LARGE_ANSWER_CHUNKS, _encoded_answer
from gateway.sse import (PIECE_ITEMS, NonFinite, SseError, SseEvent, SseParser, compact_json, compact_json_pieces,
                         encode_event)

TOKEN = {"choices": [{"index": 0, "text": "Hel\u2028lo \u00e9"}]}  # U+2028 is a line break to str.splitlines
USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}


def stream(eol: bytes) -> bytes:
    """A completion stream: a comment, two JSON events, [DONE]; every line ending in eol."""
    lines = [b": keep-alive", b"", b"data: " + json.dumps(TOKEN, ensure_ascii=False).encode(), b"",
             b"data:" + json.dumps(USAGE).encode(), b"", b"data: [DONE]", b""]
    return b"".join(line + eol for line in lines)


def events_of(parser: SseParser, chunks: list[bytes]) -> list[SseEvent]:
    return [event for chunk in chunks for event in parser.feed(chunk)]


def summary(events: list[SseEvent]) -> list[tuple[str, dict | None]]:
    return [(event.data, event.payload) for event in events]


EXPECTED = [(json.dumps(TOKEN, ensure_ascii=False), TOKEN), (json.dumps(USAGE), USAGE), ("[DONE]", None)]
LINE_ENDINGS = pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])


@LINE_ENDINGS
def test_every_line_ending_the_spec_allows_gives_the_same_events(eol):
    assert summary(SseParser().feed(stream(eol))) == EXPECTED


@LINE_ENDINGS
def test_an_event_split_across_two_reads_at_any_byte_gives_the_same_events(eol):
    data = stream(eol)
    for cut in range(len(data) + 1):
        events = events_of(SseParser(), [data[:cut], data[cut:]])
        assert summary(events) == EXPECTED, f"cut at byte {cut}"


@LINE_ENDINGS
def test_a_stream_read_one_byte_at_a_time_gives_the_same_events(eol):
    data = stream(eol)
    events = events_of(SseParser(), [data[i:i + 1] for i in range(len(data))])
    assert summary(events) == EXPECTED
    assert [event.is_done for event in events] == [False, False, True]


@LINE_ENDINGS
def test_a_stream_read_in_three_pieces_at_any_two_bytes_gives_the_same_events(eol):
    """An event that spans reads is searched for its end a read at a time: cut anywhere twice, the
    events and their bytes are the stream's."""
    data = stream(eol)
    for first in range(len(data) + 1):
        for second in range(first, len(data) + 1):
            events = events_of(SseParser(), [data[:first], data[first:second], data[second:]])
            assert summary(events) == EXPECTED, f"cuts at bytes {first} and {second}"
            assert b"".join(event.raw for event in events) in data  # the events' bytes, as sent, in order


def test_an_event_that_spans_many_reads_is_returned_whole_when_its_end_comes():
    parser = SseParser()
    text = "x" * 100_000
    data = b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"
    reads = [data[i:i + 1000] for i in range(0, len(data), 1000)]
    events = [event for read in reads for event in parser.feed(read)]
    assert [event.payload["choices"][0]["text"] for event in events] == [text]
    assert events[0].raw == data


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_an_event_over_the_size_bound_is_an_error_one_at_the_bound_is_not(eol):
    """A worker that streams an event without end would otherwise grow the gateway's buffer without
    bound: past max_event_bytes the stream is broken (the session fails the attempt over)."""
    event = b"data: " + b"x" * 94 + eol + eol  # 100 bytes with LF, 102 with CRLF
    [whole] = SseParser(max_event_bytes=len(event)).feed(event)
    assert whole.raw == event
    parser = SseParser(max_event_bytes=len(event))
    assert parser.feed(event[:50]) == []
    assert [e.raw for e in parser.feed(event[50:])] == [event]
    parser = SseParser(max_event_bytes=150)
    assert parser.feed(b"data: " + b"x" * 100) == []
    with pytest.raises(SseError, match="150 bytes"):
        parser.feed(b"x" * 100)
    with pytest.raises(SseError):  # in one read too, after the events it ended
        SseParser(max_event_bytes=150).feed(event + b"data: " + b"y" * 200)


@LINE_ENDINGS
def test_the_raw_bytes_of_the_events_are_the_stream_as_sent(eol):
    """What the proxy forwards is what the worker wrote (no comment here, so nothing is dropped), but
    for the LF of a CRLF cut off by the read's end, which waits to lead the next event."""
    data = b"".join(b"data: " + json.dumps(p).encode() + eol + eol for p in (TOKEN, USAGE))
    for cut in range(len(data) + 1):
        forwarded = b"".join(event.raw for event in events_of(SseParser(), [data[:cut], data[cut:]]))
        assert forwarded == data or (cut == len(data) - 1 and eol == b"\r\n" and forwarded + b"\n" == data)


def test_comments_and_other_fields_alone_are_not_events():
    parser = SseParser()
    assert parser.feed(b": ping\n\nevent: status\nid: 7\nretry: 100\n\n:\r\n\r\n") == []
    assert summary(parser.feed(b"event: message\nid: 8\ndata: [DONE]\n\n")) == [("[DONE]", None)]


def test_data_lines_of_one_event_join_with_a_newline():
    parser = SseParser()
    [event] = parser.feed(b'data: {"choices":\r\n: a comment between\r\ndata: [], "usage": null}\r\n\r\n')
    assert event.data == '{"choices":\n[], "usage": null}'
    assert event.payload == {"choices": [], "usage": None}


@pytest.mark.parametrize(
    ("line", "data"),
    [(b"data: x", "x"), (b"data:x", "x"), (b"data:  x", " x"), (b"data:", ""), (b"data", ""), (b"data: ", "")],
    ids=["space", "no-space", "two-spaces", "empty", "no-colon", "space-only"],
)
def test_only_one_space_after_the_colon_is_dropped(line, data):
    [event] = SseParser().feed(line + b"\n\n")
    assert event.data == data and event.payload is None


def test_a_non_object_payload_is_kept_as_text():
    [array, broken] = SseParser().feed(b"data: [1, 2]\n\ndata: {not json\n\n")
    assert (array.data, array.payload) == ("[1, 2]", None)
    assert (broken.data, broken.payload) == ("{not json", None)


def test_an_event_ending_in_cr_at_the_end_of_a_read_is_returned_at_once():
    """CR at a read's end may be half of a CRLF: the LF after it starts the next event's bytes, and
    makes no event of its own, so what is forwarded is still the stream as sent."""
    parser = SseParser()
    reads = [b"data: a\r\n\r", b"\ndata: b\r\n\r\n", b"data: c\r\r", b"data: d\r\r"]
    events = [parser.feed(read) for read in reads]
    assert [[event.data for event in batch] for batch in events] == [["a"], ["b"], ["c"], ["d"]]
    assert b"".join(event.raw for batch in events for event in batch) == b"".join(reads)


COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # what the gateway wrote before orjson


@pytest.mark.parametrize("payload", [
    {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel\u2028lo \u00e9 \U0001F600 \"q\" \\ \x00\x1f"},
                              "logprobs": None, "finish_reason": None}], "created": 0},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 0}}, "flag": True, "neg": -2 ** 63},
    {"prompt_token_ids": [0, 2 ** 32 - 1], "choices": [{"index": 0, "text": "x", "token_ids": [1, 2]}]},
], ids=["text", "usage", "token-ids"])
def test_a_chunk_reads_and_writes_back_as_the_json_module_has_it(payload):
    raw = b"data: " + COMPACT.encode(payload).encode() + b"\n\n"
    [event] = SseParser().feed(raw)
    assert event.payload == json.loads(raw[6:])
    assert encode_event(event.payload) == raw


def test_nan_infinity_and_numbers_beyond_a_float_in_a_chunk_read_and_write_back_as_json_has_them():
    raw = b'data: {"choices":[{"index":0,"text":"a","logprobs":{"token_logprobs":[NaN,-Infinity,1e999,-0.5]}}]}\n\n'
    [event] = SseParser().feed(raw)
    values = event.payload["choices"][0]["logprobs"]["token_logprobs"]
    assert [repr(v) for v in values] == ["nan", "-inf", "inf", "-0.5"]
    assert encode_event(event.payload) == b"data: " + COMPACT.encode(json.loads(raw[6:])).encode() + b"\n\n"
    assert b"NaN,-Infinity,Infinity,-0.5" in encode_event(event.payload)


def test_invalid_utf8_in_a_chunk_is_replaced_as_before():
    [event] = SseParser().feed(b'data: {"choices":[{"index":0,"text":"a\xffb"}]}\n\n')
    assert event.payload == {"choices": [{"index": 0, "text": "a\ufffdb"}]}


def test_what_orjson_cannot_encode_is_encoded_by_the_json_module():
    value = {"big": 2 ** 70, "keys": {1: "one"}}
    assert compact_json(value) == COMPACT.encode(value).encode()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=12) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=40)


@settings(max_examples=200, deadline=None)
@given(value=JSON_VALUES)
def test_an_answer_encoded_in_pieces_is_the_answer_encoded_at_once(value):
    assert b"".join(compact_json_pieces(value)) == compact_json(value)


def test_a_long_list_is_encoded_a_slice_at_a_time_and_a_short_one_descended_into():
    entries = [{"token": "t", "logprob": -0.5, "bytes": [116]}] * (2 * PIECE_ITEMS + 1)
    answer = {"choices": [{"index": 0, "logprobs": {"content": entries}, "token_ids": list(range(PIECE_ITEMS))}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 2}, "odd": {1: NonFinite("nan")}}
    pieces = list(compact_json_pieces(answer))
    assert b"".join(pieces) == compact_json(answer)
    assert len([p for p in pieces if p.count(b'"token"') == PIECE_ITEMS]) == 2  # the slices of the long list
    assert compact_json(list(range(PIECE_ITEMS))) in pieces  # a list up to PIECE_ITEMS: one piece


def test_a_long_answer_is_encoded_with_the_event_loop_running_between_pieces():
    """A non-streaming answer of LARGE_ANSWER_CHUNKS chunks or more does not hold the loop while it is
    encoded: another task runs between its pieces. A shorter one is encoded at once."""
    entries = [{"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": []}] * (8 * PIECE_ITEMS)
    answer = {"id": "c", "choices": [{"index": 0, "message": {"role": "assistant", "content": "t" * len(entries)},
                                      "logprobs": {"content": entries}}]}

    async def scenario() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        for num_chunks, ran_between in ((LARGE_ANSWER_CHUNKS, True), (LARGE_ANSWER_CHUNKS - 1, False)):
            before = ticks
            assert await _encoded_answer(answer, num_chunks) == compact_json(answer)
            assert (ticks - before > 1) is ran_between
        task.cancel()

    asyncio.run(scenario())
