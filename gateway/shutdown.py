"""A graceful stop (SIGTERM, SIGINT): the server stops accepting connections and closes idle ones at
once, requests in flight get `gateway.shutdown_grace_s` to finish, and one the server cancels after
that ends with a clear error, not a cut connection: a 503 `gateway_shutdown` (Retry-After: another
replica can serve it), or for a stream already under way that error as its last event and [DONE].
Shutdown says it has begun: the server (gateway/server.py) begins it before it stops, so the completion
endpoints (gateway/proxy.py) tell its cancellation from any other."""

from __future__ import annotations

from kvgate.api_error import ApiError


class Shutdown:
    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started = False

    def begin(self) -> None:
        self.started = True


def shutdown_error() -> ApiError:
    return ApiError(503, "the gateway is shutting down and its grace for requests in flight ran out: retry the "
                         "request", "service_unavailable", code="gateway_shutdown", retry_after_s=1)
