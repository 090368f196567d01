"""Incremental Server-Sent Events parsing of an upstream byte stream, event by event.

Events are returned as the raw bytes to forward (`data: ...\\n\\n`) plus the decoded JSON payload
(None for `[DONE]` or a non-JSON payload), so the proxy can pass bytes through untouched and
still read text, finish reasons and usage.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class SseEvent:
    raw: bytes
    data: str
    payload: dict[str, Any] | None

    @property
    def is_done(self) -> bool:
        return self.data == "[DONE]"


class SseParser:
    """feed(bytes) -> complete events; a partial event waits for the next chunk.

    Lines end in CRLF, LF or CR, as the SSE spec allows; an empty line ends an event. Field lines
    other than `data` (comments, event, id, retry) are skipped, and an event without data is not
    returned. One space after `data:` is dropped; data lines join with LF. An event whose empty
    line ends in CR at the end of a read is returned at once; an LF that follows is the next
    event's first (empty) line, so the raw bytes of the events are still the stream as sent.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[SseEvent]:
        self._buffer += chunk
        events = []
        while True:
            end = _event_end(self._buffer)
            if end is None:
                return events
            raw, self._buffer = self._buffer[:end], self._buffer[end:]
            event = _parse(raw)
            if event is not None:
                events.append(event)


_EOL = rb"(?:\r\n|\r(?!\n)|\n)"
_EVENT_END = re.compile(_EOL + _EOL)  # a line's end, then an empty line's
_LINE_END = re.compile(rb"\r\n|\r|\n")


def _event_end(buffer: bytes) -> int | None:
    """Where the first complete event in buffer ends (after its empty line), or None."""
    if b"\r" not in buffer:  # the usual LF-only stream, without a regex
        i = buffer.find(b"\n\n")
        return None if i < 0 else i + 2
    match = _EVENT_END.search(buffer)
    return None if match is None else match.end()


def _parse(raw: bytes) -> SseEvent | None:
    lines = raw.split(b"\n") if b"\r" not in raw else _LINE_END.split(raw)
    data_lines = [value for value in map(_data_value, lines) if value is not None]
    if not data_lines:
        return None  # comments, keep-alives, fields without data
    data = b"\n".join(data_lines).decode("utf-8", errors="replace")
    payload = None
    if data != "[DONE]":
        try:
            decoded = json.loads(data)
            payload = decoded if isinstance(decoded, dict) else None
        except json.JSONDecodeError:
            payload = None
    return SseEvent(raw=raw, data=data, payload=payload)


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
    """UTF-8 JSON without spaces, as the gateway writes events and responses."""
    return _COMPACT.encode(payload).encode()


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + compact_json(payload) + b"\n\n"


DONE = b"data: [DONE]\n\n"
