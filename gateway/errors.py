"""Upstream errors: what can go wrong in an attempt at a worker, translated from httpx in one place.
(Errors for the client are kvgate.api_error.ApiError, shared with the worker.)"""

from __future__ import annotations

from types import TracebackType

import httpx


class UpstreamError(Exception):
    """An attempt at a worker failed before its answer began (or broke off after).

    kind: connect | first_byte_timeout | idle_timeout | status | stream_error | protocol. A status
    error is the worker's own answer: 5xx is the worker failing (try another; its breaker counts it),
    429 is back-pressure (try another; no fault of the worker's health, its cache stays indexed),
    any other 4xx is the request's fault (the client gets it as is; the worker is healthy).
    """

    def __init__(self, kind: str, message: str, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.body = body

    @property
    def retryable(self) -> bool:
        """Another worker may take the request (nothing of the answer reached the client)."""
        return self.kind != "status" or self.status == 429 or (self.status or 0) >= 500

    @property
    def worker_healthy(self) -> bool | None:
        """What the attempt says of the worker, for its breaker: False (it failed), True (it answered
        the request's own fault), None (back-pressure: nothing to judge it by)."""
        if self.kind != "status" or (self.status or 0) >= 500:
            return False
        return None if self.status == 429 else True


class map_upstream_errors:  # noqa: N801 - used as a function, like contextlib.suppress
    """`with map_upstream_errors(phase): ...` translates httpx exceptions into UpstreamError; phase
    names what we were waiting for. (A class rather than a generator: it is entered on every request.)"""

    __slots__ = ("phase",)

    def __init__(self, phase: str = "request") -> None:
        self.phase = phase

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc is None or not isinstance(exc, httpx.HTTPError):
            return False
        error = upstream_error(exc, self.phase)
        if error is None:
            return False
        raise error from exc


def upstream_error(exc: httpx.HTTPError, phase: str) -> UpstreamError | None:
    """exc as an UpstreamError (None: not an upstream failure), as map_upstream_errors raises it; for a
    loop that reads every token, where `except httpx.HTTPError` costs nothing until one is raised."""
    if isinstance(exc, httpx.ConnectError):
        return UpstreamError("connect", f"cannot connect: {exc}")
    if isinstance(exc, httpx.ConnectTimeout):
        return UpstreamError("connect", "connect timed out")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError("first_byte_timeout" if phase == "headers" else "idle_timeout",
                             f"timed out waiting for {phase}")
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.NetworkError)):
        return UpstreamError("protocol", f"connection lost during {phase}: {exc!r}")
    return None
