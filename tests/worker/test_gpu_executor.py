"""The CUDA path: the Triton paged-decode kernel and CUDA-graph decode, against SDPA and transformers.

Every test needs a CUDA device and triton; without them the module is skipped.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn import functional as F

from worker.engine.sampling_params import SamplingParams
from worker.executor.base import SeqChunk, StepBatch
from worker.executor.torch_executor import TorchExecutor

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

import transformers  # noqa: E402,F401  (the reference; a test dependency, so a broken install fails here)

from worker.executor.triton_attention import paged_decode_attention  # noqa: E402

BLOCK_SIZE = 4


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 384) for _ in range(length)]


def reference_decode(q, keys, values, tables, lens):
    """Plain attention of each sequence's one query over its gathered context."""
    outs = []
    for s, n in enumerate(lens.tolist()):
        blocks = tables[s, : -(-n // keys.shape[1])].long()
        k = keys[blocks].flatten(0, 1)[:n].transpose(0, 1).float()
        v = values[blocks].flatten(0, 1)[:n].transpose(0, 1).float()
        outs.append(F.scaled_dot_product_attention(q[s][:, None].float(), k, v, enable_gqa=True)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80], ids=["d64", "d80"])
def test_triton_paged_decode_matches_gathered_attention(dtype, atol, head_dim):
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, heads = 64, 16, 2, 8
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    values = torch.randn_like(keys)
    lens = torch.tensor([1, 15, 16, 17, 200, 333], dtype=torch.int32, device="cuda")
    tables = torch.stack([torch.randperm(num_blocks, device="cuda")[:24] for _ in lens]).to(torch.int32)
    q = torch.randn(len(lens), heads, head_dim, device="cuda", dtype=dtype)
    out = paged_decode_attention(q, keys, values, tables, lens)
    torch.testing.assert_close(out.float(), reference_decode(q, keys, values, tables, lens), atol=atol, rtol=0)


def test_context_length_zero_rows_come_back_as_zeros():
    keys = torch.randn(4, 4, 1, 16, device="cuda")
    out = paged_decode_attention(torch.randn(2, 2, 16, device="cuda"), keys, keys,
                                 torch.zeros(2, 3, dtype=torch.int32, device="cuda"),
                                 torch.tensor([0, 3], dtype=torch.int32, device="cuda"))
    assert torch.count_nonzero(out[0]) == 0 and torch.isfinite(out).all()


def cuda_executor(model_dir, **options) -> TorchExecutor:
    return TorchExecutor.from_pretrained(model_dir, device="cuda", dtype="float32", block_size=BLOCK_SIZE,
                                         num_blocks=256, max_graph_batch_size=16, **options)


@pytest.mark.parametrize("options", [{}, {"use_cuda_graphs": False}, {"use_triton": False}],
                         ids=["triton+graphs", "triton-eager", "sdpa"])
def test_cuda_greedy_batch_equals_transformers(tiny_llama_dir, hf_reference, greedy_driver, options):
    prompts = [prompt(n, seed=n) for n in (1, 4, 9, 13, 20)]  # 5 decodes pad to a graph of 8
    executor = cuda_executor(tiny_llama_dir, **options)
    outputs = greedy_driver(executor, chunk_size=6).generate(prompts, 10)
    assert outputs == [hf_reference.greedy(tiny_llama_dir, p, 10) for p in prompts]
    assert executor.use_triton == options.get("use_triton", True)
    assert (executor.num_cuda_graphs > 0) == (options == {})


def test_cuda_graph_batch_sizes_and_padding(tiny_qwen3_dir, hf_reference, greedy_driver):
    executor = cuda_executor(tiny_qwen3_dir)
    for count in (1, 3, 16):
        prompts = [prompt(3 + i, seed=100 + i) for i in range(count)]
        outputs = greedy_driver(executor).generate(prompts, 5)
        assert outputs == [hf_reference.greedy(tiny_qwen3_dir, p, 5) for p in prompts], count
        executor = cuda_executor(tiny_qwen3_dir)  # a fresh cache for the next size


def test_cuda_decode_logits_match_transformers(tiny_qwen2_dir, hf_reference, greedy_driver):
    executor = cuda_executor(tiny_qwen2_dir)
    driver = greedy_driver(executor)
    ids = prompt(9, seed=5)
    tokens = ids + driver.generate([ids], max_new_tokens=4)[0]
    table = driver.ensure_blocks(0, len(tokens))
    chunk = SeqChunk(0, [tokens[-1]], len(tokens) - 1, table, SamplingParams(temperature=0.0), 4)
    logits = executor.forward_logits(StepBatch([chunk]))[0].cpu()
    torch.testing.assert_close(logits, hf_reference.last_logits(tiny_qwen2_dir, tokens), atol=1e-4, rtol=0)


def test_bf16_executor_tracks_fp32(tiny_llama_dir, greedy_driver):
    ids = prompt(12, seed=3)
    batch = StepBatch([SeqChunk(0, ids, 0, [0, 1, 2], SamplingParams(temperature=0.0))])
    fp32 = cuda_executor(tiny_llama_dir).forward_logits(batch)[0]
    bf16 = TorchExecutor.from_pretrained(tiny_llama_dir, device="cuda", dtype="bfloat16", block_size=BLOCK_SIZE,
                                         num_blocks=64).forward_logits(batch)[0]
    assert bf16.dtype == torch.float32
    assert F.cosine_similarity(fp32, bf16, dim=0) > 0.99
