"""The engine profile's arithmetic and its timers (loadtest/benchmarks/engine_profile.py, worker/step_profile.py),
without the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loadtest.benchmarks.engine_profile import PARTS, breakdown, markdown
from worker.step_profile import StepTimers


def test_the_residual_parts_are_what_the_timed_parts_leave():
    seconds = {"step": 1.0, "execute": 0.8, "detokenization": 0.05, "forward": 0.6,
               "matmuls (q/k/v/o, MLP)": 0.3, "attention (paged)": 0.1, "rope": 0.02, "norms": 0.03,
               "lm_head": 0.1, "sampling": 0.05, "step metadata": 0.01}
    ms = breakdown(seconds, steps=10)
    assert ms["step"] == pytest.approx(100.0)
    assert ms["scheduling (Python)"] == pytest.approx(100.0 - 80.0 - 5.0)
    assert ms["model, other"] == pytest.approx(60.0 - 30.0 - 10.0 - 2.0 - 3.0)
    assert ms["lm_head"] == pytest.approx(10.0) and set(PARTS) <= set(ms)


def test_module_timers_count_only_while_on():
    timers = StepTimers()
    layer = nn.Linear(4, 4)
    timers.module_hooks(layer, "matmuls")
    layer(torch.zeros(1, 4))
    assert timers.seconds["matmuls"] == 0.0
    timers.on = True
    layer(torch.zeros(1, 4))
    assert timers.seconds["matmuls"] > 0.0


def test_the_section_has_a_row_per_part_and_a_column_per_profile():
    ms = {part: 1.0 for part in PARTS} | {"step": 10.0}
    result = {"command": "python -m loadtest.benchmarks.engine_profile", "machine": "m", "date": "d", "torch": "2.13.0",
              "torch_threads": 1, "model": "SmolLM2", "dtype": "float32", "weights_bytes": 538e6,
              "weights_read_ms": 40.0,
              "decode": [{"num_seqs": n, "ms_per_step": ms, "plain_ms_per_step": 9.0, "output_tokens_per_s": n * 111.1}
                         for n in (1, 8, 32)],
              "prefill": {"prompt_tokens": 256, "ms_per_step": ms}}
    text = markdown(result)
    for part in PARTS:
        assert f"| {part} | 1.00 (10%) | 1.00 (10%) | 1.00 (10%) | 1.00 (10%) |" in text
    assert "| step without timers | 9.00 | 9.00 | 9.00 | - |" in text
