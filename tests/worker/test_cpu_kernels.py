"""The CPU fast paths of the torch executor against the plain ones they replace: the C paged decode and
prefill attention against the SDPA gather backend and a float64 reference, oneDNN-packed linears against
nn.Linear, and the executor with both against the executor with neither (the transformers checks in
test_torch_executor.py run with both on)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from worker.executor.attention import SdpaPagedAttention, build_step_metadata
from worker.executor.base import SeqChunk, StepBatch
from worker.executor.cpu_attention import (CpuMixedAttention, CpuPagedDecodeAttention, CpuPagedPrefillAttention,
                                           cpu_paged_attention_available, paged_decode_attention,
                                           paged_prefill_attention)
from worker.executor.cpu_linear import PackedLinear, pack_linears, packing_available
from worker.executor.kv_cache import KVCacheSpec, PagedKVCache
from worker.executor.torch_executor import TorchExecutor
from worker.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 64


def decode_batch(context_lens: list[int], rng: random.Random) -> StepBatch:
    """One decode chunk per sequence, each over blocks scattered through the cache."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    chunks = []
    for i, length in enumerate(context_lens):
        table = [free.pop() for _ in range(-(-length // BLOCK_SIZE))]
        chunks.append(SeqChunk(seq_id=i, token_ids=[rng.randrange(100)], start_pos=length - 1, block_table=table,
                               sampling=SamplingParams(temperature=0.0), sample_index=0))
    return StepBatch(chunks=chunks)


def filled_cache(num_kv_heads: int, head_dim: int) -> PagedKVCache:
    cache = PagedKVCache(KVCacheSpec(1, num_kv_heads, head_dim, BLOCK_SIZE), NUM_BLOCKS)
    keys, values = cache.layer(0)
    keys.normal_()
    values.normal_()
    return cache


needs_kernel = pytest.mark.skipif(
    not cpu_paged_attention_available(PagedKVCache(KVCacheSpec(1, 1, 8, BLOCK_SIZE), 1)),
    reason="worker._paged_attention is not built (no C compiler at install)")


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)], ids=["mha", "gqa-3", "mqa"])
@pytest.mark.parametrize("context_lens", [[1], [4, 5, 17, 33], [64, 2, 9]], ids=["one-token", "mixed", "long"])
def test_paged_decode_matches_the_sdpa_gather_backend(heads, kv_heads, context_lens):
    rng = random.Random(sum(context_lens) + heads)
    head_dim = 16
    batch = decode_batch(context_lens, rng)
    meta = build_step_metadata(batch, BLOCK_SIZE, torch.device("cpu"))
    q = torch.randn(len(context_lens), heads, head_dim)
    k, v = torch.randn(len(context_lens), kv_heads, head_dim), torch.randn(len(context_lens), kv_heads, head_dim)
    ours_cache, reference_cache = filled_cache(kv_heads, head_dim), filled_cache(kv_heads, head_dim)
    for mine, theirs in zip(ours_cache.layer(0), reference_cache.layer(0)):
        theirs.copy_(mine)
    ours = CpuPagedDecodeAttention(ours_cache, meta)(0, q, k, v)
    reference = SdpaPagedAttention(reference_cache, meta)(0, q, k, v)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(ours_cache.layer(0), reference_cache.layer(0)):
        assert torch.equal(mine, theirs)  # the new K/V written to the same slots


