"""The side-by-side's limits of the machine (loadtest/benchmarks/engine_side_by_side.py): the measured fp32 peak and
the shares of it the section reports, without the engines."""

from __future__ import annotations

import json
import os

from loadtest.benchmarks.engine_side_by_side import OUTPUT_TOKENS, PROMPT_TOKENS, markdown, model_figures
from loadtest.harness.machine_limits import measured_fp32_peak_flops


def test_the_fp32_peak_is_measured_on_the_named_core():
    cpu = min(os.sched_getaffinity(0))
    peak, library = measured_fp32_peak_flops(cpu, size=256, repeats=2)
    assert 1e8 < peak < 1e13  # any CPU core: from 0.1 GFLOP/s to 10 TFLOP/s
    assert library in ("numpy's BLAS", "torch's BLAS", "oneDNN")


def test_a_prompt_token_passes_the_layers_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "hidden_size": 10,
                                                      "tie_word_embeddings": True}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4 * 5000)  # 5,000 fp32 parameters, 1,000 of them embedding
    figures = model_figures(tmp_path)
    assert figures["params_per_token"] == 5000 and figures["layer_params"] == 4000


def test_shares_count_the_prompt_tokens_a_run_computes():
    peak = 1e11
    run = {"concurrency": 0, "output_tokens_per_s": 100.0, "ttft_ms": 500.0}
    result = {"rounds": 1, "model": {"weight_bytes": 4e8, "params_per_token": 1e8, "layer_params": 8e7},
              "memory_bandwidth_bytes_s": 4e10, "fp32_peak_flops": peak, "nominal_fp32_peak_flops": 2e11,
              "nominal_fp32_peak_basis": "AVX2 8 lanes x 2 FMA units x 2 flops x 6.25 GHz",
              "measured": [{"round": 1, "engine": kind, "runs": [run | {"concurrency": c} for c in (1, 8, 32)]}
                           for kind in ("kvgate", "vllm")]}
    text = markdown(result, "cmd", "machine", "date")
    at_32 = 100.0 * (2e8 + PROMPT_TOKENS / OUTPUT_TOKENS * 1.6e8) / peak
    prefill = PROMPT_TOKENS * 1.6e8 / 0.5 / peak
    assert f"| kvgate worker | {100.0 * 10e-3:.0%} | {at_32:.0%} | {prefill:.0%} |" in text
    assert "100 GFLOP/s measured" in text and "nominal" in text and "200 GFLOP/s" in text

