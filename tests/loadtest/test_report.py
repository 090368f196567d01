"""Result files, Markdown + PNG reports, the comparison table, and docs/benchmarks.md sections."""

from __future__ import annotations

import pytest

from loadtest.report import (build_result, comparison_table, load_result, write_benchmarks_section, write_report,
                             write_result)
from loadtest.slo import Slo, summarize
from loadtest.types import RequestRecord


def _result(name: str, worker_split=(3, 1)) -> dict:
    records = [RequestRecord(index=i, scheduled_s=i * 0.5, start_s=i * 0.5, end_s=i * 0.5 + 1.0, status=200,
                             ttft_ms=100.0 + i, itl_ms=(20.0, 22.0), e2e_ms=1000.0, prompt_tokens=100, output_tokens=3,
                             cached_tokens=40, headers={"x-kvgate-worker": "w0" if i < worker_split[0] else "w1"})
               for i in range(sum(worker_split))]
    summary = summarize(records, 2.0, Slo(ttft_ms=102))
    return build_result(name, {"slo": {"ttft_ms": 102}}, records, summary, {"hit_rate": 0.8}, "kvgate bench fleet X",
                        machine="test machine")


def test_report_writes_markdown_with_the_comparison_table_and_png_plots(tmp_path):
    path = write_report([_result("round_robin"), _result("kv_aware", (2, 2))], tmp_path)
    text = path.read_text()
    assert "| round_robin | 0.400 | 0.50 |" in text and "| kv_aware |" in text
    for png in ("ttft_cdf", "itl_cdf", "throughput_over_time", "worker_load", "prefix_hit_rate"):
        assert (tmp_path / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
        assert f"({png}.png)" in text


def test_comparison_table_shows_load_imbalance_and_goodput():
    row = comparison_table([_result("p", (3, 1))]).splitlines()[2]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "p"
    assert cells[7] == "1.50"   # goodput: TTFTs 100, 101, 102 meet the 102 ms SLO (103 misses): 3 / 2 s
    assert cells[8] == "1.50"   # max/mean worker load: 3 / 2


def test_result_files_round_trip(tmp_path):
    path = write_result(tmp_path / "r.json", _result("a"))
    assert load_result(path)["summary"]["num_ok"] == 4


DOC = """# Benchmarks

intro

<!-- bench:routing:start -->
old table
<!-- bench:routing:end -->

<!-- bench:other:start -->
keep me
<!-- bench:other:end -->
"""


def test_benchmarks_section_between_markers_is_rewritten_and_the_rest_kept(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    write_benchmarks_section(doc, "routing", [_result("kv_aware")], "kvgate bench fleet --workers 4")
    text = doc.read_text()
    assert "old table" not in text and "keep me" in text and text.startswith("# Benchmarks\n\nintro\n")
    section = text.split("<!-- bench:routing:start -->")[1].split("<!-- bench:routing:end -->")[0]
    assert "Command: `kvgate bench fleet --workers 4`" in section
    assert "Machine: test machine" in section
    assert "| kv_aware |" in section
    assert "![hit rate / oracle and TTFT per run](bench-routing.png)" in section
    assert (tmp_path / "bench-routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_benchmarks_section_is_appended_once(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    for _ in range(2):
        write_benchmarks_section(doc, "new", [_result("a")], "cmd")
    assert doc.read_text().count("<!-- bench:new:start -->") == 1


def test_loading_a_file_that_is_not_a_result_fails(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a kvgate load-test result"):
        load_result(path)


@pytest.mark.parametrize(
    ("worker_args", "timing"),
    [
        ([], "default (Llama-3.1-8B-Instruct bf16 on 1x H100 SXM 80GB under vLLM (estimated from public figures)"),
        (["--sim-timing=name=slow GPU,prefill_token_s=1e-4"], "slow GPU"),
        (["--sim-timing", "prefill_token_s=1e-4"], "default with overrides `prefill_token_s=1e-4`"),
    ],
    ids=["default-timing", "named-override", "unnamed-override"],
)
def test_benchmarks_section_of_a_sim_fleet_names_the_executor_and_its_timing(tmp_path, worker_args, timing):
    result = _result("kv_aware")
    result["config"]["fleet"] = {"executor": "sim", "worker_args": worker_args}
    doc = tmp_path / "benchmarks.md"
    write_benchmarks_section(doc, "routing", [result], "kvgate bench fleet --workers 4")
    assert f"Figures from the `sim` executor (timing model, no model math), timing: {timing}" in doc.read_text()


def test_a_real_engine_fleet_names_its_engine_and_the_routers_own_prediction_hit_ratio(tmp_path):
    result = _result("kv_aware")
    result["config"]["fleet"] = {"executor": "vllm", "num_workers": 2, "worker_model": "default", "worker_args": []}
    result["router"] = {"prediction_hit_ratio": 0.875, "predicted_cached_tokens": 224000,
                        "reported_cached_tokens": 196000, "index_blocks": {"w0": 189}}
    doc = tmp_path / "benchmarks.md"
    write_benchmarks_section(doc, "real", [result], "kvgate bench fleet --engine vllm")
    assert "Figures from real engines: 2 x vLLM (CPU build), model `default`" in doc.read_text()
    report = write_report([result], tmp_path).read_text()
    assert "router prediction hit ratio 0.875 (224000 predicted / 196000 reported cached tokens)" in report


def test_a_run_that_knew_the_fleets_capacity_names_the_static_partition_beside_the_oracle(tmp_path):
    result = _result("kv_aware")
    result["oracle"] = {"hit_rate": 0.8, "static_partition_hit_rate": 0.6}
    doc = tmp_path / "benchmarks.md"
    write_benchmarks_section(doc, "routing", [result], "kvgate bench fleet --num-blocks 192")
    assert "hit rate 0.600, 0.75 of the oracle" in doc.read_text()
    write_benchmarks_section(doc, "plain", [_result("kv_aware")], "kvgate bench fleet")
    assert doc.read_text().split("<!-- bench:plain:start -->")[1].count("Static partition") == 0


def test_the_fleets_capacity_reaches_the_oracle_plan_in_tokens(tmp_path):
    from loadtest.cli import _partition, build_parser

    def parsed(*extra: str):
        return build_parser().parse_args(["fleet", *extra, "--workload", "low_reuse", "--concurrency", "1",
                                          "--out", str(tmp_path)])

    assert _partition(parsed("--workers", "2")) is None
    assert _partition(parsed("--workers", "2", "--num-blocks", "192")) == {"num_workers": 2, "capacity_tokens": 3072}
    assert _partition(parsed("--engine", "vllm", "--workers", "2", "--num-blocks", "192"))["capacity_tokens"] == 6144
    assert _partition(parsed("--num-blocks", "10", "--worker-arg=--block-size=8"))["capacity_tokens"] == 80


def test_a_fleets_oracle_counts_blocks_of_its_workers_size_unless_told(tmp_path):
    from loadtest.cli import _plan_parts, build_parser

    def oracle_block_size(subcommand: list[str], *extra: str) -> int:
        args = build_parser().parse_args([*subcommand, "--workload", "low_reuse", "--concurrency", "1",
                                          "--out", str(tmp_path), *extra])
        return _plan_parts(args, "http://127.0.0.1:1/v1", "m")[1].oracle["block_size_tokens"]

    assert oracle_block_size(["fleet", "--engine", "vllm"]) == 32  # vLLM's CPU build caches 32-token blocks
    assert oracle_block_size(["fleet", "--worker-arg=--block-size=8"]) == 8
    assert oracle_block_size(["fleet"]) == 16  # kvgate's own workers' default
    assert oracle_block_size(["fleet", "--engine", "vllm"], "--oracle-block-size", "16") == 16
    assert oracle_block_size(["run", "--url", "http://127.0.0.1:1/v1", "--model", "m"]) == 16  # not our workers
    with pytest.raises(ValueError, match="block_size_tokens must be >= 1"):  # kvgate bench: exits 2 naming it
        oracle_block_size(["fleet", "--engine", "vllm"], "--oracle-block-size", "0")
