"""Fleet mode: real sim workers, one gateway per policy (the real `kvgate gateway`, and a stand-in where
a test is about the fleet loop itself), one result per run."""

from __future__ import annotations

import sys

import pytest
import yaml

from loadtest.driver import DriverConfig
from loadtest.fleet import FleetConfig, run_fleet
from loadtest.peers import NGINX
from loadtest.runner import RunPlan
from loadtest.workloads import build_workload

FAKE_GATEWAY = (sys.executable, "-m", "tests.loadtest.fake_gateway")


@pytest.mark.slow
def test_fleet_runs_the_workload_once_per_policy_through_a_gateway_over_sim_workers(tmp_path):
    _, specs = build_workload("multi_tenant_long_prefix", 0, {"num_requests": "6", "prefix_tokens": "200",
                                                               "output_tokens": "4"})
    config = FleetConfig(work_dir=tmp_path, num_workers=2, policies=("round_robin", "kv_aware"),
                         gateway_command=FAKE_GATEWAY, health_timeout_s=60)
    plan = RunPlan(name="", driver=DriverConfig(base_url="", model="", concurrency=2, progress=False))
    results = run_fleet(config, specs, plan)

    assert [r["name"] for r in results] == ["round_robin", "kv_aware"]
    for result in results:
        summary = result["summary"]
        assert summary["num_ok"] == 6, summary["errors"]
        assert summary["workers"]["counts"] == {"w0": 3, "w1": 3}
        assert summary["prompt_tokens"] > 6 * 200
        assert result["faults"]["retries"] == 6  # the stand-in counts requests as "retries"
    written = yaml.safe_load((tmp_path / "kv_aware" / "gateway-kv_aware.yaml").read_text())
    pool = written["pools"]["default"]
    assert pool["policy"]["type"] == "kv_aware"
    assert [w["name"] for w in pool["workers"]] == ["w0", "w1"]
    assert all(w["kv_events_endpoint"].startswith("tcp://127.0.0.1:") for w in pool["workers"])


@pytest.mark.slow
def test_fleet_through_the_real_gateway_routes_by_each_policy(tmp_path):
    """Two tenants' long prefixes, one after the other: round robin spreads each tenant over both
    workers; kv_aware, fed by the sim workers' KV events, sends each tenant back to the worker that
    holds its prefix, and serves more of the prompts from cache."""
    _, specs = build_workload("multi_tenant_long_prefix", 0, {"num_tenants": "2", "num_requests": "12",
                                                               "prefix_tokens": "600", "output_tokens": "2"})
    config = FleetConfig(work_dir=tmp_path, num_workers=2, policies=("round_robin", "kv_aware"), health_timeout_s=60)
    plan = RunPlan(name="", driver=DriverConfig(base_url="", model="", concurrency=1, progress=False))
    results = {r["name"]: r["summary"] for r in run_fleet(config, specs, plan)}

    assert all(s["num_ok"] == 12 for s in results.values()), {n: s["errors"] for n, s in results.items()}
    assert results["round_robin"]["workers"]["counts"] == {"w0": 6, "w1": 6}
    assert results["kv_aware"]["prefix_hit_rate"] > results["round_robin"]["prefix_hit_rate"]


def test_gateway_config_written_for_a_policy_loads_with_the_kvgate_schema(tmp_path):
    from kvgate.config import load_config
    from loadtest.fleet import Fleet, WorkerEndpoint

    fleet = Fleet(FleetConfig(work_dir=tmp_path, num_workers=1), tmp_path)
    fleet.endpoints = [WorkerEndpoint("w0", "http://127.0.0.1:9001", "http://127.0.0.1:9101", "tcp://127.0.0.1:9201")]
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(fleet.gateway_config("session_affinity", 9300, "SmolLM2-135M-Instruct")))
    config = load_config(path)
    pool = config.pools["default"]
    assert (pool.policy.type, pool.workers[0].url, config.gateway.port) == ("session_affinity", "http://127.0.0.1:9101", 9300)


