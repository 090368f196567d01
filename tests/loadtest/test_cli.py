"""`kvgate bench run` and `kvgate bench report` as a user types them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvgate.cli import main as kvgate_main
from tests.conftest import free_port
from tests.loadtest.fake_upstream import Timing, build_app, serve_in_thread


def test_bench_run_then_report_writes_results_report_and_a_docs_section(tmp_path, capsys):
    with serve_in_thread(build_app(Timing(first_chunk_s=0.01, interval_s=0.01, num_chunks=3)), free_port()) as url:
        status = kvgate_main(["bench", "run", "--url", url + "/v1", "--api-key", "sk-secret", "--model", "m",
                              "--workload", "low_reuse", "--param", "num_requests=4", "--param", "document_tokens=20",
                              "--concurrency", "2", "--slo-ttft-ms", "1000", "--no-progress", "--out", str(tmp_path / "a")])
    assert status == 0
    result = json.loads((tmp_path / "a" / "run.json").read_text())
    assert result["summary"]["num_ok"] == 4 and result["summary"]["goodput_rps"] > 0
    assert "sk-secret" not in (tmp_path / "a" / "run.json").read_text()
    assert result["oracle"]["hit_rate"] is not None
    assert (tmp_path / "a" / "report.md").exists()

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    status = kvgate_main(["bench", "report", str(tmp_path / "a" / "run.json"), "--out", str(tmp_path / "b"),
                          "--bench-doc", "smoke", "--doc", str(doc)])
    assert status == 0
    assert (tmp_path / "b" / "ttft_cdf.png").exists()
    assert "Command: `kvgate bench run --url" in doc.read_text()
    assert "| run |" in capsys.readouterr().out


def test_bench_refuses_an_unknown_workload_parameter(tmp_path, capsys):
    status = kvgate_main(["bench", "run", "--url", "http://127.0.0.1:1", "--model", "m", "--workload", "low_reuse",
                          "--param", "pages=3", "--concurrency", "1", "--out", str(tmp_path)])
    assert status == 2
    assert "unknown parameter 'pages'" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_run_where_no_request_succeeds_writes_its_outputs_and_exits_1(tmp_path):
    dead_url = f"http://127.0.0.1:{free_port()}/v1"
    result = subprocess.run([sys.executable, "-m", "kvgate", "bench", "run", "--url", dead_url, "--model", "m",
                             "--workload", "low_reuse", "--param", "num_requests=3", "--param", "document_tokens=20",
                             "--concurrency", "1", "--no-progress", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "kvgate bench: no request succeeded (3 requests; errors: ConnectError: 3)" in result.stderr
    assert json.loads((tmp_path / "run.json").read_text())["summary"]["num_ok"] == 0
    assert (tmp_path / "report.md").exists()


def test_bench_fleet_on_vllm_with_a_kv_capacity_and_a_peer_router_the_run_starts(tmp_path):
    from loadtest.cli import build_parser, fleet_config

    args = build_parser().parse_args([
        "fleet", "--engine", "vllm", "--workers", "2", "--num-blocks", "192", "--policies", "round_robin,kv_aware",
        "--external-command", "sglang=python -m sglang_router.launch_router --worker-urls {worker_urls} --port {port}",
        "--external", "other=http://127.0.0.1:9000/v1", "--worker-arg=--max-model-len=4096",
        "--workload", "multi_tenant_long_prefix", "--concurrency", "4", "--out", str(tmp_path)])
    config = fleet_config(args)
    assert (config.engine, config.num_workers, config.num_blocks, config.worker_args) == (
        "vllm", 2, 192, ("--max-model-len=4096",))
    assert [(t.name, t.policy, t.url) for t in config.targets()] == [
        ("round_robin", "round_robin", None), ("kv_aware", "kv_aware", None),
        ("other", None, "http://127.0.0.1:9000/v1"), ("sglang", None, None)]
    assert config.targets()[-1].command == config.external_commands[0]


def test_bench_fleet_defaults_to_the_sim_engine(tmp_path):
    from loadtest.cli import build_parser, fleet_config

    args = build_parser().parse_args(["fleet", "--workload", "low_reuse", "--concurrency", "1", "--out", str(tmp_path)])
    config = fleet_config(args)
    assert (config.engine, config.num_blocks, config.external_commands) == ("sim", None, ())
    assert [(t.name, t.replicas) for t in config.targets()] == [("round_robin", 1), ("kv_aware", 1)]


def test_bench_fleet_runs_each_policy_once_per_replica_count(tmp_path):
    from loadtest.cli import build_parser, fleet_config

    args = build_parser().parse_args(["fleet", "--policies", "kv_aware", "--gateway-replicas", "1,2,4",
                                      "--workload", "low_reuse", "--concurrency", "1", "--out", str(tmp_path)])
    assert [(t.name, t.policy, t.replicas) for t in fleet_config(args).targets()] == [
        ("kv_aware", "kv_aware", 1), ("kv_aware-x2", "kv_aware", 2), ("kv_aware-x4", "kv_aware", 4)]


@pytest.mark.parametrize(("argv", "message"), [
    (["--external-command", "sglang=router --port {port}"], "{worker_urls} must be a word of its own"),
    (["--external", "sglang"], "--external takes NAME=URL"),
    (["--policies", "kv_aware", "--external", "kv_aware=http://127.0.0.1:1/v1"], "run names must differ"),
    (["--num-blocks", "0"], "--num-blocks must be >= 1"),
    (["--gateway-replicas", "1,0"], "--gateway-replicas takes counts >= 1"),
    (["--gateway-replicas", "two"], "--gateway-replicas takes counts such as 1,2,4"),
], ids=["command-without-workers", "external-without-url", "same-name-twice", "no-blocks", "no-replicas",
        "replicas-not-a-count"])
def test_bench_fleet_refuses_what_it_cannot_run_before_starting_anything(tmp_path, capsys, argv, message):
    status = kvgate_main(["bench", "fleet", *argv, "--workload", "low_reuse", "--concurrency", "1",
                          "--out", str(tmp_path)])
    assert status == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "fleet").exists()


def test_bench_fleet_names_the_engines_it_knows(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        kvgate_main(["bench", "fleet", "--engine", "sglang", "--workload", "low_reuse", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "invalid choice: 'sglang' (choose from 'sim', 'kvgate', 'vllm')" in capsys.readouterr().err
