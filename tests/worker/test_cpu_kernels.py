"""The CPU fast paths of the torch executor against the plain ones they replace: the C paged decode
attention against the SDPA gather backend, oneDNN-packed linears against nn.Linear, and the executor
with both against the executor with neither (the transformers checks in test_torch_executor.py run
with both on)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from worker.executor.attention import SdpaPagedAttention, build_step_metadata
from worker.executor.base import SeqChunk, StepBatch
from worker.executor.cpu_attention import (CpuMixedAttention, CpuPagedDecodeAttention, cpu_decode_available,
                                           paged_decode_attention)
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
    not cpu_decode_available(PagedKVCache(KVCacheSpec(1, 1, 8, BLOCK_SIZE), 1)),
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
def test_a_step_mixing_decodes_and_prefill_chunks_matches_the_sdpa_gather_backend():
    rng = random.Random(7)
    heads, kv_heads, head_dim = 9, 3, 16
    # (query tokens, context after the step): a decode, a prefill chunk over a cached prefix, a fresh prompt,
    # another decode.
    shapes = [(1, 30), (6, 13), (9, 9), (1, 5)]
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
    ours = CpuMixedAttention(ours_cache, batch, meta)(0, q, k, v)
    reference = SdpaPagedAttention(reference_cache, meta)(0, q, k, v)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


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
    assert fast_executor.cpu_paged_attention == cpu_decode_available(fast_executor.kv_cache)
