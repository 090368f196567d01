"""The admission sections: tenants (`tenants.<name>`), each pool's admission and prices
(`pools.<name>.admission`, `pools.<name>.prices`). docs/admission.md explains every knob;
a tenant's cache_isolation is routing's (docs/architecture.md, "Cache isolation")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvgate.config.checks import check_positive
from kvgate.config.loader import ConfigError

PriorityName = Literal["critical", "standard", "batch"]


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """A tenant's class (the most urgent its requests get; a client may only lower it), its fair
    share within that class, and optional limits (429 beyond them)."""

    priority: PriorityName = "standard"
    weight: float = 1.0
    requests_per_s: float | None = None
    requests_burst: float | None = None  # default: one second's worth (at least 1)
    tokens_per_min: float | None = None  # prompt + completion (reserved from max_tokens, settled on usage)
    tokens_burst: float | None = None  # default: one minute's worth
    max_concurrency: int | None = None  # requests in flight (per gateway replica: max / redis.replicas)
    deadline_ms: float | None = None  # when the client sends no x-request-deadline-ms
    cache_isolation: bool | str = False  # true (or a salt shared by tenants who may share): keys of its own
    fallbacks: bool | tuple[str, ...] = True  # may its requests move to a rule's fallback pools (or only these)?

    def __post_init__(self) -> None:
        for name in ("weight", "requests_per_s", "requests_burst", "tokens_per_min", "tokens_burst",
                     "max_concurrency", "deadline_ms"):
            check_positive(getattr(self, name), name)
        if not isinstance(self.cache_isolation, (bool, str)) or self.cache_isolation == "":
            raise ConfigError("cache_isolation", "must be true, false or a non-empty salt string")

    def cache_salt(self, tenant: str) -> str | None:
        """The salt of this tenant's block keys: None (shared with everyone), the tenant's name
        (cache_isolation: true) or the string given (tenants with the same string share)."""
        if self.cache_isolation is False:
            return None
        return tenant if self.cache_isolation is True else self.cache_isolation


@dataclass(frozen=True, slots=True)
class PoolAdmissionConfig:
    """A pool's adaptive concurrency limit and the bounded queue in front of it."""

    max_concurrency: int | None = None  # the limit's ceiling; default: what the pool's workers run
    min_concurrency: int = 1
    initial_concurrency: int | None = None  # default: a quarter of max_concurrency
    queue_delay_target_s: float = 0.5  # time at a worker beyond a request's own prefill that means congestion
    queue_size: int = 256
    queue_target_s: float = 0.1  # the wait allowed standard/batch once the queue is standing
    queue_interval_s: float = 0.5  # a queue not empty for this long is standing
    max_queue_wait_s: float = 5.0  # the wait allowed critical requests; nobody waits longer
    default_completion_tokens: int = 256  # reserved against tokens_per_min when max_tokens is absent

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "min_concurrency", "initial_concurrency", "queue_delay_target_s",
                     "queue_size", "queue_target_s", "queue_interval_s", "max_queue_wait_s",
                     "default_completion_tokens"):
            check_positive(getattr(self, name), name)
        if self.max_concurrency is not None and self.min_concurrency > self.max_concurrency:
            raise ConfigError("min_concurrency", "must be <= max_concurrency")
        if self.queue_target_s > self.max_queue_wait_s:
            raise ConfigError("queue_target_s", "must be <= max_queue_wait_s")


@dataclass(frozen=True, slots=True)
class PricesConfig:
    """What a pool's tokens cost, in USD per million; cached prompt tokens at their own price."""

    prompt_per_1m: float = 0.0
    cached_per_1m: float = 0.0
    completion_per_1m: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prompt_per_1m", "cached_per_1m", "completion_per_1m"):
            if getattr(self, name) < 0:
                raise ConfigError(name, "must be >= 0")
