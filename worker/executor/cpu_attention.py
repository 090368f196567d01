"""Paged attention on CPU without a gathered copy: the C kernels in worker/_paged_attention.c.

The SDPA backend copies every sequence's K/V into one padded tensor per layer per step; at 32
sequences of a few hundred tokens that copy, its mask and SDPA's grouped-query expansion were half of a
decode step. These backends write the step's new K/V, then read each sequence's context through its
block table, with no gathered copy: decodes through the decode kernel (once for all heads), prefill chunks
through the tiled causal prefill kernel (about twice SDPA's speed on one thread). A step that mixes decodes
with prefill chunks sends each kind to its kernel (CpuMixedAttention). fp32 only; the executor falls back
to SDPA where `cpu_paged_attention_available` is False (no compiler at install, other dtypes).
"""

from __future__ import annotations

import math

import torch

from worker.executor.attention import PagedDecodeAttention, StepMetadata, build_step_metadata
from worker.executor.base import StepBatch
from worker.executor.kv_cache import PagedKVCache

try:
    from worker import _paged_attention
except ImportError:  # installed without a C compiler
    _paged_attention = None


def cpu_paged_attention_available(kv_cache: PagedKVCache) -> bool:
    return _paged_attention is not None and kv_cache.device.type == "cpu" and kv_cache.spec.dtype == torch.float32


def _check_kernel_inputs(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, *lengths: torch.Tensor) -> None:
    """The kernels trust dtypes, devices and layouts (they take raw pointers); they check block ids and lengths."""
    num_seqs = block_tables.shape[0]
    if (value_cache.shape != key_cache.shape or key_cache.shape[3] != q.shape[2]
            or any(n.shape != (num_seqs,) for n in lengths)):
        raise ValueError("paged attention: shapes of q, caches, block tables and context lengths disagree")
    tensors = [(q, torch.float32), (key_cache, torch.float32), (value_cache, torch.float32),
               (block_tables, torch.int32)] + [(n, torch.int32) for n in lengths]
    for tensor, dtype in tensors:
        if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"paged attention needs contiguous CPU {dtype} tensors, got {tensor.dtype} "
                             f"on {tensor.device}")


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """out [S, heads, head_dim] for one query token per sequence, q [S, heads, head_dim], caches
    [blocks, block_size, kv_heads, head_dim], block_tables [S, max_blocks] int32, context_lens [S] int32."""
    q = q.contiguous()
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError("paged attention: shapes of q, caches, block tables and context lengths disagree")
    _check_kernel_inputs(q, key_cache, value_cache, block_tables, context_lens)
    num_seqs, num_heads, head_dim = q.shape
    cache_blocks, block_size, kv_heads, _ = key_cache.shape
    out = torch.empty_like(q)
    _paged_attention.decode(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
                            context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, kv_heads, head_dim,
                            block_size, block_tables.shape[1], cache_blocks, 1.0 / math.sqrt(head_dim))
    return out


def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            query_lens: torch.Tensor) -> torch.Tensor:
    """out [T, heads, head_dim] for chunks of query tokens, q [T, heads, head_dim]: sequence s owns the
    query_lens[s] rows after those of sequences before it, its tokens at positions [context_lens[s] -
    query_lens[s], context_lens[s]), each attending causally over its context (the chunk's K/V already in the
    cache). Caches [blocks, block_size, kv_heads, head_dim], block_tables [S, max_blocks] int32, context_lens
    and query_lens [S] int32."""
    q = q.contiguous()
    _check_kernel_inputs(q, key_cache, value_cache, block_tables, context_lens, query_lens)
    num_tokens, num_heads, head_dim = q.shape
    cache_blocks, block_size, kv_heads, _ = key_cache.shape
    out = torch.empty_like(q)
    _paged_attention.prefill(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
                             context_lens.data_ptr(), query_lens.data_ptr(), out.data_ptr(), block_tables.shape[0],
                             num_tokens, num_heads, kv_heads, head_dim, block_size, block_tables.shape[1],
                             cache_blocks, 1.0 / math.sqrt(head_dim))
    return out


def _query_lens(batch: StepBatch, device: torch.device) -> torch.Tensor:
    return torch.tensor([len(c.token_ids) for c in batch.chunks], dtype=torch.int32, device=device)


class CpuPagedDecodeAttention(PagedDecodeAttention):
    """AttentionBackend for decode-only steps on CPU: the C decode kernel."""

    kernel = staticmethod(paged_decode_attention)


class CpuPagedPrefillAttention:
    """AttentionBackend for a CPU step of prefill chunks only: the C prefill kernel over every chunk."""

    def __init__(self, kv_cache: PagedKVCache, batch: StepBatch, meta: StepMetadata) -> None:
        self.kv_cache = kv_cache
        self.meta = meta
        self.query_lens = _query_lens(batch, meta.input_ids.device)

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv_cache.write(layer_index, self.meta.slot_mapping, k, v)
        keys, values = self.kv_cache.layer(layer_index)
        return paged_prefill_attention(q, keys, values, self.meta.block_tables, self.meta.context_lens,
                                       self.query_lens)


class CpuMixedAttention:
    """AttentionBackend for a CPU step with decodes and prefill chunks: the decodes through the decode kernel,
    the prefill chunks through the prefill kernel, each over the block tables of its own sequences (the
    prefill kernel's tiles would be mostly idle on a single query, and it repacks the whole context per step)."""

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
        self.prefill_meta = build_step_metadata(prefills, block_size, device)
        self.prefill_query_lens = _query_lens(prefills, device)

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv_cache.write(layer_index, self.meta.slot_mapping, k, v)
        keys, values = self.kv_cache.layer(layer_index)
        out = torch.empty_like(q)
        out[self.decode_rows] = paged_decode_attention(q[self.decode_rows], keys, values,
                                                       self.decode_meta.block_tables, self.decode_meta.context_lens)
        out[self.prefill_rows] = paged_prefill_attention(q[self.prefill_rows], keys, values,
                                                         self.prefill_meta.block_tables,
                                                         self.prefill_meta.context_lens, self.prefill_query_lens)
        return out
