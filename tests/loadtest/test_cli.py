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