@needs_kernel
@pytest.mark.parametrize("backend,shapes,seed", [
    # (query tokens, context after the step): a decode, a prefill chunk over a cached prefix, a fresh prompt,
    # another decode
    (CpuMixedAttention, [(1, 30), (6, 13), (9, 9), (1, 5)], 7),
    (CpuPagedPrefillAttention, [(6, 13), (9, 9), (3, 40)], 11),
], ids=["mixed-step", "prefill-only-step"])
def test_a_step_with_prefill_chunks_matches_the_sdpa_gather_backend(backend, shapes, seed):
    rng = random.Random(seed)
    heads, kv_heads, head_dim = 9, 3, 16
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    chunks = [SeqChunk(seq_id=i, token_ids=[rng.randrange(100) for _ in range(n)], start_pos=length - n,
                       block_table=[free.pop() for _ in range(-(-length // BLOCK_SIZE))],
                       sampling=SamplingParams(temperature=0.0))
              for i, (n, length) in enumerate(shapes)]
    batch = StepBatch(chunks=chunks)
    meta = build_step_metadata(batch, BLOCK_SIZE, torch.device("cpu"))
    tokens = sum(n for n, _ in shapes)
    q = torch.randn(tokens, heads, head_dim)
    k, v = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    ours_cache, reference_cache = filled_cache(kv_heads, head_dim), filled_cache(kv_heads, head_dim)
    for mine, theirs in zip(ours_cache.layer(0), reference_cache.layer(0)):
        theirs.copy_(mine)
    ours = backend(ours_cache, batch, meta)(0, q, k, v)
    reference = SdpaPagedAttention(reference_cache, meta)(0, q, k, v)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(ours_cache.layer(0), reference_cache.layer(0)):
        assert torch.equal(mine, theirs)  # the new K/V written to the same slots


@needs_kernel
@pytest.mark.parametrize("query_scale", [0.1, 3.0, 40.0], ids=["flat", "peaked", "underflowing"])
def test_softmax_matches_float64_from_flat_to_scores_whose_exponentials_underflow(query_scale):
    """The kernel's vectorized exp: scores from near-equal to ones whose e^(s - max) is below FLT_MIN."""
    torch.manual_seed(int(query_scale * 10))
    cache = filled_cache(2, 32)
    keys, values = cache.layer(0)
    lens = [3, 8, 61, 200]
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32).view(1, -1).repeat(len(lens), 1)
    q = torch.randn(len(lens), 6, 32) * query_scale
    out = paged_decode_attention(q, keys, values, table, torch.tensor(lens, dtype=torch.int32))
    flat_k = keys[:NUM_BLOCKS].reshape(-1, 2, 32).double().repeat_interleave(3, dim=1)
    flat_v = values[:NUM_BLOCKS].reshape(-1, 2, 32).double().repeat_interleave(3, dim=1)
    for row, length in enumerate(lens):
        scores = torch.einsum("hd,thd->ht", q[row].double(), flat_k[:length]) / 32 ** 0.5
        expected = torch.einsum("ht,thd->hd", scores.softmax(-1), flat_v[:length])
        torch.testing.assert_close(out[row].double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 24), (4, 4, 12)],
                         ids=["smollm2-shape", "dims-of-8", "dims-not-of-8"])
