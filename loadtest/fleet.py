"""Fleet runs: a fresh fleet of workers per run (sim, the bundled torch worker or vLLM: loadtest/engines.py),
a gateway per routing policy (or an external router: at a URL, or started by the run over its workers),
the same workload through each, optional fault scenarios; one result per run.

Ports: free ones, or from --base-port B: worker i on B+i, its KV events on B+N+2i (replay +1),
its fault proxy on B+3N+i, the gateway (or an --external-command router) on B+4N, redis on B+4N+1,
the external router's metrics port on B+4N+2 (routers given by URL can then be configured against
fixed worker URLs).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx
import yaml

from loadtest.engines import ENGINES, EXECUTORS, Engine, KVGATE_WORKER, resolve_engine, worker_cpu, worker_launch
from loadtest.external_router import ExternalCommand
from loadtest.faults import FaultActions, FaultSpec, set_proxy_fault, shutdown_redis
from loadtest.peers import NGINX
from loadtest.peers.nginx import balancer_argv, balancer_conf
from loadtest.procs import ChildProcess, Started, free_port, port_is_free
from loadtest.router_metrics import router_stats
from loadtest.runner import RunPlan, execute
from loadtest.types import RequestSpec


REPLICAS_SHARE = ("redis", "nothing", "both")  # --replicas-share: see FleetConfig.replicas_share


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The fleet to start (engine, workers, their KV capacity), the policies and external routers to
    compare, and the faults to inject."""

    work_dir: Path
    num_workers: int = 4
    policies: tuple[str, ...] = ("round_robin", "kv_aware")
    externals: tuple[tuple[str, str], ...] = ()
    external_commands: tuple[ExternalCommand, ...] = ()
    faults: tuple[FaultSpec, ...] = ()
    engine: str = "sim"
    num_blocks: int | None = None
    worker_model: str = "default"
    worker_args: tuple[str, ...] = ()
    worker_command: tuple[str, ...] = KVGATE_WORKER
    gateway_command: tuple[str, ...] = (sys.executable, "-m", "kvgate", "gateway")
    base_port: int | None = None
    health_timeout_s: float = 120.0
    gateway_replicas: tuple[int, ...] = (1,)  # each policy runs once per count: N gateways behind nginx
    # how N > 1 replicas run: "redis" (sharing state through a redis-server of the run's), "nothing"
    # (each on its own state), or "both" (each N twice; the second run's name ends in -unshared)
    replicas_share: str = "redis"

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError("--workers must be >= 1")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("--num-blocks must be >= 1")
        if not self.gateway_replicas or any(n < 1 for n in self.gateway_replicas):
            raise ValueError("--gateway-replicas takes counts >= 1")
        if self.replicas_share not in REPLICAS_SHARE:
            raise ValueError(f"--replicas-share must be one of {', '.join(REPLICAS_SHARE)}, not {self.replicas_share!r}")
        targets = [t.name for t in self.targets()]
        if not targets:
            raise ValueError("give at least one policy or --external router")
        if len(set(targets)) != len(targets):
            raise ValueError(f"run names must differ (one result file each): {', '.join(targets)}")
        names = [f"w{i}" for i in range(self.num_workers)]
        for fault in self.faults:
            if fault.target is not None and fault.target not in names:
                raise ValueError(f"fault target {fault.target!r} is not one of {', '.join(names)}")

    def port(self, offset: int) -> int | None:
        """The fixed port at base_port + offset (None without --base-port); RuntimeError if something
        listens there already: a leftover server would answer the run's health checks and requests."""
        if self.base_port is None:
            return None
        port = self.base_port + offset
        if not port_is_free(port):
            raise RuntimeError(f"port {port} (--base-port {self.base_port} + {offset}) is in use: "
                               "is a process of an earlier run still there?")
        return port

    def targets(self) -> list[Target]:
        """One run each, in this order: the policies, the routers at a URL, the routers the run starts."""
        shares = {"redis": (True,), "nothing": (False,), "both": (True, False)}[self.replicas_share]
        return ([Target(policy, policy=policy) if n == 1 else
                 Target(f"{policy}-x{n}" + ("" if share else "-unshared"), policy=policy, replicas=n,
                        share_state=share)
                 for policy in self.policies for n in self.gateway_replicas for share in (shares if n > 1 else (True,))]
                + [Target(name, url=url) for name, url in self.externals]
                + [Target(c.name, command=c) for c in self.external_commands])


