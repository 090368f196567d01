"""What a client saw of one logical call (all of the openai SDK's attempts at it together), as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One logical call: times in seconds since the load started (ttft_ms from the call's start, retries
    included); attempts is how many HTTP requests the SDK sent for it (1 + its retries); error None for a
    success, else a class (`http_503`, `connection`, `timeout`, `stream_error`, `no_tokens`); worker and
    pool from x-kvgate-worker / x-kvgate-pool (None from routers that send neither); model is the one
    the answer names."""

    index: int
    tenant: str
    scheduled_s: float
    start_s: float
    end_s: float
    attempts: int
    error: str | None = None
    status: int | None = None
    ttft_ms: float | None = None
    worker: str | None = None
    pool: str | None = None
    model: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def retries(self) -> int:
        return max(0, self.attempts - 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CallRecord":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