def test_gateway_config_for_vllm_workers_names_their_block_size_and_kv_capacity(tmp_path):
    from kvgate.config import load_config
    from loadtest.engines import Engine
    from loadtest.fleet import Fleet, WorkerEndpoint

    engine = Engine("vllm", ("/venv/bin/python",), "/models/smollm2", "SmolLM2-135M-Instruct")
    fleet = Fleet(FleetConfig(work_dir=tmp_path, num_workers=2, engine="vllm", num_blocks=192), tmp_path, engine)
    fleet.endpoints = [WorkerEndpoint(f"w{i}", f"http://127.0.0.1:900{i}", f"http://127.0.0.1:900{i}",
                                      f"tcp://127.0.0.1:910{2 * i}", 32) for i in range(2)]
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(fleet.gateway_config("kv_aware", 9300, "SmolLM2-135M-Instruct")))
    workers = load_config(path).pools["default"].workers
    assert [(w.name, w.kv_events_endpoint, w.block_size, w.num_blocks) for w in workers] == [
        ("w0", "tcp://127.0.0.1:9100", 32, 192), ("w1", "tcp://127.0.0.1:9102", 32, 192)]


def test_runs_go_policies_first_then_routers_at_a_url_then_routers_the_run_starts(tmp_path):
    from loadtest.external_router import parse_external_command

    sglang = parse_external_command("sglang=router --worker-urls {worker_urls} --port {port}")
    config = FleetConfig(work_dir=tmp_path, policies=("kv_aware",), externals=(("other", "http://h/v1"),),
                         external_commands=(sglang,))
    assert [t.name for t in config.targets()] == ["kv_aware", "other", "sglang"]
    assert FleetConfig(work_dir=tmp_path, policies=(), external_commands=(sglang,)).targets()[0].command == sglang
    with pytest.raises(ValueError, match="run names must differ"):
        FleetConfig(work_dir=tmp_path, policies=("sglang",), external_commands=(sglang,))


@pytest.mark.slow
def test_a_router_the_run_starts_fronts_the_fleets_workers(tmp_path):
    """--external-command: the stand-in gateway, started as a peer router over the sim workers' URLs. It
    answers /health at once but refuses to route for its first 2 s (as sglang-router does until it has
    found its workers): the run starts once it routes, so no request meets that refusal."""
    from loadtest.external_router import ExternalCommand

    _, specs = build_workload("multi_tenant_long_prefix", 0, {"num_requests": "6", "prefix_tokens": "200",
                                                               "output_tokens": "4"})
    router = ExternalCommand("peer", " ".join([*FAKE_GATEWAY, "--worker-urls", "{worker_urls}", "--port", "{port}",
                                               "--routes-after-s", "2"]))
    config = FleetConfig(work_dir=tmp_path, num_workers=2, policies=(), external_commands=(router,),
                         health_timeout_s=60)
    plan = RunPlan(name="", driver=DriverConfig(base_url="", model="", concurrency=2, progress=False))
    (result,) = run_fleet(config, specs, plan)

    assert result["name"] == "peer" and result["summary"]["num_ok"] == 6, result["summary"]["errors"]
    assert result["summary"]["workers"]["counts"] == {"w0": 3, "w1": 3}
    assert result["config"]["fleet"]["router"] == "external" and "router" not in result
    assert (tmp_path / "peer" / "logs" / "router-peer.log").exists()


