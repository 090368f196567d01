"""Incremental Server-Sent Events parsing of an upstream byte stream, event by event, and the
compact JSON the gateway writes.

Events are returned as the raw bytes to forward (`data: ...\\n\\n`) plus the decoded JSON payload
(None for `[DONE]` or a non-JSON payload), so the proxy can pass bytes through untouched and
still read text, finish reasons and usage.

JSON goes through orjson, with Python's json module where orjson declines, so the values are
those json gives: a payload orjson refuses (NaN, Infinity, a number too large for a float, an
unpaired surrogate escape, invalid UTF-8, replaced) is parsed by json, its non-finite floats as
NonFinite (a float that orjson will not encode, so they are written back as json writes them);
a value orjson cannot encode is encoded by json. What differs from json alone: integers beyond
64 bits in a worker's chunk (none sends them) come out as floats, and a re-encoded float may be
written in another form of the same number (1e-7 or 0.00001 where json writes 1e-07 or 1e-05).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator

import orjson

from kvgate.json_body import json_pieces


@dataclass(slots=True)
class SseEvent:
    """raw: the event as sent (forwarded untouched); value: its data, the data lines joined by LF;
    payload: the data as a JSON object (None for [DONE], or data that is not one)."""

    raw: bytes
    value: bytes
    payload: dict[str, Any] | None

    @property
    def data(self) -> str:
        """The data as text (invalid UTF-8 replaced)."""
        return self.value.decode("utf-8", errors="replace")

    @property
    def is_done(self) -> bool:
        return self.value == b"[DONE]"


MAX_EVENT_BYTES = 64 << 20  # an upstream event larger than this is a broken stream (SseError)


class SseError(ValueError):
    """The upstream stream cannot be parsed as SSE (an event over the size bound)."""


class SseParser:
    """feed(bytes) -> complete events; a partial event waits for the next chunk.

    Lines end in CRLF, LF or CR, as the SSE spec allows; an empty line ends an event. Field lines
    other than `data` (comments, event, id, retry) are skipped, and an event without data is not
    returned. One space after `data:` is dropped; data lines join with LF. An event whose empty
    line ends in CR at the end of a read is returned at once; an LF that follows is the next
    event's first (empty) line, so the raw bytes of the events are still the stream as sent.

    An event that spans reads is kept in a growing buffer, and each read's bytes are searched once
    for its end: an event of many reads costs its length, not its length times its reads. One that
    grows past max_event_bytes raises SseError.
    """

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._pending = bytearray()  # the start of an event whose end has not come yet
        self._pending_has_cr = False

    def feed(self, chunk: bytes) -> list[SseEvent]:
        if not self._pending and chunk.endswith(b"\n\n") and chunk.find(b"\n\n") == len(chunk) - 2 \
                and chunk.find(b"\r") < 0:
            event = _parse(chunk, False)  # the usual read of a live stream: one whole event, LF-terminated
            return [event] if event is not None else []
        if self._pending:
            searched = len(self._pending)
            self._pending += chunk
            self._pending_has_cr = self._pending_has_cr or chunk.find(b"\r") >= 0
            if not self._has_event_end(searched):
                self._check_size()
                return []
            buffer = bytes(self._pending)
            self._pending.clear()
        else:
            buffer = chunk
        events = []
        start = 0
        has_cr = buffer.find(b"\r") >= 0  # find, not `in`: bytes' `in` raises and clears an error each time
        ends = _lf_event_ends if not has_cr else _event_ends  # the usual LF-only stream: no regex
        for end in ends(buffer):
            event = _parse(buffer[start:end], has_cr)
            if event is not None:
                events.append(event)
            start = end
        if start < len(buffer):
            self._pending += buffer[start:] if start else buffer
            self._pending_has_cr = has_cr and self._pending.find(b"\r") >= 0
            self._check_size()
        return events

    def _check_size(self) -> None:
        if len(self._pending) > self.max_event_bytes:
            raise SseError(f"an upstream event grew past {self.max_event_bytes} bytes without ending")

    def _has_event_end(self, searched: int) -> bool:
        """Whether the pending bytes hold an event's end, searching only what came after `searched`
        (less the 3 bytes an end can span across reads: CR LF CR LF)."""
        since = max(0, searched - 3)
        if not self._pending_has_cr:
            return self._pending.find(b"\n\n", since) >= 0
        return _EVENT_END.search(self._pending, since) is not None


_EOL = rb"(?:\r\n|\r(?!\n)|\n)"
_EVENT_END = re.compile(_EOL + _EOL)  # a line's end, then an empty line's
_LINE_END = re.compile(rb"\r\n|\r|\n")


def _lf_event_ends(buffer: bytes) -> Iterator[int]:
    """Where each complete event in buffer (no CR in it) ends, after its empty line."""
    i = buffer.find(b"\n\n")
    while i >= 0:
        yield i + 2
        i = buffer.find(b"\n\n", i + 2)


def _event_ends(buffer: bytes) -> Iterator[int]:
    """Where each complete event in buffer ends, after its empty line, in any line ending."""
    return (match.end() for match in _EVENT_END.finditer(buffer))


def _parse(raw: bytes, may_have_cr: bool) -> SseEvent | None:
    """raw: one whole event; may_have_cr False when it has no CR (its lines end in LF alone)."""
    if not may_have_cr and raw.startswith(b"data: ") and raw.find(b"\n", 6) == len(raw) - 2:
        value = raw[6:-2]  # the usual event: one data line
    else:
        lines = _LINE_END.split(raw) if may_have_cr else raw.split(b"\n")
        data_lines = [value for value in map(_data_value, lines) if value is not None]
        if not data_lines:
            return None  # comments, keep-alives, fields without data
        value = b"\n".join(data_lines)
    payload = None
    if value != b"[DONE]":
        try:
            decoded = orjson.loads(value)
        except orjson.JSONDecodeError:
            decoded = _lenient_loads(value)
        if type(decoded) is dict:
            payload = decoded
    return SseEvent(raw, value, payload)


def _lenient_loads(value: bytes) -> Any:
    """What orjson declines, as json parses it (invalid UTF-8 replaced); None if it is not JSON."""
    try:
        return json.loads(value.decode("utf-8", errors="replace"), parse_constant=_non_finite, parse_float=_float)
    except json.JSONDecodeError:
        return None


class NonFinite(float):
    """NaN or an infinity from a worker's chunk: a float, but one orjson refuses to encode (it
    would write null), so compact_json writes it as json does (NaN, Infinity)."""

    __slots__ = ()


def _non_finite(name: str) -> float:
    return NonFinite(name)


def _float(text: str) -> float:
    value = float(text)
    return value if value - value == 0 else NonFinite(value)  # inf - inf is NaN, as is NaN - NaN


def _data_value(line: bytes) -> bytes | None:
    """The value of a `data` field line (one leading space dropped), None for any other line."""
    if line == b"data":
        return b""
    if not line.startswith(b"data:"):
        return None
    value = line[5:]
    return value[1:] if value.startswith(b" ") else value


# built once (json.dumps with arguments builds an encoder per call)
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def compact_json(payload: Any) -> bytes:
    """UTF-8 JSON without spaces, as the gateway writes events and responses (orjson; json for what
    orjson declines: a NonFinite float, an integer beyond 64 bits, a non-string key...)."""
    try:
        return orjson.dumps(payload)
    except TypeError:  # orjson.JSONEncodeError included
        return _COMPACT.encode(payload).encode()


PIECE_ITEMS = 1024  # a long list's items encoded at a time by compact_json_pieces (~0.1 ms for logprobs entries)


def compact_json_pieces(payload: Any) -> Iterator[bytes]:
    """compact_json(payload) a piece at a time (kvgate.json_body.json_pieces), for a large answer encoded on
    the event loop with a yield between pieces. The pieces joined are compact_json's bytes (where a piece
    falls back to the json module, its floats may be written in another form of the same number)."""
    return json_pieces(payload, compact_json, PIECE_ITEMS)


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + compact_json(payload) + b"\n\n"


DONE = b"data: [DONE]\n\n"
