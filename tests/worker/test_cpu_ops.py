"""The fused CPU fp32 ops (worker/model/cpu_ops.py, worker/_cpu_ops.c) against the torch code they replace in
norm.py, rope.py and mlp.py; their input checks; and the model's torch path where the extension is missing."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from worker.engine.sampling_params import SamplingParams
from worker.executor.base import SeqChunk, StepBatch
from worker.executor.torch_executor import TorchExecutor
from worker.model import cpu_ops
from worker.model.mlp import GatedMLP
from worker.model.norm import RMSNorm
from worker.model.rope import apply_rotary, apply_rotary_qk

needs_extension = pytest.mark.skipif(not cpu_ops.available(),
                                     reason="worker._cpu_ops is not built (no C compiler at install)")


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture
def without_extension(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_cpu_ops", None)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight.copy_(weight)
    return norm._norm(x)


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6) -> None:
    """max |actual - expected| within rel of expected's largest magnitude."""
    assert actual.shape == expected.shape
    if expected.numel() == 0:
        return
    scale = expected.abs().max().item() or 1.0
    assert (actual - expected).abs().max().item() <= rel * scale


NORM_SHAPES = [((1, 576), 1e-5), ((32, 576), 1e-6), ((5, 13), 1e-5), ((7, 3, 64), 1e-6), ((4, 1), 1e-2),
               ((2, 1000), 0.1)]
NORM_IDS = ["decode", "prefill", "odd-size", "per-head", "size-1", "big-eps"]


@needs_extension
@pytest.mark.parametrize("shape,eps", NORM_SHAPES, ids=NORM_IDS)
def test_rms_norm_matches_torch(shape, eps):
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    out = cpu_ops.rms_norm(x, weight, eps)
    assert out.shape == x.shape
    assert_close_relative(out, torch_rms_norm(x, weight, eps))


@needs_extension
@pytest.mark.parametrize("shape,eps", NORM_SHAPES, ids=NORM_IDS)
def test_add_rms_norm_adds_into_the_residual_and_normalizes_the_sum_in_place(shape, eps):
    gen = torch.Generator().manual_seed(shape[0])
    x, residual = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 10
    weight = torch.randn(shape[-1], generator=gen)
    total = x + residual
    cpu_ops.add_rms_norm_(x, residual, weight, eps)
    assert torch.equal(residual, total)
    assert_close_relative(x, torch_rms_norm(total, weight, eps))


