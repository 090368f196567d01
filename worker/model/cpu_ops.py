"""The decoder's small elementwise ops on CPU fp32 in one C call each (worker/_cpu_ops.c), in place of the
several torch ops whose dispatch dominates them at decode's few rows.

norm.py, rope.py and mlp.py take these only where `usable` (or `heads_usable`) holds: the extension built,
the tensors CPU fp32 and contiguous, autograd off (the kernels write through raw pointers, which autograd
would not record); elsewhere (CUDA, bf16, no C compiler at install) their torch code runs.
"""

from __future__ import annotations

import torch

try:
    from worker import _cpu_ops
except ImportError:  # installed without a C compiler
    _cpu_ops = None


def available() -> bool:
    return _cpu_ops is not None


def usable(*tensors: torch.Tensor) -> bool:
    """The fused ops may take these: the extension built, autograd off, each tensor contiguous CPU fp32."""
    if _cpu_ops is None or torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not all(...): this runs per op per layer, and a generator costs ~1 us
        if not (t.is_cpu and t.dtype == torch.float32 and t.is_contiguous()):
            return False
    return True


def heads_usable(*tensors: torch.Tensor) -> bool:
    """As `usable`, for [T, heads, head_dim] tensors whose rows need not be adjacent (views into the fused
    qkv projection): each row's heads contiguous."""
    if _cpu_ops is None or torch.is_grad_enabled():
        return False
    for t in tensors:
        if _heads_row_stride(t) is None:
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2, last dim) + eps), a new tensor shaped as x [..., size]; weight [size]."""
    _check(x, weight)
    size = _norm_size(x, weight)
    out = torch.empty_like(x)
    _cpu_ops.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // size, size, eps)
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual, weight, eps) (vLLM's fused_add_rms_norm)."""
    _check(x, residual, weight)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    size = _norm_size(x, weight)
    _cpu_ops.add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // size, size, eps)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place, the rotate-half rotary embedding: x * cos + cat(-x2, x1) * sin for q [T, heads, head_dim] and
    k [T, kv_heads, head_dim] (each row's heads contiguous), cos and sin [T, head_dim] or [T, 1, head_dim]."""
    _check(cos, sin)
    q_stride, k_stride = _heads_row_stride(q), _heads_row_stride(k)
    if q_stride is None or k_stride is None:
        raise ValueError("rotary needs CPU fp32 q and k [T, heads, head_dim], each row's heads contiguous")
    tokens, heads, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim or head_dim % 2 != 0:
        raise ValueError(f"rotary: q {tuple(q.shape)} and k {tuple(k.shape)} disagree or head_dim is odd")
    for table in (cos, sin):
        if (table.dim() < 2 or table.shape[0] != tokens or table.shape[-1] != head_dim
                or table.numel() != tokens * head_dim):
            raise ValueError(f"rotary: cos/sin {tuple(table.shape)} do not match [{tokens}, {head_dim}]")
    _cpu_ops.rotary(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, k.shape[1],
                    head_dim, q_stride, k_stride)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] [T, 2 * I] (the stacked gate_up_proj): a new [T, I] tensor."""
    _check(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 != 0 or gate_up.shape[1] == 0:
        raise ValueError(f"silu_mul needs gate_up [T, 2 * I], got {tuple(gate_up.shape)}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    _cpu_ops.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter)
    return out


def _check(*tensors: torch.Tensor) -> None:
    """The kernels read raw pointers: anything but contiguous CPU fp32 raises (and a missing build, which
    callers avoid through `usable`)."""
    if _cpu_ops is None:
        raise RuntimeError("worker._cpu_ops is not built (no C compiler at install)")
    for t in tensors:
        if not (t.is_cpu and t.dtype == torch.float32 and t.is_contiguous()):
            raise ValueError(f"the fused CPU ops need contiguous CPU float32 tensors, got {t.dtype} on {t.device}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def _norm_size(x: torch.Tensor, weight: torch.Tensor) -> int:
    size = weight.numel()
    if weight.dim() != 1 or size == 0 or x.dim() == 0 or x.shape[-1] != size:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    return size


def _heads_row_stride(x: torch.Tensor) -> int | None:
    """The distance in floats between the rows of [T, heads, head_dim] x, where each row's heads are
    contiguous and rows do not overlap; else None."""
    if _cpu_ops is None or not x.is_cpu or x.dtype != torch.float32 or x.dim() != 3:
        return None
    tokens, heads, head_dim = x.shape
    row_stride, head_stride, dim_stride = x.stride()
    row = heads * head_dim
    if (head_dim > 1 and dim_stride != 1) or (heads > 1 and head_stride != head_dim):
        return None
    if tokens <= 1:
        return row
    return row_stride if row_stride >= row else None
