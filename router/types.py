"""Shared routing types: a configured worker, the request as routed, a worker as a policy sees it, the decision."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from router.load_view import WorkerLoad


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A worker as configured: the model it serves, its KV block size and block count."""

    worker_id: str
    model: str
    block_size: int
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"workers.{self.worker_id}.block_size must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"workers.{self.worker_id}.num_blocks must be >= 1")


@dataclass(slots=True)  # built per request: not frozen (its __init__ would cost ~3x); never changed once built
class RouteRequest:
    """What the gateway knows about a request; the router fills num_prompt_tokens, block_keys,
    home_worker (where its conversation, or a prompt sharing its prefix, was placed last:
    router/placements.py; none for a conversation's first turn) and prefixes_per_worker (how many
    recently placed prefixes and conversations each worker is the home of).

    Exactly one of messages (chat) and prompt (completions: text or token ids) is set.
    headers have lower-case names.
    """

    model: str
    messages: Sequence[Mapping[str, Any]] | None = None
    prompt: str | Sequence[int] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    request_id: str | None = None
    tenant: str | None = None
    priority: str | None = None  # the admitted class: "critical", "standard" or "batch"
    session_id: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    path: str = "/v1/chat/completions"
    num_prompt_tokens: int | None = None
    block_keys: Sequence[int] = ()
    home_worker: str | None = None
    prefixes_per_worker: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("route request needs exactly one of messages and prompt")

    @property
    def starts_session(self) -> bool:
        """The first turn of a conversation: a chat request with a session id and no assistant
        message yet. Its later turns extend its prompt and follow it wherever it is placed."""
        return (self.session_id is not None and self.messages is not None
                and not any(isinstance(m, Mapping) and m.get("role") == "assistant" for m in self.messages))


class WorkerView(NamedTuple):
    """A candidate worker for one request: its live load, how much of the prompt it holds, and
    free_blocks: the KV blocks it can allocate without waiting for a running request to end (its
    capacity less the blocks its running requests hold; None where either is unknown)."""

    worker_id: str
    load: WorkerLoad
    block_size: int
    confirmed_blocks: int = 0
    predicted_blocks: int = 0
    free_blocks: int | None = None

    @property
    def cached_blocks(self) -> int:
        """Best estimate of the cached prefix: max(confirmed, predicted)."""
        return max(self.confirmed_blocks, self.predicted_blocks)


@dataclass(slots=True)  # built per request: not frozen (its __init__ would cost ~3x); never changed once built
class Candidate:
    """One explained candidate: why it ranked where it did."""

    worker_id: str
    cached_blocks: int = 0
    num_requests: int = 0
    predicted_ttft_ms: float | None = None
    note: str | None = None

    def describe(self) -> str:
        parts = [f"{self.worker_id}(cached_blocks={self.cached_blocks}", f"requests={self.num_requests}"]
        if self.predicted_ttft_ms is not None:
            parts.append(f"ttft_ms={self.predicted_ttft_ms:.1f}")
        if self.note:
            parts.append(self.note)
        return " ".join(parts) + ")"


@dataclass(slots=True)  # built per request: not frozen (its __init__ would cost ~3x); never changed once built
class RouteDecision:
    """Ranked worker ids (the gateway tries them in order) and an explanation of the top ones."""

    policy: str
    worker_ids: tuple[str, ...]
    explanation: tuple[Candidate, ...] = ()
    rule: str | None = None
    pool: str | None = None
    num_prompt_tokens: int | None = None
    predicted_cached_tokens: int | None = None
    tokenizer_mode: str | None = None
    held_back: str | None = None  # a warming worker the policy ranked first, held back by slow start

    @property
    def worker_id(self) -> str:
        return self.worker_ids[0]

    def explain(self) -> str:
        """One line for a debug header or log: policy, rule, pool and the top candidates."""
        head = [f"policy={self.policy}"]
        if self.rule is not None:
            head.append(f"rule={self.rule}")
        if self.pool is not None:
            head.append(f"pool={self.pool}")
        if self.num_prompt_tokens is not None:
            head.append(f"prompt_tokens={self.num_prompt_tokens}")
        if self.predicted_cached_tokens is not None:
            head.append(f"predicted_cached_tokens={self.predicted_cached_tokens}")
        if self.tokenizer_mode is not None:
            head.append(f"tokenizer={self.tokenizer_mode}")  # "approximate": byte chunks, no model tokenizer
        if self.held_back is not None:
            head.append(f"slow_start_held_back={self.held_back}")
        candidates = ", ".join(c.describe() for c in self.explanation) or ", ".join(self.worker_ids[:4])
        return " ".join(head) + " candidates=[" + candidates + "]"


class Policy(Protocol):
    """A routing policy: rank the workers for one request. workers is never empty."""

    name: str

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision: ...
