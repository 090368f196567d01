"""Where a KV-event publisher's replay socket is: on the event endpoint's port + 1.

The bundled worker binds it there, gateways subscribe there, and `kvgate up` keeps that port
free; this module is the one place that says so.
"""

from __future__ import annotations

import re

REPLAY_PORT_OFFSET = 1
_TCP_ENDPOINT = re.compile(r"(tcp://.+):(\d+)")


def replay_port(event_port: int) -> int:
    return event_port + REPLAY_PORT_OFFSET


def replay_endpoint(endpoint: str) -> str | None:
    """tcp://HOST:PORT -> tcp://HOST:PORT+1; None where there is no port to add to (ipc://)."""
    match = _TCP_ENDPOINT.fullmatch(endpoint)
    if match is None:
        return None
    return f"{match.group(1)}:{replay_port(int(match.group(2)))}"
