"""The admission slot in the middleware chain: where tenant limits, priorities, deadlines and
bounded queues plug in (the admission/ package decides; this middleware applies its verdict).

A controller offers `try_acquire(scope) -> permit | ApiError`; a permit's `release(outcome)`
runs when the response ends, whatever happens. Without a controller every request is admitted.
"""

from __future__ import annotations

from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.api_error import ApiError


class Permit(Protocol):
    def release(self, outcome: str) -> None: ...


class AdmissionController(Protocol):
    async def try_acquire(self, scope: Scope) -> Permit | ApiError: ...


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, controller: AdmissionController | None = None) -> None:
        self.app = app
        self.controller = controller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.controller is None or scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        verdict = await self.controller.try_acquire(scope)
        if isinstance(verdict, ApiError):
            await verdict.response()(scope, receive, send)
            return
        status = {"code": 0}

        async def send_recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        outcome = "error"
        try:
            await self.app(scope, receive, send_recording)
            outcome = "success" if status["code"] < 500 else "error"
        finally:
            verdict.release(outcome)
