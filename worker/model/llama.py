"""The Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3) over a flat batch of tokens.

Parameter names match Hugging Face checkpoints except two fused projections, which the loader stacks
from the checkpoint's tensors: self_attn.qkv_proj (q_proj, k_proj, v_proj) and mlp.gate_up_proj
(gate_proj, up_proj).

The residual stream runs beside the layers' outputs (as in vLLM): each norm adds the last sublayer's output
into it and normalizes the sum, one fused call on CPU fp32 (norm.py).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.model.attention import AttentionBackend, SelfAttention
from worker.model.config import ModelConfig
from worker.model.mlp import GatedMLP
from worker.model.norm import RMSNorm
from worker.model.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, layer_index)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: tuple[torch.Tensor, torch.Tensor],
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream): x is the last layer's MLP output to add into residual, or, with
        residual None, the embeddings (the first layer)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)


class LlamaForCausalLM(nn.Module):
    """forward(token ids [T], positions [T], backend) -> final hidden states [T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        cos_sin = self.model.rotary_emb.cos_sin(positions, x.dtype)
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos_sin, backend)
        return self.model.norm(x, residual)[0]  # config.num_layers >= 1: residual is a tensor

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32 for the given rows of final hidden states."""
        return self.lm_head(hidden).to(torch.float32)