def cos_sin(tokens: int, head_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, head_dim] as RotaryEmbedding.cos_sin makes them, for random positions."""
    freqs = torch.randint(0, 4096, (tokens, 1), generator=gen).float() * torch.rand(head_dim // 2, generator=gen)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


@needs_extension
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (32, 9, 3, 64), (5, 4, 1, 6),
                                                             (3, 2, 2, 18), (0, 9, 3, 64)],
                         ids=["decode", "prefill", "mqa-tail", "tail-only", "no-tokens"])
def test_rotary_rotates_q_and_k_views_of_the_qkv_projection_in_place(tokens, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens + head_dim)
    sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    qkv = torch.randn(tokens, sum(sizes), generator=gen)
    q, k, v = (t.view(tokens, n, head_dim) for t, n in zip(qkv.split(sizes, dim=-1), (heads, kv_heads, kv_heads)))
    cos, sin = cos_sin(tokens, head_dim, gen)
    expected_q, expected_k, v_before = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()
    cpu_ops.rotary_(q, k, cos, sin)
    assert_close_relative(q, expected_q)
    assert_close_relative(k, expected_k)
    assert torch.equal(v, v_before)


@needs_extension
@pytest.mark.parametrize("rows,inter", [(1, 1536), (32, 1536), (3, 37), (2, 5)],
                         ids=["decode", "prefill", "odd-size", "tail-only"])
def test_silu_mul_matches_torch_over_the_stacked_gate_and_up(rows, inter):
    gen = torch.Generator().manual_seed(rows * inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 8
    gate_up[0, :4] = torch.tensor([-100.0, -88.5, 30.0, 0.0])  # exp(-gate) overflowing, large, zero
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close_relative(cpu_ops.silu_mul(gate_up), F.silu(gate) * up)


BAD_INPUTS = {
    "bf16": lambda: cpu_ops.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), 1e-5),
    "not-contiguous": lambda: cpu_ops.rms_norm(torch.ones(8, 2).t(), torch.ones(8), 1e-5),
    "weight-size": lambda: cpu_ops.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5),
    "residual-shape": lambda: cpu_ops.add_rms_norm_(torch.ones(2, 8), torch.ones(3, 8), torch.ones(8), 1e-5),
    "float64-residual": lambda: cpu_ops.add_rms_norm_(torch.ones(2, 8), torch.ones(2, 8, dtype=torch.float64),
                                                      torch.ones(8), 1e-5),
    "odd-head-dim": lambda: cpu_ops.rotary_(torch.ones(1, 2, 5), torch.ones(1, 1, 5), torch.ones(1, 5),
                                            torch.ones(1, 5)),
    "heads-not-contiguous": lambda: cpu_ops.rotary_(torch.ones(1, 4, 2).transpose(1, 2), torch.ones(1, 1, 4),
                                                    torch.ones(1, 4), torch.ones(1, 4)),
    "cos-tokens": lambda: cpu_ops.rotary_(torch.ones(2, 2, 4), torch.ones(2, 1, 4), torch.ones(1, 4),
                                          torch.ones(1, 4)),
    "cos-scalar": lambda: cpu_ops.rotary_(torch.ones(1, 2, 4), torch.ones(1, 1, 4), torch.tensor(1.0),
                                          torch.tensor(1.0)),
    "k-tokens": lambda: cpu_ops.rotary_(torch.ones(2, 2, 4), torch.ones(3, 1, 4), torch.ones(2, 4),
                                        torch.ones(2, 4)),
    "odd-gate-up": lambda: cpu_ops.silu_mul(torch.ones(2, 7)),
    "gate-up-3d": lambda: cpu_ops.silu_mul(torch.ones(1, 2, 8)),
}


@needs_extension
@pytest.mark.parametrize("call", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_inputs_the_kernels_cannot_read_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


@needs_extension
def test_the_model_takes_the_fused_ops_only_for_contiguous_cpu_fp32_without_autograd():
    x = torch.ones(2, 8)
    assert cpu_ops.usable(x)
    assert not cpu_ops.usable(x.to(torch.bfloat16))
    assert not cpu_ops.usable(torch.ones(8, 2).t())
    with torch.enable_grad():
        assert not cpu_ops.usable(x)


def test_without_the_extension_the_modules_run_their_torch_code_and_leave_inputs_alone(without_extension):
    assert not cpu_ops.available() and not cpu_ops.usable(torch.ones(2))
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(16, 1e-5)
    norm.weight.copy_(torch.randn(16, generator=gen))
    x, residual = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x_before + residual_before)
    assert torch.equal(normed, norm._norm(x_before + residual_before))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)

    q, k = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    cos, sin = cos_sin(3, 8, gen)
    q_before = q.clone()
    rotated_q, rotated_k = apply_rotary_qk(q, k, cos, sin)
    assert torch.equal(rotated_q, apply_rotary(q_before, cos, sin)) and torch.equal(q, q_before)

    mlp = GatedMLP(16, 24, bias=False)
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    assert torch.equal(mlp(x), mlp.down_proj(F.silu(gate) * up))


def last_logits(model_dir) -> torch.Tensor:
    executor = TorchExecutor.from_pretrained(model_dir, block_size=4, num_blocks=8)
    chunk = SeqChunk(0, [5, 17, 200, 33, 91, 4, 250], 0, [0, 1], SamplingParams(temperature=0.0))
    return executor.forward_logits(StepBatch([chunk]))[0]


@needs_extension
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"], ids=["llama", "qwen3-qk-norm"])
def test_model_logits_with_the_fused_ops_match_the_torch_path(request, monkeypatch, fixture):
    model_dir = request.getfixturevalue(fixture)
    calls: list[str] = []
    for name in ("rms_norm", "add_rms_norm_", "rotary_", "silu_mul"):
        original = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    fused = last_logits(model_dir)
    assert set(calls) >= {"add_rms_norm_", "rotary_", "silu_mul"}
    monkeypatch.setattr(cpu_ops, "_cpu_ops", None)
    assert_close_relative(fused, last_logits(model_dir), rel=1e-5)
