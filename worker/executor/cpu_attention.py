"""Paged decode attention on CPU without a gathered copy: the C kernel in worker/_paged_attention.c.

The SDPA backend copies every sequence's K/V into one padded tensor per layer per step; at 32
sequences of a few hundred tokens that copy, its mask and SDPA's grouped-query expansion were half of a
decode step. This backend writes the step's new K/V, then reads each sequence's context in place
through its block table, once for all heads. A step that mixes decodes with prefill chunks sends the
decodes here and only the prefill chunks through SDPA (CpuMixedAttention). fp32 only; the executor
falls back to SDPA where `cpu_decode_available` is False (no compiler at install, other dtypes).
"""

from __future__ import annotations

import math

import torch

from worker.executor.attention import PagedDecodeAttention, SdpaPagedAttention, StepMetadata, build_step_metadata
from worker.executor.base import StepBatch
from worker.executor.kv_cache import PagedKVCache

try:
    from worker import _paged_attention
except ImportError:  # installed without a C compiler
    _paged_attention = None


def cpu_decode_available(kv_cache: PagedKVCache) -> bool:
    return _paged_attention is not None and kv_cache.device.type == "cpu" and kv_cache.spec.dtype == torch.float32


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """out [S, heads, head_dim] for one query token per sequence, q [S, heads, head_dim], caches
    [blocks, block_size, kv_heads, head_dim], block_tables [S, max_blocks] int32, context_lens [S] int32."""
    q = q.contiguous()
    num_seqs, num_heads, head_dim = q.shape
    cache_blocks, block_size, kv_heads, cache_dim = key_cache.shape
    if (value_cache.shape != key_cache.shape or cache_dim != head_dim or block_tables.shape[0] != num_seqs
            or context_lens.shape != (num_seqs,)):
        raise ValueError("paged attention: shapes of q, caches, block tables and context lengths disagree")
    for tensor, dtype in ((q, torch.float32), (key_cache, torch.float32), (value_cache, torch.float32),
                          (block_tables, torch.int32), (context_lens, torch.int32)):
        if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"paged attention needs contiguous CPU {dtype} tensors, got {tensor.dtype} "
                             f"on {tensor.device}")
    out = torch.empty_like(q)
    _paged_attention.decode(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
                            context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, kv_heads, head_dim,
                            block_size, block_tables.shape[1], cache_blocks, 1.0 / math.sqrt(head_dim))
    return out


class CpuPagedDecodeAttention(PagedDecodeAttention):
    """AttentionBackend for decode-only steps on CPU: the C kernel."""

    kernel = staticmethod(paged_decode_attention)


class CpuMixedAttention:
    """AttentionBackend for a CPU step with decodes and prefill chunks: the decodes through the C kernel,
    the prefill chunks through SDPA over a gather of their own sequences only. One SDPA call over the
    whole batch would pad every decode's single query to the longest chunk and gather every context."""

    def __init__(self, kv_cache: PagedKVCache, batch: StepBatch, meta: StepMetadata) -> None:
        self.kv_cache = kv_cache
        self.meta = meta
        device = meta.input_ids.device
        decode_rows, prefill_rows, row = [], [], 0
        for chunk in batch.chunks:
            rows = range(row, row + len(chunk.token_ids))
            (decode_rows if len(chunk.token_ids) == 1 else prefill_rows).extend(rows)
            row += len(chunk.token_ids)
        decodes = StepBatch([c for c in batch.chunks if len(c.token_ids) == 1])
        prefills = StepBatch([c for c in batch.chunks if len(c.token_ids) > 1])
        block_size = kv_cache.block_size
        self.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        self.prefill_rows = torch.tensor(prefill_rows, dtype=torch.long, device=device)
        self.decode_meta = build_step_metadata(decodes, block_size, device)
        self.prefill = SdpaPagedAttention(kv_cache, build_step_metadata(prefills, block_size, device))

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv_cache.write(layer_index, self.meta.slot_mapping, k, v)
        keys, values = self.kv_cache.layer(layer_index)
        out = torch.empty_like(q)
        out[self.decode_rows] = paged_decode_attention(q[self.decode_rows], keys, values,
                                                       self.decode_meta.block_tables, self.decode_meta.context_lens)
        out[self.prefill_rows] = self.prefill.attention(layer_index, q[self.prefill_rows])
        return out

