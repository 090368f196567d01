"""The workload every configuration gets: tenants of different priorities sending streamed chat requests
with short answers, open loop (Poisson arrivals per tenant, seeded), each prompt a tenant's own system
prompt (shared by its requests, so a KV-aware router has something to keep) and a question of its own."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from loadtest.arrivals import ArrivalProcess
from loadtest.text import seeded_text


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """A tenant (tenants.<name>.priority in kvgate's config) and its share of the offered load."""

    name: str
    priority: str
    share: float

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"tenant {self.name}: share must be in (0, 1]")


DEFAULT_TENANTS = (TenantLoad("crit", "critical", 0.2), TenantLoad("std-a", "standard", 0.4),
                   TenantLoad("std-b", "standard", 0.4))


@dataclass(frozen=True, slots=True)
class RequestShape:
    """A chat request: one of its tenant's prefixes_per_tenant system prompts (system_tokens each: a
    tenant's documents or agents, each shared by its requests), a question of question_tokens, max_tokens
    of answer."""

    prefixes_per_tenant: int = 4
    system_tokens: int = 160
    question_tokens: int = 32
    max_tokens: int = 8


@dataclass(frozen=True, slots=True)
class Arrival:
    """One call to make: when (seconds since the load started), for whom, what."""

    index: int
    tenant: str
    offset_s: float
    messages: tuple[dict[str, str], ...]


@functools.lru_cache(maxsize=16)
def _system_prompt(prefix: str, tokens: int) -> str:
    return seeded_text(f"cascade-system-{prefix}", tokens)


def messages_for(tenant: str, index: int, shape: RequestShape) -> tuple[dict[str, str], ...]:
    prefix = f"{tenant}-{index % shape.prefixes_per_tenant}"
    return ({"role": "system", "content": _system_prompt(prefix, shape.system_tokens)},
            {"role": "user", "content": f"question {index}: {seeded_text(f'cascade-q-{index}', shape.question_tokens)}"})


def build_arrivals(tenants: Sequence[TenantLoad], rate_rps: float, duration_s: float, shape: RequestShape,
                   seed: int = 0) -> list[Arrival]:
    """Each tenant's Poisson arrivals at its share of rate_rps over duration_s (seeded per tenant), merged
    in time order and numbered."""
    if rate_rps <= 0 or duration_s <= 0:
        raise ValueError("rate_rps and duration_s must be > 0")
    timed: list[tuple[float, str]] = []
    for position, tenant in enumerate(tenants):
        rate = rate_rps * tenant.share
        count = int(rate * duration_s * 1.5) + 10  # enough to pass duration_s
        offsets = ArrivalProcess(rate).offsets_s(count, seed=seed * 1000 + position)
        timed.extend((t, tenant.name) for t in offsets if t < duration_s)
    return [Arrival(i, tenant, t, messages_for(tenant, i, shape)) for i, (t, tenant) in enumerate(sorted(timed))]