@pytest.mark.slow
def test_error_fault_through_a_proxy_shows_client_errors_then_recovers(tmp_path):
    from loadtest.faults import parse_fault

    _, specs = build_workload("low_reuse", 0, {"num_requests": "400", "document_tokens": "50", "output_tokens": "2"})
    config = FleetConfig(work_dir=tmp_path, num_workers=2, policies=("round_robin",), gateway_command=FAKE_GATEWAY,
                         faults=(parse_fault("error:w1@0-0.6:fraction=1"),), health_timeout_s=60)
    plan = RunPlan(name="", driver=DriverConfig(base_url="", model="", concurrency=2, duration_s=1.6, progress=False))
    (result,) = run_fleet(config, specs, plan)

    faults = result["faults"]
    assert faults["client_errors"].get("http_503", 0) > 0
    assert [s["action"] for s in faults["schedule"]] == ["start", "end"]
    recovery_s = faults["faults"][0]["recovery_s"]
    assert recovery_s is not None and recovery_s < 0.5


@pytest.mark.slow
@pytest.mark.skipif(not NGINX.present(), reason=f"nginx is not installed ({NGINX.install})")
def test_gateway_replicas_serve_behind_a_round_robin_balancer(tmp_path):
    """--gateway-replicas 2: two gateways (the stand-in), each with its own config, behind nginx; every
    request is answered through the balancer."""
    _, specs = build_workload("multi_tenant_long_prefix", 0, {"num_requests": "8", "prefix_tokens": "50",
                                                               "output_tokens": "2"})
    config = FleetConfig(work_dir=tmp_path, num_workers=1, policies=("kv_aware",), gateway_replicas=(2,),
                         gateway_command=FAKE_GATEWAY, health_timeout_s=60)
    plan = RunPlan(name="", driver=DriverConfig(base_url="", model="", concurrency=1, progress=False))
    (result,) = run_fleet(config, specs, plan)

    assert result["name"] == "kv_aware-x2" and result["config"]["fleet"]["gateway_replicas"] == 2
    assert result["summary"]["num_ok"] == 8, result["summary"]["errors"]
    assert sorted(p.name for p in (tmp_path / "kv_aware-x2").glob("gateway-*.yaml")) == [
        "gateway-0-kv_aware.yaml", "gateway-1-kv_aware.yaml"]
    assert (tmp_path / "kv_aware-x2" / "balancer" / "nginx.conf").exists()


@pytest.mark.slow
def test_fleet_on_the_bundled_torch_worker_routes_by_its_kv_events(tmp_path):
    """--engine kvgate: two real torch workers on a tiny model, each on a core of its own; kv_aware is fed
    by their KV events and its predictions are read back from the gateway."""
    from tests.tiny_models import build_model_dir

    model_dir = build_model_dir(tmp_path / "tiny-llama", max_position_embeddings=4096)
    _, specs = build_workload("multi_tenant_long_prefix", 0, {"num_tenants": "2", "num_requests": "8",
                                                               "prefix_tokens": "150", "query_tokens": "10",
                                                               "output_tokens": "2"})
    config = FleetConfig(work_dir=tmp_path / "fleet", num_workers=2, engine="kvgate", worker_model=str(model_dir),
                         policies=("kv_aware",), num_blocks=256, health_timeout_s=120)
    plan = RunPlan(name="", driver=DriverConfig(base_url="", model="", concurrency=1, progress=False))
    (result,) = run_fleet(config, specs, plan)

    summary = result["summary"]
    assert summary["num_ok"] == 8, summary["errors"]
    assert result["config"]["fleet"]["executor"] == "torch"
    assert summary["prefix_hit_rate"] > 0.5  # each tenant's prefix is served from cache after its first request
    assert result["router"]["predicted_cached_tokens"] > 0
    assert sum(result["router"]["index_blocks"].values()) > 0  # the workers' KV events reached the gateway


def test_a_fixed_port_something_already_listens_on_is_refused(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = FleetConfig(work_dir=tmp_path, num_workers=1, base_port=port - 4)
        with pytest.raises(RuntimeError, match=f"port {port} .* is in use"):
            config.port(4)
    assert FleetConfig(work_dir=tmp_path, num_workers=1).port(4) is None  # no --base-port: none fixed
