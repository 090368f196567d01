"""SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up as one matmul (gate_up_proj); silu(gate) * up in one
fused C call on CPU fp32 (cpu_ops.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from worker.model import cpu_ops


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        # The checkpoint's gate_proj and up_proj stacked (loader.py).
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_ops.usable(gate_up) and gate_up.dim() == 2:
            return self.down_proj(cpu_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
