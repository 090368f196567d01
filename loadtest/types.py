"""Shared records of the load-test suite: what to send (RequestSpec) and what happened (RequestRecord)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Kind = Literal["chat", "completion"]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload; arrival_offset_s None means "when the driver decides" (closed loop or rate).

    prefix_group names the shared prefix the request was built on (system prompt, tenant, session),
    prefix_ids lists the ids of the text segments the prompt starts with, in order (for the oracle
    and for reading results; equal ids mean equal text).
    """

    index: int
    kind: Kind
    max_tokens: int
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None
    arrival_offset_s: float | None = None
    session_id: str | None = None
    tenant: str | None = None
    prefix_group: str | None = None
    prefix_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("chat", "completion"):
            raise ValueError(f"kind must be 'chat' or 'completion', got {self.kind!r}")
        if (self.kind == "chat") != (self.messages is not None) or (self.kind == "completion") != (self.prompt is not None):
            raise ValueError("a chat request needs messages (and no prompt); a completion needs a prompt")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.arrival_offset_s is not None and self.arrival_offset_s < 0:
            raise ValueError("arrival_offset_s must be >= 0")

    def prompt_text(self) -> str:
        """The prompt as one text: a completion's prompt, or each message as `role: content` lines."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.messages or ())

    def body(self, model: str) -> dict[str, Any]:
        """The OpenAI request body (streaming, with usage in the last chunk)."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.kind == "chat":
            body["messages"] = [dict(m) for m in self.messages or ()]
        else:
            body["prompt"] = self.prompt
        return body

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the client saw for one request; times in ms, start/end in seconds since the run started.

    error is None for a success, else a class such as `http_503`, `ConnectError`, `stream_error`,
    `incomplete_stream` or `cancelled`. status is None when no HTTP response arrived.
    """

    index: int
    scheduled_s: float
    start_s: float
    end_s: float
    status: int | None
    error: str | None = None
    ttft_ms: float | None = None
    itl_ms: tuple[float, ...] = ()
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    session_id: str | None = None
    tenant: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.end_s < self.start_s:
            raise ValueError("end_s must be >= start_s")

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_ms(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1); None with fewer than two output tokens."""
        if self.ttft_ms is None or self.e2e_ms is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["itl_ms"] = list(self.itl_ms)
        data["tpot_ms"] = self.tpot_ms
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RequestRecord":
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["itl_ms"] = tuple(fields.get("itl_ms") or ())
        return cls(**fields)