def test_decode_in_16_token_blocks_matches_float64(heads, kv_heads, head_dim):
    """At the engine's block size the scores go 8 rows at a time (head_dim a multiple of 8) and each block
    prefetches the next in its table: full, partial and single-token blocks, scattered through the cache."""
    block_size, num_blocks, lens = 16, 96, [1, 7, 8, 9, 16, 17, 40, 290]
    generator = torch.Generator().manual_seed(head_dim)
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    widest = -(-max(lens) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:widest] for _ in lens]).to(torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=generator)
    out = paged_decode_attention(q, keys, values, tables, torch.tensor(lens, dtype=torch.int32))
    group = heads // kv_heads
    for row, length in enumerate(lens):
        blocks = tables[row, :-(-length // block_size)].long()
        k = keys[blocks].reshape(-1, kv_heads, head_dim)[:length].double().repeat_interleave(group, dim=1)
        v = values[blocks].reshape(-1, kv_heads, head_dim)[:length].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[row].double(), k) / head_dim ** 0.5
        expected = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(out[row].double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_sequence_of_length_zero_yields_zeros():
    cache = filled_cache(2, 8)
    keys, values = cache.layer(0)
    out = paged_decode_attention(torch.randn(2, 4, 8), keys, values, torch.tensor([[3], [5]], dtype=torch.int32),
                                 torch.tensor([0, 2], dtype=torch.int32))
    assert torch.equal(out[0], torch.zeros(4, 8)) and out[1].abs().sum() > 0


@needs_kernel
@pytest.mark.parametrize("table,lens,message", [
    ([[NUM_BLOCKS + 1]], [2], "outside the cache"),
    ([[-1]], [2], "outside the cache"),
    ([[0]], [BLOCK_SIZE + 1], "does not fit its block table"),
], ids=["block-past-the-end", "negative-block", "context-past-the-table"])
def test_a_bad_block_table_raises_instead_of_reading_out_of_bounds(table, lens, message):
    cache = filled_cache(1, 8)
    keys, values = cache.layer(0)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(torch.randn(1, 1, 8), keys, values, torch.tensor(table, dtype=torch.int32),
                               torch.tensor(lens, dtype=torch.int32))


def prefill_inputs(shapes: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
                   rng: random.Random) -> tuple[torch.Tensor, ...]:
    """q, key and value caches, block tables, context and query lengths for sequences of (cached prefix, chunk
    length), each over blocks scattered through a cache with room to spare."""
    blocks_each = [-(-(cached + chunk) // block_size) for cached, chunk in shapes]
    free = list(range(sum(blocks_each) + 7))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_each]
    width = max(blocks_each)
    keys = torch.randn(sum(blocks_each) + 7, block_size, kv_heads, head_dim)
    values = torch.randn_like(keys)
    q = torch.randn(sum(chunk for _, chunk in shapes), heads, head_dim)
    return (q, keys, values, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor([cached + chunk for cached, chunk in shapes], dtype=torch.int32),
            torch.tensor([chunk for _, chunk in shapes], dtype=torch.int32))


def causal_reference(q, keys, values, tables, context_lens, query_lens) -> torch.Tensor:
    """float64: each chunk's token i (position context_len - q_len + i) over keys 0..its position."""
    block_size, kv_heads, head_dim = keys.shape[1:]
    group = q.shape[1] // kv_heads
    outs, row = [], 0
    for table, length, n in zip(tables.tolist(), context_lens.tolist(), query_lens.tolist()):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        k = keys.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
        v = values.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,khd->htk", q[row:row + n].double(), k) / head_dim ** 0.5
        positions = torch.arange(length - n, length)
        scores = scores.masked_fill(torch.arange(length)[None, :] > positions[:, None], float("-inf"))
        outs.append(torch.einsum("htk,khd->thd", scores.softmax(-1), v))
        row += n
    return torch.cat(outs)


PREFILL_SHAPES = {  # (cached prefix, chunk length) per sequence
    "fresh-prompts": [(0, 1), (0, 7), (0, 24), (0, 65)],
    "chunks-after-prefixes": [(5, 1), (13, 30), (64, 64), (3, 100)],
    "long-contexts": [(700, 37), (0, 300), (211, 1)],
}


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 1, 24), (32, 4, 64)],
                         ids=["mha", "gqa-3", "mqa-dim24", "gqa-8"])