@dataclass(frozen=True, slots=True)
class Target:
    """What one run drives: a kvgate gateway with `policy`, a router already at `url`, or one it starts."""

    name: str
    policy: str | None = None
    url: str | None = None
    command: ExternalCommand | None = None
    replicas: int = 1  # kvgate gateways behind a round-robin balancer (a policy's run only)
    share_state: bool = True  # replicas share state through the run's Redis


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    """Where one worker listens: its own URL, the URL routers should use (a fault proxy or itself), KV events."""

    name: str
    url: str
    route_url: str
    kv_events_endpoint: str
    block_size: int | None = None  # None: the worker's default, which the gateway assumes too


class Fleet(Started):
    """Workers (+ fault proxies, + a redis-server when a scenario stops Redis or gateway replicas share
    state) for one run; engine:
    resolved once for all runs (default: from config.engine)."""

    def __init__(self, config: FleetConfig, run_dir: Path, engine: Engine | None = None) -> None:
        self.config, self.run_dir = config, run_dir
        self.engine = engine or resolve_engine(config.engine, config.worker_model, config.worker_command)
        self.children: dict[str, ChildProcess] = {}
        self.endpoints: list[WorkerEndpoint] = []
        self.redis_port: int | None = None

    def start(self) -> None:
        self._start_workers()
        self._start_proxies()
        shares = any(t.replicas > 1 and t.share_state for t in self.config.targets())
        if shares or any(f.kind == "redis" for f in self.config.faults):
            self._start_redis()

    def _start_workers(self) -> None:
        n, cpus = self.config.num_workers, sorted(os.sched_getaffinity(0))
        timeout_s = self.config.health_timeout_s
        for i in range(n):
            name, port = f"w{i}", self.config.port(i) or free_port()
            kv_port = self.config.port(n + 2 * i) or free_port(pair=True)
            launch = worker_launch(self.engine, name, port, kv_port, cpu=worker_cpu(self.engine.kind, i, cpus),
                                   num_blocks=self.config.num_blocks, extra_args=self.config.worker_args)
            url = f"http://127.0.0.1:{port}"
            self._start(name, launch.argv, f"{url}/health", dict(launch.env), launch.cpus)
            self.endpoints.append(WorkerEndpoint(name, url, url, f"tcp://127.0.0.1:{kv_port}", launch.block_size))
            timeout_s = max(timeout_s, launch.start_timeout_s or 0.0)
        for name in self.worker_names:  # they start side by side
            self.children[name].wait_healthy(timeout_s)

    def _start_proxies(self) -> None:
        targets = {f.target for f in self.config.faults if f.needs_proxy}
        for i, ep in enumerate(self.endpoints):
            if ep.name in targets:
                port = self.config.port(3 * self.config.num_workers + i) or free_port()
                proxy_url = f"http://127.0.0.1:{port}"
                argv = [sys.executable, "-m", "loadtest.fault_proxy", "--upstream", ep.url, "--port", str(port)]
                self._start(f"proxy-{ep.name}", argv, f"{proxy_url}/health").wait_healthy(self.config.health_timeout_s)
                self.endpoints[i] = dataclasses.replace(ep, route_url=proxy_url)

    def _start_redis(self) -> None:
        self.redis_port = self.config.port(4 * self.config.num_workers + 1) or free_port()
        argv = ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no"]
        redis = self._start("redis", argv, None)
        redis.wait_healthy(5.0)

    def _start(self, name: str, argv: Sequence[str], health_url: str | None, env: dict[str, str] | None = None,
               cpus: frozenset[int] | None = None) -> ChildProcess:
        child = ChildProcess(name, argv, self.run_dir / "logs" / f"{name}.log", health_url, env, cpus)
        self.children[name] = child
        return child

    @property
    def worker_names(self) -> list[str]:
        return [ep.name for ep in self.endpoints]

    def served_model(self) -> str:
        """The model name the first worker serves (from its /v1/models)."""
        data = httpx.get(f"{self.endpoints[0].url}/v1/models", timeout=10.0).json()
        return data["data"][0]["id"]

    def gateway_config(self, policy: str, port: int, model: str, replicas: int = 1,
                       share_state: bool = True) -> dict[str, Any]:
        """A kvgate YAML config (see kvgate/config/schema.py) routing the one pool with `policy`, for
        one of `replicas` gateways (sharing state through the run's Redis, where it has one, unless
        share_state is False)."""
        workers = [self._worker_entry(ep) for ep in self.endpoints]
        tokenizer = "default" if self.config.worker_model == "default" else self.config.worker_model
        config: dict[str, Any] = {
            "gateway": {"host": "127.0.0.1", "port": port},
            "auth": {"keys": [], "dev_key_env": "KVGATE_API_KEY", "dev_tenant": "dev"},
            "pools": {"default": {"model": model, "tokenizer": tokenizer,
                                  "policy": {"type": policy, "parameters": {}}, "workers": workers}}}
        if self.redis_port is not None and share_state:
            config["redis"] = {"url": f"redis://127.0.0.1:{self.redis_port}/0", "replicas": replicas}
        return config

    def _worker_entry(self, ep: WorkerEndpoint) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": ep.name, "url": ep.route_url, "kv_events_endpoint": ep.kv_events_endpoint}
        if ep.block_size is not None:
            entry["block_size"] = ep.block_size
        if self.config.num_blocks is not None:
            entry["num_blocks"] = self.config.num_blocks
        return entry

    def start_gateway(self, policy: str, model: str, api_key: str, replicas: int = 1,
                      share_state: bool = True) -> str:
        """Write the config for `policy`, start the gateway on it, wait for /health; returns its URL.
        With replicas > 1: that many gateways (each its own process, index and load view, as separate
        hosts would have) behind an nginx balancer sending requests round robin; returns its URL."""
        port = self.config.port(4 * self.config.num_workers) or free_port()
        ports = [port] if replicas == 1 else [free_port() for _ in range(replicas)]
        names = ["gateway"] if replicas == 1 else [f"gateway-{i}" for i in range(replicas)]
        if self.redis_port is not None:  # nothing an earlier run's gateways left (breakers held open, ...)
            subprocess.run(["redis-cli", "-p", str(self.redis_port), "flushall"], capture_output=True, timeout=10)
        for name, gateway_port in zip(names, ports):
            path = self.run_dir / f"{name}-{policy}.yaml"
            config = self.gateway_config(policy, gateway_port, model, replicas, share_state)
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            argv = [*self.config.gateway_command, "--config", str(path), "--port", str(gateway_port)]
            self._start(name, argv, f"http://127.0.0.1:{gateway_port}/health", {"KVGATE_API_KEY": api_key})
        for name in names:
            self.children[name].wait_healthy(self.config.health_timeout_s)
        if replicas == 1:
            return f"http://127.0.0.1:{port}"
        if not NGINX.present():
            raise RuntimeError(f"--gateway-replicas needs nginx as its balancer: {NGINX.install}")
        conf = (self.run_dir / "balancer" / "nginx.conf").resolve()  # nginx takes paths relative to its prefix
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(balancer_conf(port, ports, conf.parent))
        self._start("balancer", balancer_argv(conf, conf.parent), f"http://127.0.0.1:{port}/health") \
            .wait_healthy(self.config.health_timeout_s)
        return f"http://127.0.0.1:{port}"

    def start_external(self, command: ExternalCommand) -> str:
        """Start a peer router over this fleet's workers (as the gateway sees them: through any fault
        proxy); wait until it routes; returns its base URL (.../v1). "Routes" is /v1/models answering
        below 500: a router may answer /health before it has found a healthy worker (sglang-router
        0.3.2 does, and answers every request with 503 meanwhile), and a run started then would count
        its first requests as the router's failures and its hit rate over the rest."""
        n = self.config.num_workers
        port = self.config.port(4 * n) or free_port()
        metrics_port = self.config.port(4 * n + 2) or free_port()
        argv = command.argv([ep.route_url for ep in self.endpoints], port, metrics_port)
        url = f"http://127.0.0.1:{port}"
        self._start(f"router-{command.name}", argv, f"{url}/v1/models") \
            .wait_healthy(self.config.health_timeout_s, any_answer=True)
        return f"{url}/v1"

    def actions(self) -> FaultActions:
        proxies = {ep.name: ep.route_url for ep in self.endpoints if ep.route_url != ep.url}
        return FaultActions(kill_worker=lambda name: self.children[name].kill(),
                            set_proxy_fault=lambda name, delay, frac: set_proxy_fault(proxies[name], delay, frac),
                            stop_redis=lambda: shutdown_redis(self.redis_port) if self.redis_port else None)

    def stop(self) -> None:
        for child in reversed(list(self.children.values())):
            child.stop()


