"""The `kvgate` command: argument parsing for every subcommand, and dispatch to the part that runs it.

Each part (gateway, worker, bench) is imported only when its subcommand runs, so `kvgate --help`
is fast and the gateway never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, Sequence
from urllib.parse import urlparse

from kvgate.config import ApiKeyConfig, ConfigError, load_config
from kvgate.tracing import TracingSettingError, resolve_settings


class UsageError(Exception):
    """A problem the user can fix; printed as `kvgate: ...` with exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="KV-cache-aware LLM gateway with bundled paged-attention workers.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_up(sub)
    _add_gateway(sub)
    _add_worker(sub)
    _add_register(sub)
    _add_keys(sub)
    _add_bench(sub)
    return parser


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start the configured workers and the gateway on this machine",
                       description="Start every worker that has a `launch` section, then the gateway; "
                       "wait for health, print the URL and a development API key, stop all on Ctrl-C. "
                       "A worker that dies is restarted (after 1 s, doubling up to 30 s; the stack stops "
                       "after 5 restarts in a row that never get healthy); a gateway that dies stops the "
                       "stack. SIGHUP makes the gateway reload routing.policies_file.")
    p.add_argument("--config", required=True, type=Path, help="kvgate YAML config (e.g. configs/local.yaml)")
    p.add_argument("--port", type=_port, help="gateway port (overrides gateway.port)")
    p.add_argument("--health-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long to wait for each child's /health, at start and after a restart "
                   "(default: 600)")
    p.set_defaults(handler=_run_up)


