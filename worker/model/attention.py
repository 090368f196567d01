"""Self-attention projections (q/k/v fused into one qkv_proj, o_proj; optional bias and per-head q/k
RMSNorm, RoPE).

The attention itself (KV cache writes, paging, masking) is the backend's: the executor passes one in.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from worker.model.config import ModelConfig
from worker.model.norm import RMSNorm
from worker.model.rope import apply_rotary_qk


class AttentionBackend(Protocol):
    """Stores the step's new K/V for a layer and returns attention output [T, heads, head_dim]."""

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.qkv_sizes = (q_size, kv_size, kv_size)
        # One matmul for q, k and v: the checkpoint's q_proj, k_proj, v_proj stacked (loader.py).
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.qkv_sizes), bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary_qk(q, k, cos, sin)
        out = backend(self.layer_index, q, k, v)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