def run_fleet(config: FleetConfig, specs: Sequence[RequestSpec], plan: RunPlan,
              on_result: Callable[[dict[str, Any]], None] = lambda result: None) -> list[dict[str, Any]]:
    """One run per policy (through a kvgate gateway) and per external router, each on a fresh fleet."""
    engine = resolve_engine(config.engine, config.worker_model, config.worker_command)
    results = []
    for target in config.targets():
        with Fleet(config, config.work_dir / target.name, engine) as fleet:
            result = _one_run(fleet, target, specs, plan)
        on_result(result)
        results.append(result)
    return results


def _one_run(fleet: Fleet, target: Target, specs: Sequence[RequestSpec], plan: RunPlan) -> dict[str, Any]:
    model = plan.driver.model or fleet.served_model()
    api_key = plan.driver.api_key
    if target.policy is not None:
        api_key = f"kvgate-bench-{secrets.token_hex(8)}"
        base_url = fleet.start_gateway(target.policy, model, api_key, target.replicas, target.share_state)
    elif target.command is not None:
        base_url = fleet.start_external(target.command)
    else:
        base_url = (target.url or "").rstrip("/")
    driver = dataclasses.replace(plan.driver, base_url=base_url, model=model, api_key=api_key)
    # the router's own figures: of the one gateway (a balancer would answer from any replica)
    metrics_url = f"{_origin(base_url)}/metrics" if target.policy is not None and target.replicas == 1 else None
    run_plan = dataclasses.replace(plan, name=target.name, driver=driver,
                                   config={**plan.config, "fleet": _fleet_json(fleet, target)},
                                   workers=tuple(fleet.worker_names), faults=fleet.config.faults,
                                   actions=fleet.actions() if fleet.config.faults else None, metrics_url=metrics_url)
    result = execute(specs, run_plan)
    if metrics_url is not None:
        result["router"] = router_stats(metrics_url)
    return result


def _fleet_json(fleet: Fleet, target: Target) -> dict[str, Any]:
    config = fleet.config
    return {"num_workers": config.num_workers, "engine": config.engine, "executor": EXECUTORS[config.engine],
            "worker_model": config.worker_model, "worker_args": list(config.worker_args),
            "num_blocks": config.num_blocks, "router": "kvgate" if target.policy is not None else "external",
            "policy": target.policy, "gateway_replicas": target.replicas,
            "replicas_share_state": target.share_state if target.replicas > 1 else None,
            "external_command": target.command.command if target.command is not None else None}


def _origin(url: str) -> str:
    parsed = httpx.URL(url)
    return f"{parsed.scheme}://{parsed.host}:{parsed.port}" if parsed.port else f"{parsed.scheme}://{parsed.host}"
