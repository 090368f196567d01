"""Step metadata (slots, block tables, masks) and the SDPA paged-attention backend.

The SDPA backend gathers each sequence's K/V by block table into a padded
[num_seqs, max_ctx, kv_heads, head_dim] tensor and runs one scaled_dot_product_attention call,
with a bottom-right-aligned causal mask: query i of a chunk starting at position p sees keys 0..p+i.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from worker.executor.base import StepBatch
from worker.executor.kv_cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """The tensors one step needs, built once and shared by every layer."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: block_table[pos // B] * B + pos % B
    context_lens: torch.Tensor  # [S] int32: start_pos + query length
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    query_pad_index: torch.Tensor  # [T] long: s * max_query_len + i
    sample_rows: torch.Tensor  # [N] long: the last token of each chunk that samples
    max_query_len: int
    max_context_len: int
    decode_only: bool

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def build_step_metadata(batch: StepBatch, block_size: int, device: torch.device) -> StepMetadata:
    """Flatten the batch's chunks into one token batch (host lists -> one transfer per tensor)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    pad_index: list[int] = []
    sample_rows: list[int] = []
    max_query_len = max(len(c.token_ids) for c in batch.chunks)
    max_blocks = max(-(-(c.start_pos + len(c.token_ids)) // block_size) for c in batch.chunks)
    for s, chunk in enumerate(batch.chunks):
        n = len(chunk.token_ids)
        input_ids.extend(chunk.token_ids)
        chunk_positions = range(chunk.start_pos, chunk.start_pos + n)
        positions.extend(chunk_positions)
        table = chunk.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in chunk_positions)
        pad_index.extend(range(s * max_query_len, s * max_query_len + n))
        if chunk.sampling is not None:
            sample_rows.append(len(input_ids) - 1)
    tables = [c.block_table[:max_blocks] + [0] * (max_blocks - min(max_blocks, len(c.block_table)))
              for c in batch.chunks]
    context_lens = [c.start_pos + len(c.token_ids) for c in batch.chunks]

    def tensor(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return StepMetadata(
        input_ids=tensor(input_ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        context_lens=tensor(context_lens, torch.int32),
        block_tables=tensor(tables, torch.int32),
        query_pad_index=tensor(pad_index),
        sample_rows=tensor(sample_rows),
        max_query_len=max_query_len,
        max_context_len=max(context_lens),
        decode_only=max_query_len == 1,
    )


def causal_padding_mask(meta: StepMetadata) -> torch.Tensor:
    """[S, 1, max_q, max_ctx] bool: key j visible to query i iff j <= start_pos + i.

    Padded query rows (i >= q_len) see what the last real row sees, so they never softmax over
    nothing (their output is dropped); keys past the context length are never visible.
    """
    device = meta.context_lens.device
    context_lens = meta.context_lens.to(torch.long)
    query_lens = torch.bincount(meta.query_pad_index // meta.max_query_len, minlength=meta.num_seqs)
    start = context_lens - query_lens  # [S]
    rows = torch.arange(meta.max_query_len, device=device)
    last_visible = start[:, None] + torch.minimum(rows[None, :], query_lens[:, None] - 1)  # [S, max_q]
    keys = torch.arange(meta.max_context_len, device=device)
    return (keys[None, None, :] <= last_visible[:, :, None])[:, None]


class SdpaPagedAttention:
    """AttentionBackend over a PagedKVCache: write new K/V, gather by block table, one SDPA call."""

    def __init__(self, kv_cache: PagedKVCache, meta: StepMetadata) -> None:
        self.kv_cache = kv_cache
        self.meta = meta
        # One chunk from position 0 (a prompt with nothing cached): plain causal attention, which SDPA runs
        # with its fused kernel; an explicit mask sends it down the slower masked path.
        self.plain_causal = meta.num_seqs == 1 and meta.max_query_len == meta.max_context_len
        self.mask = None if self.plain_causal else causal_padding_mask(meta)

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv_cache.write(layer_index, self.meta.slot_mapping, k, v)
        return self.attention(layer_index, q)

    def attention(self, layer_index: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of this step's queries over the layer's cache (their K/V already written)."""
        meta = self.meta
        keys, values = self.kv_cache.layer(layer_index)
        gathered_k = self._gather(keys)
        gathered_v = self._gather(values)
        num_seqs, max_q = meta.num_seqs, meta.max_query_len
        padded_q = q.new_zeros(num_seqs * max_q, *q.shape[1:])
        padded_q[meta.query_pad_index] = q
        padded_q = padded_q.view(num_seqs, max_q, *q.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(padded_q, gathered_k, gathered_v, attn_mask=self.mask,
                                             is_causal=self.plain_causal, enable_gqa=True)
        return out.transpose(1, 2).reshape(num_seqs * max_q, *q.shape[1:])[meta.query_pad_index]

    def _gather(self, cache: torch.Tensor) -> torch.Tensor:
        """[S, kv_heads, max_ctx, head_dim] K or V of each sequence, in position order."""
        blocks = cache[self.meta.block_tables.to(torch.long)]  # [S, max_blocks, B, H, D]
        num_seqs, max_blocks, block_size, heads, dim = blocks.shape
        flat = blocks.view(num_seqs, max_blocks * block_size, heads, dim)[:, : self.meta.max_context_len]
        return flat.transpose(1, 2)


class PagedDecodeAttention:
    """AttentionBackend for decode-only steps over a kernel that reads the paged cache in place (no
    gather): write the step's new K/V, then kernel(q, key_cache, value_cache, block_tables, context_lens).
    Subclasses name the kernel (cpu_attention.py: C; triton_attention.py: Triton)."""

    kernel: Callable[..., torch.Tensor]

    def __init__(self, kv_cache: PagedKVCache, meta: StepMetadata) -> None:
        self.kv_cache = kv_cache
        self.meta = meta

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv_cache.write(layer_index, self.meta.slot_mapping, k, v)
        keys, values = self.kv_cache.layer(layer_index)
        return type(self).kernel(q.contiguous(), keys, values, self.meta.block_tables, self.meta.context_lens)
