"""The client side of one overload run: the load driver with a transport that adds the run's headers
(e.g. x-request-deadline-ms), notes when each marked request was sent, and keeps the `error.code`
of every refusal (the driver itself keeps only the status)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Callable, Mapping, Sequence

import httpx

from loadtest.driver import DriverConfig, DriverRun, run_load
from loadtest.recording_proxy import find_marker
from loadtest.types import RequestSpec

NUM_POOLS, POOL_KEEPALIVE = 64, 8  # connection pools the load generator spreads its requests over


class ProbeTransport(httpx.AsyncBaseTransport):
    """Wraps transports, taking them in turn: sets `headers` on every request; records sent_s[marker]
    (clock at send, before a connection is taken), codes[marker] (a non-200 answer's error.code) and
    server_ms[marker] (a non-200 answer's Server-Timing `gateway` duration: the gateway's own time).

    Several inner transports, because one httpcore pool costs O(connections^2) per request once
    thousands of streams are open (its idle-connection check counts every connection for each
    one), which made the load generator, not the gateway, the bottleneck at 10x C."""

    def __init__(self, inners: Sequence[httpx.AsyncBaseTransport], headers: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not inners:
            raise ValueError("give at least one inner transport")
        self.inners, self.headers, self.clock = list(inners), dict(headers or {}), clock
        self._turn = itertools.cycle(self.inners)
        self.sent_s: dict[str, float] = {}
        self.codes: dict[str, str | None] = {}
        self.server_ms: dict[str, float | None] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.headers.update(self.headers)
        marker = find_marker(request.content)
        if marker is not None:
            self.sent_s[marker] = self.clock()
        response = await next(self._turn).handle_async_request(request)
        if marker is not None and response.status_code != 200:
            self.codes[marker] = error_code(await response.aread())
            self.server_ms[marker] = gateway_duration_ms(response.headers.get("server-timing"))
        return response

    async def aclose(self) -> None:
        for inner in self.inners:
            await inner.aclose()


def error_code(body: bytes) -> str | None:
    """`error.code` of an OpenAI-style error body (as text), None when it has none."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return None if code is None else str(code)


def gateway_duration_ms(server_timing: str | None) -> float | None:
    """The `dur` of the `gateway` metric in a Server-Timing header (None without one)."""
    for metric in (server_timing or "").split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        if name == "gateway":
            for param in params:
                key, _, value = param.partition("=")
                if key.strip() == "dur":
                    try:
                        return float(value)
                    except ValueError:
                        return None
    return None


def drive(specs: Sequence[RequestSpec], config: DriverConfig, headers: Mapping[str, str] | None = None
          ) -> tuple[DriverRun, ProbeTransport]:
    """Run the load (open loop at the specs' own offsets, or closed loop) through a ProbeTransport."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=POOL_KEEPALIVE)
    probe = ProbeTransport([httpx.AsyncHTTPTransport(limits=limits) for _ in range(NUM_POOLS)], headers)
    run = asyncio.run(run_load(specs, config, transport=probe))
    return run, probe
