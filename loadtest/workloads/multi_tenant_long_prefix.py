"""Multi-tenant long prefix: T tenants, each with its own long prefix, and short unique queries."""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.text import seeded_text, word_salad
from loadtest.types import RequestSpec


@dataclass(frozen=True, slots=True)
class MultiTenantLongPrefixConfig:
    """Sizes of the multi-tenant workload; tenants are picked uniformly (tokens approximate)."""

    num_tenants: int = 4
    num_requests: int = 200
    prefix_tokens: int = 6000
    query_tokens: int = 40
    output_tokens: int = 64

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"multi_tenant_long_prefix.{name} must be >= 1")


def generate(config: MultiTenantLongPrefixConfig, seed: int) -> list[RequestSpec]:
    """num_requests chat requests: the tenant's prefix as the system message, a fresh query as the user's."""
    rng = random.Random(f"{seed}:multi_tenant_long_prefix")
    prefixes = [seeded_text(f"{seed}:tenant:{t}", config.prefix_tokens) for t in range(config.num_tenants)]
    specs = []
    for i in range(config.num_requests):
        tenant = rng.randrange(config.num_tenants)
        messages = ({"role": "system", "content": prefixes[tenant]},
                    {"role": "user", "content": word_salad(rng, config.query_tokens)})
        specs.append(RequestSpec(index=i, kind="chat", max_tokens=config.output_tokens, messages=messages,
                                 tenant=f"tenant-{tenant}", prefix_group=f"tenant-{tenant}",
                                 prefix_ids=(f"tenant-{tenant}", f"query-{i}")))
    return specs
