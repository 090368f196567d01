"""The overload benchmark's processes: sim workers behind a recording proxy, and two kvgate gateways
on them from generated YAML (admission as configured, and admission that never refuses).

Everything is driven over HTTP; the gateways' RSS is read from /proc. With `pin`, the gateways run
on the first CPU this process may use and everything else (workers, proxy, this process: the load
generator) on the others, until stop().
"""

from __future__ import annotations

import copy
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import httpx
import yaml

from kvgate.keys import hash_key
from loadtest.fleet import Fleet, FleetConfig, WorkerEndpoint
from loadtest.procs import ChildProcess, Started, free_port

# The sim timing of docs/benchmarks.md's routing sections: the default with every coefficient x4.
SIM_TIMING_X4 = ("name=default x4 (Llama-3.1-8B on 1x H100 estimate with every coefficient x4; not calibrated),"
                 "step_overhead_s=0.026,prefill_token_s=2.4e-4,decode_seq_s=8e-5,kv_token_s=2e-7")
# Admission that never refuses: a fixed concurrency limit far above anything offered, so every
# request goes straight to routing (the gateway as it was before admission control).
ADMISSION_OFF = {"max_concurrency": 100000, "min_concurrency": 100000, "initial_concurrency": 100000}


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant of the benchmark: its class and weight (tenants.<name> in the gateway config)."""

    name: str
    priority: str = "standard"
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class GatewayVariant:
    """One gateway to start: a name, and its pool's `admission` section (None: the defaults)."""

    name: str
    admission: Mapping[str, Any] | None = None


def gateway_config(base: Mapping[str, Any], tenants: Mapping[str, TenantSpec], api_keys: Mapping[str, str],
                   admission: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fleet's gateway config (loadtest.fleet.Fleet.gateway_config) with the tenants, their keys
    (auth.keys, stored hashed; no dev key) and the pool's admission section."""
    config = copy.deepcopy(dict(base))
    config["auth"] = {"keys": [{"tenant": tenant, "sha256": hash_key(key)} for tenant, key in api_keys.items()],
                      "dev_key_env": None}
    config["tenants"] = {t.name: {"priority": t.priority, "weight": t.weight} for t in tenants.values()}
    if admission is not None:
        for pool in config["pools"].values():
            pool["admission"] = dict(admission)
    return config


class OverloadFleet(Started):
    """Sim workers, one recording proxy in front of all of them, and a gateway per variant."""

    def __init__(self, work_dir: Path, tenants: Mapping[str, TenantSpec], api_keys: Mapping[str, str],
                 variants: Sequence[GatewayVariant], *, num_workers: int = 2,
                 worker_args: Sequence[str] = (f"--sim-timing={SIM_TIMING_X4}",), pin: bool = False,
                 health_timeout_s: float = 120.0) -> None:
        self.work_dir, self.tenants, self.api_keys, self.variants = work_dir, tenants, api_keys, tuple(variants)
        self.fleet_config = FleetConfig(work_dir=work_dir, num_workers=num_workers, policies=("kv_aware",),
                                        worker_args=tuple(worker_args), health_timeout_s=health_timeout_s)
        self.health_timeout_s = health_timeout_s
        self.gateway_urls: dict[str, str] = {}
        self.proxy_url = ""
        self.model = ""
        self._fleet: Fleet | None = None
        self._children: list[ChildProcess] = []
        self._gateways: dict[str, ChildProcess] = {}
        self._own_cpus = os.sched_getaffinity(0)
        first_cpu = min(self._own_cpus)
        self._gateway_cpus, self._other_cpus = {first_cpu}, self._own_cpus - {first_cpu}
        self.pin = pin and bool(self._other_cpus)  # one CPU: nothing to split

    def start(self) -> None:
        if self.pin:
            os.sched_setaffinity(0, self._other_cpus)  # children inherit it; gateways are moved to their own
        self._fleet = Fleet(self.fleet_config, self.work_dir).__enter__()
        self.model = self._fleet.served_model()
        self._start_proxy()
        for variant in self.variants:
            self._start_gateway(variant)
        for child in self._gateways.values():
            child.wait_healthy(self.health_timeout_s)

    def _start_proxy(self) -> None:
        assert self._fleet is not None
        port = free_port()
        self.proxy_url = f"http://127.0.0.1:{port}"
        upstreams = [arg for ep in self._fleet.endpoints for arg in ("--upstream", f"{ep.name}={ep.url}")]
        argv = [sys.executable, "-m", "loadtest.recording_proxy", "--port", str(port), *upstreams]
        self._child("proxy", argv, f"{self.proxy_url}/_health").wait_healthy(self.health_timeout_s)
        self._fleet.endpoints = [WorkerEndpoint(ep.name, ep.url, f"{self.proxy_url}/{ep.name}", ep.kv_events_endpoint)
                                 for ep in self._fleet.endpoints]

    def _start_gateway(self, variant: GatewayVariant) -> None:
        assert self._fleet is not None
        port = free_port()
        base = self._fleet.gateway_config("kv_aware", port, self.model)
        path = self.work_dir / f"gateway-{variant.name}.yaml"
        path.write_text(yaml.safe_dump(gateway_config(base, self.tenants, self.api_keys, variant.admission),
                                       sort_keys=False))
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "kvgate", "gateway", "--config", str(path), "--port", str(port)]
        child = self._child(f"gateway-{variant.name}", argv, f"{url}/health")
        if self.pin:
            os.sched_setaffinity(child.popen.pid, self._gateway_cpus)
        self._gateways[variant.name] = child
        self.gateway_urls[variant.name] = url

    def _child(self, name: str, argv: list[str], health_url: str) -> ChildProcess:
        child = ChildProcess(name, argv, self.work_dir / "logs" / f"{name}.log", health_url)
        self._children.append(child)
        return child

    def gateway_rss_kib(self, variant: str) -> int:
        """The gateway's resident set size now (VmRSS of /proc/<pid>/status)."""
        return read_rss_kib(self._gateways[variant].popen.pid)

    def gateway_pid(self, variant: str) -> int:
        return self._gateways[variant].popen.pid

    def quiesce(self, timeout_s: float = 60.0) -> float:
        """Wait until every worker runs and queues nothing (their /metrics); returns the seconds waited."""
        assert self._fleet is not None
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if all(worker_backlog(ep.url) == 0 for ep in self._fleet.endpoints):
                break
            time.sleep(0.2)
        return time.monotonic() - start

    def stop(self) -> None:
        for child in reversed(self._children):
            child.stop()
        if self._fleet is not None:
            self._fleet.stop()
        if self.pin:
            os.sched_setaffinity(0, self._own_cpus)


def worker_backlog(worker_url: str) -> float | None:
    """Requests a worker is running or holding waiting (vllm:num_requests_running + _waiting), None if unreadable."""
    try:
        text = httpx.get(f"{worker_url}/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))


def read_rss_kib(pid: int) -> int:
    """VmRSS of a process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")