@pytest.mark.parametrize("shapes", list(PREFILL_SHAPES.values()), ids=list(PREFILL_SHAPES))
def test_paged_prefill_matches_a_float64_causal_reference(heads, kv_heads, head_dim, shapes):
    rng = random.Random(heads * 100 + len(shapes))
    torch.manual_seed(heads + head_dim)
    inputs = prefill_inputs(shapes, heads, kv_heads, head_dim, block_size=5, rng=rng)
    out = paged_prefill_attention(*inputs)
    torch.testing.assert_close(out.double(), causal_reference(*inputs), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("query_scale,tolerance", [(0.1, 1e-5), (3.0, 1e-5), (40.0, 5e-5)],
                         ids=["flat", "peaked", "underflowing"])
def test_prefill_softmax_holds_from_flat_to_scores_whose_exponentials_underflow(query_scale, tolerance):
    """Scores of magnitude ~40 carry fp32 rounding of ~1e-5 into the weights on their own: fp32 SDPA is off
    the float64 reference by 2e-5 on the underflowing case too."""
    torch.manual_seed(int(query_scale * 10))
    q, *rest = prefill_inputs([(40, 90), (0, 33)], 6, 2, 32, block_size=32, rng=random.Random(3))
    inputs = (q * query_scale, *rest)
    torch.testing.assert_close(paged_prefill_attention(*inputs).double(), causal_reference(*inputs),
                               rtol=tolerance, atol=tolerance)


@needs_kernel
@pytest.mark.parametrize("table,context_lens,query_lens,rows,message", [
    ([[NUM_BLOCKS + 1]], [2], [2], 2, "outside the cache"),
    ([[0, -1]], [6], [3], 3, "outside the cache"),
    ([[0]], [BLOCK_SIZE + 1], [1], 1, "does not fit its block table"),
    ([[0]], [2], [3], 3, "do not fit its context length"),
    ([[0], [1]], [2, 2], [2, 1], 2, "add up to 3, not the 2 query rows"),
], ids=["block-past-the-end", "negative-block", "context-past-the-table", "chunk-past-the-context",
        "rows-disagree"])
def test_a_bad_prefill_table_raises_instead_of_reading_out_of_bounds(table, context_lens, query_lens, rows,
                                                                     message):
    cache = filled_cache(1, 8)
    keys, values = cache.layer(0)
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(torch.randn(rows, 1, 8), keys, values, torch.tensor(table, dtype=torch.int32),
                                torch.tensor(context_lens, dtype=torch.int32),
                                torch.tensor(query_lens, dtype=torch.int32))


@needs_kernel
def test_tensors_of_another_dtype_are_refused():
    cache = filled_cache(1, 8)
    keys, values = cache.layer(0)
    with pytest.raises(ValueError, match="contiguous CPU"):
        paged_decode_attention(torch.randn(1, 1, 8, dtype=torch.float64), keys, values,
                               torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))


@pytest.mark.skipif(not packing_available(torch.float32), reason="torch without oneDNN")
@pytest.mark.parametrize("rows", [1, 8, 33, 256, 300], ids=lambda n: f"rows{n}")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_packed_linear_equals_nn_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_row_counts_fall_into_a_few_buckets():
    """oneDNN caches a kernel per input shape: a step's row count must not create one per value."""
    from worker.executor.cpu_linear import ROW_BUCKETS, TILE_ROWS, padded_rows

    assert {padded_rows(rows) for rows in range(1, TILE_ROWS + 1)} == set(ROW_BUCKETS)
    assert len(ROW_BUCKETS) <= 20
    assert all(padded_rows(rows) >= rows for rows in range(1, TILE_ROWS + 1))


def test_pack_linears_replaces_every_linear_and_keeps_a_tied_embedding():
    model = nn.Module()
    model.embed = nn.Embedding(10, 8)
    model.inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model.head = nn.Linear(8, 10, bias=False)
    model.head.weight = model.embed.weight
    if not packing_available(torch.float32):
        pytest.skip("torch without oneDNN")
    assert pack_linears(model) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.embed.weight, nn.Parameter)


def test_the_executor_with_the_fast_paths_gives_the_tokens_it_gives_without_them(tiny_llama_dir, greedy_driver):
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 384) for _ in range(n)] for n in (3, 9, 14)]

    def run(**options) -> tuple[list[list[int]], TorchExecutor]:
        executor = TorchExecutor.from_pretrained(tiny_llama_dir, block_size=BLOCK_SIZE, num_blocks=128, **options)
        return greedy_driver(executor).generate(prompts, max_new_tokens=10), executor

    fast, fast_executor = run()
    plain, plain_executor = run(pack_weights=False, cpu_paged_attention=False)
    assert fast == plain
    assert fast_executor.packed_weights and not plain_executor.packed_weights
    assert fast_executor.cpu_paged_attention == cpu_paged_attention_available(fast_executor.kv_cache)