def _add_gateway(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="run the gateway (OpenAI-compatible proxy)",
                       description="Serve the OpenAI API in front of the pools in the config.")
    p.add_argument("--config", required=True, type=Path, help="kvgate YAML config")
    p.add_argument("--host", help="listen address (overrides gateway.host)")
    p.add_argument("--port", type=_port, help="listen port (overrides gateway.port)")
    p.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                   help="gateway processes sharing the port (SO_REUSEPORT), each a full gateway, supervised by "
                   "this one: restarted when one dies, SIGHUP and SIGTERM passed on; /metrics merges every "
                   "process's series, labelled gateway_process. N > 1 needs redis.url, so that tenant limits "
                   "are shared, not N times over (default: 1, this process serves)")
    # set by a --workers N parent on each of its processes
    p.add_argument("--process-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    p.set_defaults(handler=_run_gateway)


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run an inference worker (OpenAI API + KV events)",
                       description="Serve a model with the bundled paged-attention engine.")
    p.add_argument("--model", required=True, help="local HF model folder, or `default` (SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    p.add_argument("--port", required=True, type=_port, help="listen port")
    p.add_argument("--executor", choices=("torch", "sim"), default="torch",
                   help="torch: real model math; sim: calibrated timing model (default: torch)")
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--num-blocks", type=_positive_int, help="KV blocks to allocate (default: from memory)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=64, help="max running sequences (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, help="token budget per step")
    p.add_argument("--kv-events-endpoint", metavar="PORT|tcp://HOST:PORT",
                   help="publish KV events here (ZMQ PUB; replay socket on PORT+1); a bare PORT binds 127.0.0.1; "
                        "any other host exposes every prompt's token ids to whoever can reach it")
    p.add_argument("--timeout-keep-alive", dest="timeout_keep_alive_s", type=float, metavar="SECONDS",
                   help="close idle keep-alive connections after this long (default: 15; keep it above the "
                        "gateway's idle pool expiry)")
    p.add_argument("--shutdown-grace", dest="shutdown_grace_s", type=float, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may take to finish before they are cut (a "
                        "gateway continues a cut stream on another worker; default: 25)")
    p.add_argument("--served-model-name", metavar="NAME", help="model name clients use (default: from the model)")
    p.add_argument("--max-model-len", type=_positive_int, help="context length (default: the model's)")
    p.add_argument("--device", help="torch device, e.g. cpu or cuda:0 (default: cuda when present)")
    p.add_argument("--sim-timing", metavar="K=V,...",
                   help="sim executor timing overrides (see docs/sim-calibration.md)")
    p.add_argument("--worker-id", metavar="NAME", help="name in logs, metrics and KV-event topics")
    observability = p.add_argument_group("observability", "request log lines and traces")
    observability.add_argument("--no-request-log", action="store_true",
                               help="write no JSON line per completion request (default: one each, on stderr)")
    observability.add_argument("--log-prompt-token-ids", action="store_true",
                               help="add the prompt's token ids to each request line (text is never logged)")
    observability.add_argument("--tracing-exporter", choices=("none", "console", "otlp"),
                               help="where spans go (default: OTEL_TRACES_EXPORTER, else none)")
    observability.add_argument("--tracing-endpoint", metavar="URL",
                               help="OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (default: "
                                    "OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT, else http://localhost:4318)")
    observability.add_argument("--tracing-sample-ratio", type=float, metavar="R",
                               help="share of new traces kept, in [0, 1]; a caller's sampled traceparent is "
                                    "always followed (default: OTEL_TRACES_SAMPLER[_ARG], else 1)")
    registration = p.add_argument_group("registration", "announce this worker to gateways through Redis "
                                        "(heartbeats while its /health answers; see docs/deploy.md)")
    registration.add_argument("--register", metavar="REDIS_URL", help="register in this Redis (e.g. redis://host:6379/0)")
    registration.add_argument("--pool", help="the gateway pool to join (required with --register)")
    registration.add_argument("--advertise-host", metavar="HOST",
                              help="host gateways reach this worker at (default: --host, or this machine's "
                                   "name when --host is a wildcard)")
    _add_heartbeat_timing(registration)
    p.set_defaults(handler=_run_worker)


def _add_register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("register", help="announce a running worker (any OpenAI-compatible engine) to gateways",
                       description="Register a worker in Redis and keep it registered while its /health "
                       "answers 200 (a sidecar beside vLLM, SGLang or a bundled worker); withdraw it on "
                       "SIGTERM or Ctrl-C. Gateways with the same redis.url add it to the pool and drop it "
                       "when its heartbeats stop.")
    p.add_argument("--redis", metavar="URL", required=True, help="the gateways' Redis (redis.url in their config)")
    p.add_argument("--pool", required=True, help="the gateway pool to join")
    p.add_argument("--name", required=True, help="the worker's name (unique in the registry)")
    p.add_argument("--url", required=True, help="where gateways reach the worker, e.g. http://10.0.0.7:8000")
    p.add_argument("--kv-events-endpoint", metavar="tcp://HOST:PORT",
                   help="where the worker publishes KV events (vLLM: --kv-events-config's endpoint)")
    p.add_argument("--model", help="the served model name (default: the first id in the worker's /v1/models)")
    _add_heartbeat_timing(p)
    p.set_defaults(handler=_run_register)


def _add_heartbeat_timing(p) -> None:
    p.add_argument("--registry-ttl", type=float, default=6.0, metavar="SECONDS",
                   help="a registration lapses this long after the last heartbeat (default: 6)")
    p.add_argument("--heartbeat-interval", type=float, default=2.0, metavar="SECONDS",
                   help="seconds between heartbeats (default: 2; below the TTL)")


def _add_keys(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="manage API keys", description="Manage API keys.")
    keys_sub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    create = keys_sub.add_parser("create", help="create an API key for a tenant",
                                 description="Print a new API key once, with the hash to put in the config "
                                 "(auth.keys) or store it in Redis with --redis.")
    create.add_argument("--tenant", required=True, help="tenant the key belongs to")
    create.add_argument("--redis", metavar="URL", help="store the key's hash in this Redis")
    create.set_defaults(handler=_run_keys_create)
    revoke = keys_sub.add_parser("revoke", help="revoke an API key stored in Redis",
                                 description="Remove a key from Redis (keys in a config file are revoked by "
                                 "deleting their auth.keys entry). Gateways cache Redis keys for up to 30 s.")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--key", help="the API key itself")
    which.add_argument("--sha256", metavar="HEX", help="the key's SHA-256 digest, as `keys create` printed it")
    revoke.add_argument("--redis", metavar="URL", required=True, help="the Redis the key is stored in")
    revoke.set_defaults(handler=_run_keys_revoke)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    # Everything after `bench`, --help included, goes to the load-test suite's own parser, which lists
    # its subcommands: no help option and no option prefix here, so no argument is taken for an option.
    p = sub.add_parser("bench", help="run load tests and benchmarks (see `kvgate bench --help`)",
                       add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(handler=_dispatch("loadtest.cli", "run", "the load-test suite", extra="bench"))


# The modules each optional extra installs (pyproject.toml [project.optional-dependencies]): a part whose
# extra is missing stops with one line saying how to install it, not with a traceback from deep inside.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "worker": ("torch", "safetensors", "gguf", "tqdm"),
    "bench": ("matplotlib", "tqdm"),
}


def _dispatch(module: str, function: str, part: str, extra: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"{part} is not part of this build yet ({module} is missing)")
        missing = [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]
        if missing:
            raise UsageError(f"{part} needs the '{extra}' extra ({', '.join(missing)} missing): "
                             f"pip install 'kvgate[{extra}]'")
        return getattr(importlib.import_module(module), function)(args)

    return handler


def _run_gateway(args: argparse.Namespace) -> int:
    from gateway.cli import run

    config = load_config(args.config)
    _check_gateway_workers(args, config)
    resolve_settings("kvgate-gateway", config.tracing.exporter, config.tracing.endpoint,  # OTEL_* checked once, here
                     config.tracing.sample_ratio)
    return run(args, config, _tokenizer_dirs(config))  # the parent resolves them first: `default` converts once


def _check_gateway_workers(args: argparse.Namespace, config) -> None:
    if args.workers > 1 and config.redis.url is None:
        raise UsageError(f"--workers {args.workers} needs redis.url in the config: without Redis each process "
                         f"would enforce every tenant's full limits on its own ({args.workers} times the "
                         "configured rate) and keep its own state; set redis.url, or run one process")
    if args.process_index is None and args.run_dir is None:
        return
    if args.process_index is None or args.run_dir is None or not 0 <= args.process_index < args.workers:
        raise UsageError("--process-index and --run-dir are set by `kvgate gateway --workers N` on its own processes")


def _tokenizer_dirs(config) -> dict[str, Path]:
    """Each pool's routing tokenizer folder; `default` is the embedded model (converted once)."""
    dirs = {}
    for name, pool in config.pools.items():
        if pool.tokenizer == "default":
            from worker.model.default_model import resolve_model_path  # needs no worker extra once converted
            from worker.model.errors import ModelFileNotFoundError

            try:
                dirs[name] = resolve_model_path("default")
            except ModelFileNotFoundError as exc:
                raise ConfigError(f"pools.{name}.tokenizer", str(exc)) from None
        elif pool.tokenizer is not None:
            folder = Path(pool.tokenizer).expanduser()
            if not (folder / "tokenizer.json").is_file():
                raise ConfigError(f"pools.{name}.tokenizer", f"no tokenizer.json in {folder}")
            dirs[name] = folder
    return dirs


def _run_worker(args: argparse.Namespace) -> int:
    """The worker, and with --register its heartbeat in a thread beside it."""
    run_worker = _dispatch("worker.cli", "run", "the worker", extra="worker")
    if args.register is None:
        if args.pool is not None:
            raise UsageError("--pool needs --register (the Redis to register in)")
        return run_worker(args)
    if args.pool is None:
        raise UsageError("--register needs --pool (the gateway pool to join)")
    from kvgate.registry import advertised_urls

    url, kv_events = advertised_urls(args.host, args.port, args.kv_events_endpoint, args.advertise_host)
    name = args.worker_id or urlparse(url).hostname.strip("[]").replace(":", "-") + f"-{args.port}"
    heartbeat = _heartbeat(args.register, args, name, url, kv_events, model=args.served_model_name)
    heartbeat.start()
    try:
        return run_worker(args)
    finally:
        heartbeat.stop()


def _run_register(args: argparse.Namespace) -> int:
    """`kvgate register`: heartbeats in the foreground until SIGTERM or Ctrl-C, then withdraw."""
    import logging
    import signal

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s register {args.name} %(levelname)s %(message)s")
    heartbeat = _heartbeat(args.redis, args, args.name, args.url, args.kv_events_endpoint, model=args.model)
    signal.signal(signal.SIGTERM, lambda signum, frame: heartbeat.stop())
    try:
        heartbeat.run()
    except KeyboardInterrupt:
        pass
    return 0


def _heartbeat(redis_url: str, args: argparse.Namespace, name: str, url: str, kv_events: str | None,
               model: str | None):
    """A Heartbeat for `kvgate worker --register` and `kvgate register`, its arguments checked."""
    from kvgate.config.checks import NAME
    from kvgate.registry import Heartbeat

    if not NAME.match(name):
        raise UsageError(f"worker name {name!r}: must be letters, digits, '.', '_' or '-'")
    if urlparse(redis_url).scheme not in ("redis", "rediss", "unix"):
        raise UsageError(f"{redis_url!r}: the registry must be a redis://, rediss:// or unix:// URL")
    if urlparse(url).scheme not in ("http", "https") or not urlparse(url).hostname:
        raise UsageError(f"--url {url!r}: not an http(s) URL")
    try:
        return Heartbeat(redis_url, name, args.pool, url, model=model, kv_events_endpoint=kv_events,
                         ttl_s=args.registry_ttl, interval_s=args.heartbeat_interval)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _run_keys_create(args: argparse.Namespace) -> int:
    from kvgate.keys import KeyStoreError, generate_key, hash_key, redacted_url, store_in_redis

    key = generate_key()
    digest = hash_key(key)
    try:
        _check_tenant(args.tenant, digest)
        if args.redis:
            store_in_redis(args.redis, digest, args.tenant)
    except (UsageError, KeyStoreError) as exc:
        print(f"kvgate keys: {exc}", file=sys.stderr)
        return 2
    if args.redis:
        where = f"stored in {redacted_url(args.redis)}"
    else:
        where = "add to your config under auth.keys:\n" f"  - tenant: {args.tenant}\n    sha256: {digest}"
    print(f"API key for tenant {args.tenant} (shown once, store it now):\n  {key}\n{where}")
    return 0


def _run_keys_revoke(args: argparse.Namespace) -> int:
    from kvgate.keys import KeyStoreError, hash_key, redacted_url, revoke_in_redis

    digest = hash_key(args.key) if args.key is not None else args.sha256.strip().lower()
    try:
        tenant = revoke_in_redis(args.redis, digest)
    except KeyStoreError as exc:
        print(f"kvgate keys: {exc}", file=sys.stderr)
        return 2
    if tenant is None:
        print(f"kvgate keys: no key with sha256 {digest} in {redacted_url(args.redis)}", file=sys.stderr)
        return 1
    print(f"revoked the key of tenant {tenant} (sha256 {digest}) in {redacted_url(args.redis)}; "
          "gateways stop accepting it within 30 s")
    return 0


def _check_tenant(tenant: str, digest: str) -> None:
    """The tenant must be one the config accepts under auth.keys, so the printed entry loads."""
    if not tenant.strip():
        raise UsageError("--tenant must not be empty")
    try:
        ApiKeyConfig(tenant=tenant, sha256=digest)
    except ConfigError as exc:
        raise UsageError(f"--tenant {tenant!r}: {exc.message}") from None


def _run_up(args: argparse.Namespace) -> int:
    from kvgate.stack import dev_api_key, print_banner, stack_specs
    from kvgate.supervisor import Supervisor

    from gateway.routing_config import routing_rules

    config = load_config(args.config)
    routing_rules(config)  # the router checks the policies now, before any worker is started
    port = args.port if args.port is not None else config.gateway.port
    env_name = config.auth.dev_key_env
    api_key = dev_api_key(os.environ.get(env_name) if env_name else None) if config.auth.dev_key_enabled else None
    specs = stack_specs(config, args.config, port, api_key)
    supervisor = Supervisor(specs, health_timeout_s=args.health_timeout)
    return supervisor.run(on_ready=lambda: print_banner(sys.stdout, config, port, api_key))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ConfigError as exc:
        where = f"{args.config}: " if getattr(args, "config", None) else ""
        print(f"kvgate: {where}{exc}", file=sys.stderr)
        return 2
    except (UsageError, TracingSettingError) as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
