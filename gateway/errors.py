"""Upstream errors: what can go wrong in an attempt at a worker, translated from httpx in one place.
(Errors for the client are kvgate.api_error.ApiError, shared with the worker.)"""

from __future__ import annotations

import contextlib
from typing import Iterator

import httpx


class UpstreamError(Exception):
    """An attempt at a worker failed. retryable: safe to try another worker (nothing was sent)."""

    def __init__(self, kind: str, message: str, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(message)
        self.kind = kind  # connect | timeout | first_byte_timeout | idle_timeout | status | protocol
        self.status = status
        self.body = body

    @property
    def retryable(self) -> bool:
        return self.kind != "status" or self.status in RETRYABLE_STATUSES


RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


@contextlib.contextmanager
def map_upstream_errors(phase: str = "request") -> Iterator[None]:
    """Translate httpx exceptions into UpstreamError; phase names what we were waiting for."""
    try:
        yield
    except httpx.ConnectError as exc:
        raise UpstreamError("connect", f"cannot connect: {exc}") from exc
    except httpx.ConnectTimeout as exc:
        raise UpstreamError("connect", "connect timed out") from exc
    except httpx.TimeoutException as exc:
        raise UpstreamError("first_byte_timeout" if phase == "headers" else "idle_timeout",
                            f"timed out waiting for {phase}") from exc
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.NetworkError) as exc:
        raise UpstreamError("protocol", f"connection lost during {phase}: {exc!r}") from exc
