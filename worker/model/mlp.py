"""SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up as one matmul (gate_up_proj)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        # The checkpoint's gate_proj and up_proj stacked (loader.py).
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
