"""Incremental Server-Sent Events parsing of an upstream byte stream, event by event.

Events are returned as the raw bytes to forward (`data: ...\\n\\n`) plus the decoded JSON payload
(None for `[DONE]` or a non-JSON payload), so the proxy can pass bytes through untouched and
still read text, finish reasons and usage.
"""

from __future__ import annotations

import json
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
    """feed(bytes) -> complete events; a partial event waits for the next chunk."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[SseEvent]:
        self._buffer += chunk
        events = []
        while True:
            end, sep_len = _find_separator(self._buffer)
            if end < 0:
                return events
            raw = self._buffer[: end + sep_len]
            self._buffer = self._buffer[end + sep_len:]
            event = _parse(raw)
            if event is not None:
                events.append(event)


def _find_separator(buffer: bytes) -> tuple[int, int]:
    if b"\r" not in buffer:
        return buffer.find(b"\n\n"), 2
    candidates = [(buffer.find(sep), len(sep)) for sep in (b"\n\n", b"\r\n\r\n")]
    found = [(i, n) for i, n in candidates if i >= 0]
    return min(found) if found else (-1, 0)


def _parse(raw: bytes) -> SseEvent | None:
    lines = raw.decode("utf-8", errors="replace").splitlines()
    data = "\n".join(line[5:].lstrip(" ") if len(line) > 5 else "" for line in lines if line.startswith("data:"))
    if not data and not any(line.startswith("data:") for line in lines):
        return None  # comments / keep-alives
    payload = None
    if data != "[DONE]":
        try:
            decoded = json.loads(data)
            payload = decoded if isinstance(decoded, dict) else None
        except json.JSONDecodeError:
            payload = None
    return SseEvent(raw=raw, data=data, payload=payload)


# built once (json.dumps with arguments builds an encoder per call)
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def compact_json(payload: Any) -> bytes:
    """UTF-8 JSON without spaces, as the gateway writes events and responses."""
    return _COMPACT.encode(payload).encode()


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + compact_json(payload) + b"\n\n"


DONE = b"data: [DONE]\n\n"
