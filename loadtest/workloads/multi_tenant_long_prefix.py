"""Multi-tenant long prefix: T tenants, each with its own long prefix, and short unique queries."""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.text import seeded_text, word_salad
from loadtest.types import RequestSpec


@dataclass(frozen=True, slots=True)
class MultiTenantLongPrefixConfig:
    """Sizes of the multi-tenant workload (tokens approximate); tenants are picked uniformly, or with
    tenant_zipf = s > 0 by a Zipf law (tenant t with weight 1 / (t + 1)^s): a few hot, many cold."""

    num_tenants: int = 4
    num_requests: int = 200
    prefix_tokens: int = 6000
    query_tokens: int = 40
    output_tokens: int = 64
    tenant_zipf: float = 0.0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if name != "tenant_zipf" and getattr(self, name) < 1:
                raise ValueError(f"multi_tenant_long_prefix.{name} must be >= 1")
        if not 0 <= self.tenant_zipf <= 10:
            raise ValueError("multi_tenant_long_prefix.tenant_zipf must be in [0, 10]")


def generate(config: MultiTenantLongPrefixConfig, seed: int) -> list[RequestSpec]:
    """num_requests chat requests: the tenant's prefix as the system message, a fresh query as the user's."""
    rng = random.Random(f"{seed}:multi_tenant_long_prefix")
    prefixes = [seeded_text(f"{seed}:tenant:{t}", config.prefix_tokens) for t in range(config.num_tenants)]
    weights = [1 / (t + 1) ** config.tenant_zipf for t in range(config.num_tenants)]
    specs = []
    for i in range(config.num_requests):
        tenant = rng.choices(range(config.num_tenants), weights)[0] if config.tenant_zipf else rng.randrange(
            config.num_tenants)
        messages = ({"role": "system", "content": prefixes[tenant]},
                    {"role": "user", "content": word_salad(rng, config.query_tokens)})
        specs.append(RequestSpec(index=i, kind="chat", max_tokens=config.output_tokens, messages=messages,
                                 tenant=f"tenant-{tenant}", prefix_group=f"tenant-{tenant}",
                                 prefix_ids=(f"tenant-{tenant}", f"query-{i}")))
    return specs
