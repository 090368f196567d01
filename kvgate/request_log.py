"""Request log lines, shared by the gateway and the worker: one JSON object per line, per request, on
a logger of its own (`kvgate.requests` at the gateway, `kvgate.worker.requests` at the worker) that
writes to stderr unless the operator routes it elsewhere.

A line is written with orjson and bypasses the text format of the other log lines, so a log shipper
parses it as is: {"ts": ISO-8601 UTC, "source": "gateway" | "worker", "event": "request", ...fields}.
Fields that are None are left out. Nothing here ever logs prompt or answer text.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson


class RequestLog:
    """Writes request lines on logger `name`; enabled=False writes nothing (and costs a branch)."""

    def __init__(self, name: str, source: str, enabled: bool = True) -> None:
        self.source = source
        self.logger = logging.getLogger(name)
        self.enabled = enabled
        if enabled and not self.logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            self.logger.addHandler(handler)
            self.logger.setLevel(logging.INFO)
            self.logger.propagate = False  # not again in the text format of the root logger

    def write(self, fields: dict[str, Any]) -> None:
        if not self.enabled or not self.logger.isEnabledFor(logging.INFO):
            return
        line = {"ts": _utc_now(), "source": self.source, "event": "request"}
        line.update((k, v) for k, v in fields.items() if v is not None)
        self.logger.info(orjson.dumps(line).decode())


def _utc_now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
