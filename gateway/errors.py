"""OpenAI-style error bodies, and the one place where upstream (httpx) failures are translated."""

from __future__ import annotations

import contextlib
import json
from typing import Iterator

import httpx
from starlette.responses import Response


class GatewayError(Exception):
    """An error for the client: status, OpenAI error type and message, optional Retry-After."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> Response:
        extra = dict(headers or {})
        if self.retry_after_s is not None:
            extra["retry-after"] = str(self.retry_after_s)
        return Response(json.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=extra)


def error_response(status: int, message: str, type_: str = "invalid_request_error", **kwargs) -> Response:
    return GatewayError(status, message, type_, **kwargs).response()


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
