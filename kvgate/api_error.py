"""The OpenAI-style API error that the gateway and the worker return: `{"error": {message, type, param, code}}`."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error for the client: HTTP status, OpenAI error type, message, the param at fault, a code,
    and for overload answers how long to wait (retry_after_s, sent as Retry-After)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", *,
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        """The error as a JSON response; headers are added (e.g. WWW-Authenticate, a 405's Allow)."""
        extra = dict(headers or {})
        if self.retry_after_s is not None:
            extra["retry-after"] = str(self.retry_after_s)
        return JSONResponse(self.body(), status_code=self.status, headers=extra)
