"""Triton paged-decode attention (CUDA): one query token per sequence, K/V read through the block table.

Grid (num_seqs, num_heads); each program streams its sequence's context in tiles of BLOCK_N
tokens with an online softmax in fp32. A sequence with context length 0 (CUDA-graph padding)
yields zeros. Import is guarded: `triton_available()` is False without CUDA or triton.
"""

from __future__ import annotations

import torch

from worker.executor.attention import PagedDecodeAttention

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr,
        scale,
        stride_q_tok, stride_q_head,
        stride_o_tok, stride_o_head,
        stride_k_block, stride_k_off, stride_k_head,
        stride_v_block, stride_v_off, stride_v_head,
        stride_bt_seq,
        QUERIES_PER_KV: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // QUERIES_PER_KV
        context_len = tl.load(context_lens_ptr + seq)
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_q_tok + head * stride_q_head + dims, mask=dim_mask, other=0.0)
        q = q.to(tl.float32) * scale
        m_i = tl.full([1], float("-inf"), tl.float32)
        l_i = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        offsets = tl.arange(0, BLOCK_N)
        for start in range(0, context_len, BLOCK_N):
            pos = start + offsets
            valid = pos < context_len
            block = tl.load(block_tables_ptr + seq * stride_bt_seq + pos // BLOCK_SIZE, mask=valid, other=0)
            block = block.to(tl.int64)  # block * stride overflows int32 in large caches
            within = pos % BLOCK_SIZE
            k_off = block[:, None] * stride_k_block + within[:, None] * stride_k_off + kv_head * stride_k_head
            v_off = block[:, None] * stride_v_block + within[:, None] * stride_v_off + kv_head * stride_v_head
            kv_mask = valid[:, None] & dim_mask[None, :]
            k = tl.load(k_ptr + k_off + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1)
            scores = tl.where(valid, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            p = tl.exp(scores - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + v_off + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe
        tl.store(out_ptr + seq * stride_o_tok + head * stride_o_head + dims,
                 out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """q [S, heads, D] (one token per sequence) -> [S, heads, D]; caches [blocks, B, kv_heads, D]."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(q)
    scale = head_dim**-0.5 if scale is None else scale
    _paged_decode_kernel[(num_seqs, num_heads)](
        out, q, key_cache, value_cache, block_tables, context_lens,
        scale,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=64,
    )
    return out


class TritonPagedDecodeAttention(PagedDecodeAttention):
    """AttentionBackend for decode-only steps on CUDA: the Triton kernel."""

    kernel = staticmethod(paged_decode_attention)
