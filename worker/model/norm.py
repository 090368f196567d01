"""RMSNorm, computed in fp32 and cast back as transformers' Llama does; optionally with the decoder's residual
add first. On CPU fp32 one fused C call does either (cpu_ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from worker.model import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); given residual, (RMSNorm(x + residual), x + residual), the sum being the decoder's new
        residual stream. The fused CPU path updates x and residual in place and returns them."""
        if residual is None:
            if cpu_ops.usable(x, self.weight):
                return cpu_ops.rms_norm(x, self.weight, self.eps)
            return self._norm(x)
        if cpu_ops.usable(x, residual, self.weight):
            cpu_ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
