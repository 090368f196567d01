"""Request log lines, shared by the gateway and the worker: one JSON object per line, per request,
written straight to stderr (or a given binary stream) as one write each.

A line bypasses the logging module (its records, caller lookup and locks cost several times the line
itself) and the text format of the other log lines, so a log shipper parses it as is:
{"ts": ISO-8601 UTC, "source": "gateway" | "worker", "event": "request", ...fields}. Fields that are
None are left out. Nothing here ever logs prompt or answer text. A line of up to PIPE_BUF bytes (4 KiB)
is written whole even when other lines go to the same pipe.
"""

from __future__ import annotations

import random
import re
import sys
import time
from typing import Any, BinaryIO

import orjson


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_id(incoming: str | None) -> str:
    """A request's id: the caller's X-Request-Id when it is one (letters, digits and `._:-`, at most 128),
    else a new one (32 hex digits, uuid4().hex's form; from the random module, reseeded in every forked
    process: an id names a request and guards nothing, so it needs no system call for entropy)."""
    return incoming if incoming and _REQUEST_ID.match(incoming) else "%032x" % random.getrandbits(128)


class RequestLog:
    """Writes request lines to stream (default: this process's stderr, one write call each);
    enabled=False writes nothing (and costs a branch)."""

    def __init__(self, source: str, enabled: bool = True, stream: BinaryIO | None = None) -> None:
        self.source = source
        self.enabled = enabled
        self._stream = stream  # None: this process's stderr, looked up at each line

    def write(self, fields: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = {"ts": _utc_now(), "source": self.source, "event": "request"}
        for key, value in fields.items():
            if value is not None:
                line[key] = value
        data = orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
        if self._stream is not None:
            self._stream.write(data)
            return
        stderr = sys.stderr.buffer
        stderr.write(data)
        stderr.flush()  # one write call per line


def _utc_now() -> str:
    """Now as ISO-8601 UTC with milliseconds; the part up to the second is formatted once a second."""
    global _second, _second_text
    now = time.time()
    second = int(now)
    if second != _second:
        _second, _second_text = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    return f"{_second_text}.{int((now - second) * 1000):03d}Z"


_second, _second_text = -1, ""
