"""The kvgate YAML schema: one frozen dataclass per section; every default lives here.

configs/example.yaml shows each section with comments; configs/local.yaml is the embedded
default that `make run` starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlparse

from kvgate.config.admission import PoolAdmissionConfig, PricesConfig, TenantConfig
from kvgate.config.checks import (NAME, SHA256_HEX, check_http_url, check_origin, check_positive,
                                  check_zmq_endpoint)
from kvgate.config.loader import ConfigError
from kvgate.kv_endpoints import REPLAY_PORT_OFFSET, replay_port

@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where the gateway listens, over HTTPS when tls_certfile names its certificate chain (PEM; its key
    in tls_keyfile, or in the same file); which web pages' origins may call it from a browser
    (cors_allowed_origins, e.g. https://app.example.com, or "*" for any; none: CORS off); and how long
    requests in flight may take to finish once it is told to stop (gateway/shutdown.py)."""

    host: str = "127.0.0.1"
    port: int = 8000
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    cors_allowed_origins: tuple[str, ...] = ()
    shutdown_grace_s: float = 30.0

    @property
    def scheme(self) -> str:
        return "https" if self.tls_certfile else "http"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", "must be in 0..65535")
        if self.tls_keyfile and not self.tls_certfile:
            raise ConfigError("tls_keyfile", "needs tls_certfile (the certificate chain it is the key of)")
        if not 0 <= self.shutdown_grace_s <= 3600:
            raise ConfigError("shutdown_grace_s", "must be in 0..3600")
        for i, origin in enumerate(self.cors_allowed_origins):
            check_origin(origin, f"cors_allowed_origins[{i}]")


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Request size limits enforced before a request is parsed, and the size from which a request's
    parsing, tokenizing and encoding run off the event loop (kvgate/offload.py)."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_header_count: int = 100
    max_header_bytes: int = 16 * 1024
    offload_min_bytes: int = 8 * 1024

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_header_count", "max_header_bytes", "offload_min_bytes"):
            check_positive(getattr(self, name), name)


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Timeouts and retries for calls from the gateway to workers."""

    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    total_timeout_s: float = 600.0
    max_retries: int = 2
    retry_budget_ratio: float = 0.1
    retry_budget_min_per_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s", "total_timeout_s"):
            check_positive(getattr(self, name), name)
        if not 0 <= self.max_retries <= 5:
            raise ConfigError("max_retries", "must be in 0..5")
        if not 0 < self.retry_budget_ratio <= 1:
            raise ConfigError("retry_budget_ratio", "must be in (0, 1]")
        if self.retry_budget_min_per_s < 0:
            raise ConfigError("retry_budget_min_per_s", "must be >= 0")


@dataclass(frozen=True, slots=True)
class ApiKeyConfig:
    """A tenant's API key, stored only as the SHA-256 hex digest (`kvgate keys create` prints it)."""

    tenant: str
    sha256: str

    def __post_init__(self) -> None:
        if not NAME.match(self.tenant):
            raise ConfigError("tenant", "must be letters, digits, '.', '_' or '-'")
        if not SHA256_HEX.match(self.sha256):
            raise ConfigError("sha256", "must be 64 lowercase hex characters")


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """API keys -> tenants. dev_key_env names an env var whose key maps to dev_tenant; the dev key is
    accepted only while no `keys` are configured, unless dev_key says otherwise (true: also beside
    them, for development; false: never)."""

    keys: tuple[ApiKeyConfig, ...] = ()
    dev_key_env: str | None = "KVGATE_API_KEY"
    dev_tenant: str = "dev"
    dev_key: bool | None = None

    @property
    def dev_key_enabled(self) -> bool:
        if self.dev_key_env is None:
            return False
        return not self.keys if self.dev_key is None else self.dev_key


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Shared state for gateway replicas; url None means in-memory (one replica). replicas: how many
    gateways share it (while Redis is unreachable each enforces 1/replicas of a tenant's limits).
    With a url, the gateway also follows the worker registry there (workers that register with
    `kvgate worker --register` or `kvgate register`), reading it every registry_poll_interval_s."""

    url: str | None = None
    replicas: int = 1
    registry_poll_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.url is not None and urlparse(self.url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError("url", "not a redis:// URL")
        check_positive(self.replicas, "replicas")
        check_positive(self.registry_poll_interval_s, "registry_poll_interval_s")


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry traces (kvgate/tracing.py), for the gateway and the workers `kvgate up` starts.
    exporter: none | console | otlp (OTLP over HTTP/protobuf to endpoint, a collector's base URL such
    as http://collector:4318); sample_ratio: the share of new traces kept (a caller's sampled
    traceparent is always followed). A setting left out falls back to the standard OTEL_* variables
    (OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT, OTEL_TRACES_SAMPLER[_ARG]); with
    neither, tracing is off and costs nothing."""

    exporter: Literal["none", "console", "otlp"] | None = None
    endpoint: str | None = None
    sample_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.endpoint is not None:
            check_http_url(self.endpoint)
        if self.sample_ratio is not None and not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError("sample_ratio", "must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """Request log lines (kvgate/request_log.py): requests writes one JSON line per request at the
    gateway and at the workers `kvgate up` starts; prompt_token_ids adds the prompt's token ids to
    each line (for debugging a tokenizer mismatch; off by default; text is never logged)."""

    requests: bool = True
    prompt_token_ids: bool = False


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """How `kvgate up` starts this worker on the local machine (omit for remote workers)."""

    model: str = "default"
    executor: Literal["torch", "sim"] = "torch"
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    served_model_name: str | None = None
    sim_timing: str | None = None  # executor sim: "key=value,..." (docs/sim-calibration.md)
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            check_positive(getattr(self, name), name)

    @property
    def max_model_len_bound(self) -> int | None:
        """The most prompt tokens the launched worker can take, when this section says: it holds
        at most num_blocks * block_size tokens, and no more than a --max-model-len in extra_args.
        None when neither is given (the worker reads it from its model)."""
        bounds = [self.num_blocks * self.block_size] if self.num_blocks is not None else []
        flag = _flag_value(self.extra_args, "--max-model-len")
        if flag is not None and flag.isdigit() and int(flag) > 0:
            bounds.append(int(flag))
        return min(bounds, default=None)


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value of `flag VALUE` or `flag=VALUE` in a command line; the last one wins, as in argparse."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One inference worker: where to send requests and where it publishes KV events."""

    name: str
    url: str
    kv_events_endpoint: str | None = None
    block_size: int | None = None  # None: launch.block_size, else asked from the worker's /v1/models
    num_blocks: int | None = None  # caps the router's index for this worker
    launch: LaunchConfig | None = None

    def __post_init__(self) -> None:
        if not NAME.match(self.name):
            raise ConfigError("name", "must be letters, digits, '.', '_' or '-'")
        check_http_url(self.url)
        check_positive(self.block_size, "block_size")
        check_positive(self.num_blocks, "num_blocks")
        if self.kv_events_endpoint is not None:
            check_zmq_endpoint(self.kv_events_endpoint, "kv_events_endpoint")
            self._check_kv_events_port()
        if self.launch is not None:
            host = urlparse(self.url).hostname
            if host not in ("127.0.0.1", "localhost", "::1") or urlparse(self.url).port is None:
                raise ConfigError("launch", "only workers at http://127.0.0.1:PORT can be launched")

    def _check_kv_events_port(self) -> None:
        """The replay socket needs PORT + 1: a launched worker needs tcp://, and PORT + 1 must exist."""
        kv_port = self.kv_events_port
        if kv_port is None and self.launch is not None:
            raise ConfigError("kv_events_endpoint", "a launched worker needs tcp://HOST:PORT "
                              f"(it binds its replay socket on PORT + {REPLAY_PORT_OFFSET})")
        if kv_port is not None and replay_port(kv_port) > 65535:
            raise ConfigError("kv_events_endpoint", f"port {kv_port} leaves no port for the replay socket "
                              f"(PORT + {REPLAY_PORT_OFFSET})")

    @property
    def port(self) -> int | None:
        return urlparse(self.url).port

    @property
    def kv_events_port(self) -> int | None:
        """The port of a tcp:// KV-event endpoint; None for ipc:// or no endpoint."""
        if self.kv_events_endpoint is None or urlparse(self.kv_events_endpoint).scheme != "tcp":
            return None
        return urlparse(self.kv_events_endpoint).port

    def bound_ports(self) -> list[tuple[int, str, str]]:
        """(port, YAML key, note) for each socket this worker binds when launched: HTTP, KV events, replay."""
        ports = [] if self.port is None else [(self.port, "url", "")]
        if self.kv_events_port is not None:
            ports.append((self.kv_events_port, "kv_events_endpoint", ""))
            ports.append((replay_port(self.kv_events_port), "kv_events_endpoint",
                          f" (replay socket, PORT + {REPLAY_PORT_OFFSET})"))
        return ports


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Active health checks: GET /health (and /metrics for load) on every worker at an interval."""

    interval_s: float = 2.0
    timeout_s: float = 2.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    scrape_metrics: bool = True

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s", "unhealthy_threshold", "healthy_threshold"):
            check_positive(getattr(self, name), name)


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Per-worker circuit breaker: opens after fail_max consecutive failures, trial after reset_timeout_s."""

    fail_max: int = 5
    reset_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check_positive(self.fail_max, "fail_max")
        check_positive(self.reset_timeout_s, "reset_timeout_s")


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """Slow-worker ejection on time to first token against the router's expectation (see gateway/outliers.py)."""

    enabled: bool = True
    min_samples: int = 10
    ratio: float = 3.0
    base_latency_s: float = 0.25
    ejection_s: float = 30.0
    max_ejected_fraction: float = 0.5
    ewma_alpha: float = 0.2

    def __post_init__(self) -> None:
        for name in ("min_samples", "ratio", "base_latency_s", "ejection_s"):
            check_positive(getattr(self, name), name)
        if not 0 <= self.max_ejected_fraction <= 1:
            raise ConfigError("max_ejected_fraction", "must be in [0, 1]")
        if not 0 < self.ewma_alpha <= 1:
            raise ConfigError("ewma_alpha", "must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """policies_file: YAML routing rules (configs/policies/; reloaded on SIGHUP and when the file
    changes, checked every policies_watch_interval_s); None routes each pool by its own policy."""

    policies_file: str | None = None
    policies_watch_interval_s: float = 1.0
    debug_header: bool = False  # x-kvgate-route for every tenant
    debug_header_tenants: tuple[str, ...] = ()  # ... or only for these

    def __post_init__(self) -> None:
        check_positive(self.policies_watch_interval_s, "policies_watch_interval_s")
        for i, tenant in enumerate(self.debug_header_tenants):
            if not NAME.match(tenant):
                raise ConfigError(f"debug_header_tenants[{i}]", "must be letters, digits, '.', '_' or '-'")

    def debug_header_for(self, tenant: str | None) -> bool:
        """Whether responses to tenant carry x-kvgate-route. Off unless asked for: it says how
        much of a prompt the router believes cached, which tells a tenant about other tenants'
        prompts, so keep it to operators' tenants (debug_header_tenants)."""
        return self.debug_header or tenant in self.debug_header_tenants


FallbackReason = Literal["overloaded", "unavailable", "context_length_exceeded"]
FALLBACK_REASONS: tuple[FallbackReason, ...] = ("overloaded", "unavailable", "context_length_exceeded")


@dataclass(frozen=True, slots=True)
class FallbackConfig:
    """A pool a rule's requests may move to, and when (docs/fallbacks.md): the rule's pool would refuse the
    request at arrival (overloaded), has no healthy worker or failed every attempt before a first token
    (unavailable), or takes no prompt that long (context_length_exceeded)."""

    pool: str
    when: tuple[FallbackReason, ...] = ("unavailable",)

    def __post_init__(self) -> None:
        if not self.pool:
            raise ConfigError("pool", "must be a non-empty string")
        if not self.when:
            raise ConfigError("when", f"must list at least one of {', '.join(FALLBACK_REASONS)}")
        if len(set(self.when)) != len(self.when):
            raise ConfigError("when", "lists a reason twice")


def check_fallbacks(pool: str, fallbacks: tuple[FallbackConfig, ...], key: str = "fallbacks") -> None:
    """ConfigError unless each fallback pool is another pool than the rule's own, each named once."""
    seen = {pool}
    for i, fallback in enumerate(fallbacks):
        if fallback.pool in seen:
            what = "the rule's own pool" if fallback.pool == pool else "already listed"
            raise ConfigError(f"{key}[{i}].pool", f"{fallback.pool!r} is {what}")
        seen.add(fallback.pool)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """A routing policy: a type name and its parameters (the router checks both when the gateway
    builds its rules: gateway/routing_config.py)."""

    type: str = "kv_aware"
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Workers serving one model, and how to route among them."""

    model: str
    workers: tuple[WorkerConfig, ...]
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tokenizer: str | None = None
    admission: PoolAdmissionConfig = field(default_factory=PoolAdmissionConfig)
    prices: PricesConfig = field(default_factory=PricesConfig)
    max_model_len: int | None = None  # the most prompt tokens routed here; default: see prompt_token_limit
    fallbacks: tuple[FallbackConfig, ...] = ()  # where this pool's requests may move (without a policies file)
    slow_start_s: float = 30.0  # a worker that comes into rotation cold ramps to its full share over this; 0: off

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model", "must be a non-empty string")
        check_positive(self.max_model_len, "max_model_len")
        if self.slow_start_s < 0:
            raise ConfigError("slow_start_s", "must be >= 0 (0 turns slow start off)")

    def prompt_token_limit(self) -> int | None:
        """The longest prompt (in tokens) the router lets into this pool: max_model_len, else the
        largest any worker's launch section allows when every worker has one that says (see
        LaunchConfig.max_model_len_bound), else None (no limit before the workers' own; so too for
        a pool whose workers register themselves)."""
        if self.max_model_len is not None:
            return self.max_model_len
        if not self.workers:
            return None
        bounds = [w.launch.max_model_len_bound if w.launch else None for w in self.workers]
        return None if None in bounds else max(bounds)  # type: ignore[type-var]


@dataclass(frozen=True, slots=True)
class KvgateConfig:
    """The whole file: the gateway's server, limits, upstream, auth, redis, routing, health, pools,
    tenants, tracing and request logs."""

    pools: dict[str, PoolConfig]
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    gateway: ServerConfig = field(default_factory=ServerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    outliers: OutlierConfig = field(default_factory=OutlierConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        if not self.pools:
            raise ConfigError("pools", "at least one pool is required")
        for pool_name in self.pools:
            if not NAME.match(pool_name):
                raise ConfigError(f"pools.{pool_name}", "pool names must be letters, digits, '.', '_' or '-'")
        for pool_name, pool in self.pools.items():
            if not pool.workers and self.redis.url is None:
                raise ConfigError(f"pools.{pool_name}.workers", "at least one worker is required (or set "
                                  "redis.url, for a pool whose workers register themselves)")
        self._check_unique_names()
        self._check_unique_ports()
        self._check_tenants()
        self._check_fallbacks()

    def _workers_at(self) -> list[tuple[str, WorkerConfig]]:
        """(YAML path, worker) for every worker, in file order."""
        return [(f"pools.{pool_name}.workers[{i}]", worker)
                for pool_name, pool in self.pools.items() for i, worker in enumerate(pool.workers)]

    def _check_unique_names(self) -> None:
        names: dict[str, str] = {}
        for where, worker in self._workers_at():
            if worker.name in names:
                raise ConfigError(f"{where}.name", f"worker name {worker.name!r} also used at {names[worker.name]}")
            names[worker.name] = where

    def _check_unique_ports(self) -> None:
        """One socket per port among the gateway and the launched workers' HTTP, KV-event and replay ports.

        They all bind on this machine, so a port clashes whichever local host (127.0.0.1, localhost,
        0.0.0.0, *) each endpoint names.
        """
        users = {self.gateway.port: "gateway.port"}
        for where, worker in self._workers_at():
            if worker.launch is None:
                continue
            for port, key, note in worker.bound_ports():
                if port in users:
                    raise ConfigError(f"{where}.{key}", f"port {port}{note} is already used by {users[port]}")
                users[port] = f"{where}.{key}{note}"

    def _check_fallbacks(self) -> None:
        """Pools' fallbacks and tenants' fallback lists name pools that exist."""
        for pool_name, pool in self.pools.items():
            check_fallbacks(pool_name, pool.fallbacks, f"pools.{pool_name}.fallbacks")
            for i, fallback in enumerate(pool.fallbacks):
                if fallback.pool not in self.pools:
                    raise ConfigError(f"pools.{pool_name}.fallbacks[{i}].pool", f"unknown pool {fallback.pool!r}")
        for name, tenant in self.tenants.items():
            if isinstance(tenant.fallbacks, tuple):
                for i, pool_name in enumerate(tenant.fallbacks):
                    if pool_name not in self.pools:
                        raise ConfigError(f"tenants.{name}.fallbacks[{i}]", f"unknown pool {pool_name!r}")

    def _check_tenants(self) -> None:
        """Tenant names are names; once tenants are listed, every configured key names one of them."""
        for name in self.tenants:
            if not NAME.match(name):
                raise ConfigError(f"tenants.{name}", "tenant names must be letters, digits, '.', '_' or '-'")
        if not self.tenants:
            return
        for i, key in enumerate(self.auth.keys):
            if key.tenant not in self.tenants:
                raise ConfigError(f"auth.keys[{i}].tenant",
                                  f"unknown tenant {key.tenant!r} (tenants: {', '.join(self.tenants)})")
        known = {*self.tenants, self.auth.dev_tenant}
        for i, tenant in enumerate(self.routing.debug_header_tenants):
            if tenant not in known:
                raise ConfigError(f"routing.debug_header_tenants[{i}]",
                                  f"unknown tenant {tenant!r} (tenants: {', '.join(sorted(known))})")

    def cache_salts(self) -> dict[str, str]:
        """tenant -> cache salt, for the tenants with cache_isolation (TenantConfig.cache_salt)."""
        salts = {name: tenant.cache_salt(name) for name, tenant in self.tenants.items()}
        return {name: salt for name, salt in salts.items() if salt is not None}

    def launched_workers(self) -> list[WorkerConfig]:
        return [w for pool in self.pools.values() for w in pool.workers if w.launch is not None]
