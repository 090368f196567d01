"""The gateway's SSE parser (gateway/sse.py) on upstream byte streams cut anywhere, in every line ending."""

from __future__ import annotations

import json

import pytest

from gateway.sse import SseEvent, SseParser

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
