"""The torch executor driven with hand-built StepBatches, checked token-for-token against transformers."""

from __future__ import annotations

import random

import pytest
import torch
import transformers  # noqa: F401  (the reference; a test dependency, so a broken install fails here)

from worker.engine.sampling_params import SamplingParams
from worker.executor.base import SeqChunk, StepBatch
from worker.executor.kv_cache import KVCacheSpec, PagedKVCache
from worker.executor.torch_executor import TorchExecutor, TorchExecutorConfig

GREEDY = SamplingParams(temperature=0.0)
BLOCK_SIZE = 4


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 384) for _ in range(length)]


def executor_for(model_dir, **options) -> TorchExecutor:
    return TorchExecutor.from_pretrained(model_dir, block_size=BLOCK_SIZE, num_blocks=128, **options)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_tied_llama3_dir"],
                         ids=["llama-gqa", "qwen2-bias", "qwen3-qk-norm", "tied-llama3-rope"])
def test_single_request_greedy_equals_transformers_generate(request, fixture, hf_reference, greedy_driver):
    model_dir = request.getfixturevalue(fixture)
    ids = prompt(11, seed=1)
    out = greedy_driver(executor_for(model_dir)).generate([ids], max_new_tokens=12)
    assert out == [hf_reference.greedy(model_dir, ids, 12)]


def test_mixed_length_requests_batched_in_one_step_equal_generate(tiny_llama_dir, hf_reference, greedy_driver):
    prompts = [prompt(n, seed=n) for n in (1, 3, 8, 13, 20)]
    outputs = greedy_driver(executor_for(tiny_llama_dir)).generate(prompts, max_new_tokens=8)
    assert outputs == [hf_reference.greedy(tiny_llama_dir, p, 8) for p in prompts]


@pytest.mark.parametrize("chunk_size", [1, 3, 5], ids=lambda n: f"chunk{n}")
def test_chunked_prefill_mixed_with_decodes_equals_generate(tiny_llama_dir, hf_reference, greedy_driver,
                                                            chunk_size):
    prompts = [prompt(n, seed=10 + n) for n in (2, 9, 17)]
    outputs = greedy_driver(executor_for(tiny_llama_dir), chunk_size=chunk_size).generate(prompts, 6)
    assert outputs == [hf_reference.greedy(tiny_llama_dir, p, 6) for p in prompts]


@pytest.mark.parametrize("cached_tokens", [8, 10], ids=["block-boundary", "mid-block-copied"])
def test_second_request_reuses_cached_prefix_blocks(tiny_llama_dir, hf_reference, greedy_driver, cached_tokens):
    executor = executor_for(tiny_llama_dir)
    driver = greedy_driver(executor)
    shared = prompt(13, seed=3)
    driver.generate([shared], max_new_tokens=1)
    second = shared[:cached_tokens] + prompt(7, seed=4)
    full_blocks = cached_tokens // BLOCK_SIZE
    table = driver.block_tables[0][:full_blocks]
    if cached_tokens % BLOCK_SIZE:  # copy-on-write of the partly shared block
        src, dst = driver.block_tables[0][full_blocks], driver.free_blocks.pop(0)
        for keys, values in zip(executor.kv_cache.key_cache, executor.kv_cache.value_cache, strict=True):
            keys[dst], values[dst] = keys[src], values[src]
        table.append(dst)
    driver.block_tables[1] = table
    outputs = driver.generate([second], max_new_tokens=6, start_positions=[cached_tokens], seq_ids=[1])
    assert outputs[0] == hf_reference.greedy(tiny_llama_dir, second, 6)


def test_last_step_logits_match_transformers(tiny_llama_dir, hf_reference, greedy_driver):
    executor = executor_for(tiny_llama_dir)
    driver = greedy_driver(executor)
    ids = prompt(9, seed=5)
    out = driver.generate([ids], max_new_tokens=4)[0]
    tokens = ids + out
    table = driver.ensure_blocks(0, len(tokens))
    batch = StepBatch([SeqChunk(0, [tokens[-1]], len(tokens) - 1, table, GREEDY, 4)])
    logits = executor.forward_logits(batch)
    assert logits.shape == (1, 384) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], hf_reference.last_logits(tiny_llama_dir, tokens), atol=1e-4, rtol=0)


def test_only_chunks_with_sampling_return_tokens(tiny_llama_dir):
    executor = executor_for(tiny_llama_dir)
    batch = StepBatch([SeqChunk(0, prompt(6, 1), 0, [0, 1]), SeqChunk(1, prompt(3, 2), 0, [2], GREEDY),
                       SeqChunk(2, prompt(5, 3), 0, [3, 4])])
    assert len(executor.execute(batch)) == 1
    assert executor.forward_logits(batch).shape == (1, 384)
    assert executor.execute(StepBatch([])) == []


@pytest.mark.parametrize("chunk, message", [
    (SeqChunk(0, [5, 6, 7, 8, 9], 0, [0]), "block_table"),
    (SeqChunk(0, [5], 0, [500]), "out of range"),
    (SeqChunk(0, [], 0, [0]), ">= 1 token"),
], ids=["table-too-short", "block-out-of-range", "empty-chunk"])
def test_invalid_chunks_are_rejected_with_a_clear_error(tiny_llama_dir, chunk, message):
    with pytest.raises(ValueError, match=message):
        executor_for(tiny_llama_dir).execute(StepBatch([chunk]))


def test_executor_reports_its_shape(tiny_llama_dir):
    executor = TorchExecutor.from_pretrained(tiny_llama_dir, block_size=16, num_blocks=8, max_model_len=100)
    assert (executor.name, executor.block_size, executor.num_blocks, executor.max_model_len) == ("torch", 16, 8, 100)
    assert executor.kv_cache.key_cache[0].shape == (8, 16, 2, 16)
    assert len(executor.kv_cache.value_cache) == 2


def test_kv_cache_size_from_a_byte_budget(tiny_llama_dir):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)
    assert spec.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    executor = TorchExecutor.from_pretrained(tiny_llama_dir, block_size=16, kv_cache_bytes=11 * spec.bytes_per_block)
    assert executor.num_blocks == 10  # one block is the scratch block
    cache = PagedKVCache(spec, num_blocks=3)
    assert cache.scratch_slot == 48 and cache.key_cache[1].shape == (3, 16, 2, 16)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="executor.dtype"):
        TorchExecutorConfig(model_dir="x", dtype="int8")
    with pytest.raises(ValueError, match="executor.block_size"):
        TorchExecutorConfig(model_dir="x", block_size=0)


def test_seeded_sampling_is_independent_of_batch_composition(tiny_llama_dir, greedy_driver):
    seeded = SamplingParams(temperature=1.5, top_p=0.9, seed=7)
    alone = greedy_driver(executor_for(tiny_llama_dir)).generate([prompt(5, 9)], 8, params=seeded)[0]
    batched = greedy_driver(executor_for(tiny_llama_dir)).generate([prompt(12, 8), prompt(5, 9)], 8, params=seeded)
    assert batched[1] == alone
