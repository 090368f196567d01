"""The whole engine (scheduler + block manager + torch executor) checked token-for-token against
transformers' greedy generate, fp32 on CPU, on a tiny random Llama (initializer_range 0.3).

Every scheduling path that decides which KV a token attends to is covered: batching, prefix-cache
hits on and off a block boundary, chunked prefill under a tiny token budget, and preemption.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers  # noqa: F401  (the reference; a test dependency, so a broken install fails here)

from worker.engine.config import EngineConfig
from worker.engine.engine import Engine, RequestOutput
from worker.engine.sampling_params import SamplingParams
from worker.executor.base import StepBatch
from worker.executor.torch_executor import TorchExecutor

from tests.worker.conftest import hf_greedy

BLOCK_SIZE = 4


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 384) for _ in range(length)]


class RecordingExecutor:
    """The torch executor, keeping every batch the scheduler planned and the logits it sampled from."""

    name = "torch"

    def __init__(self, inner: TorchExecutor, keep_logits: bool = False) -> None:
        self.inner = inner
        self.block_size, self.num_blocks, self.max_model_len = inner.block_size, inner.num_blocks, inner.max_model_len
        self.keep_logits = keep_logits
        self.batches: list[StepBatch] = []
        self.logits: list[torch.Tensor] = []

    def execute(self, batch: StepBatch) -> list[int]:
        self.batches.append(batch)
        logits = self.inner.forward_logits(batch)
        if self.keep_logits:
            self.logits.append(logits)
        sampling = [c for c in batch.chunks if c.sampling is not None]
        return self.inner.sampler.sample(logits, [c.sampling for c in sampling], [c.sample_index for c in sampling])


def make_engine(model_dir, num_blocks: int = 256, keep_logits: bool = False, **config) -> tuple[Engine, RecordingExecutor]:
    inner = TorchExecutor.from_pretrained(model_dir, block_size=BLOCK_SIZE, num_blocks=num_blocks)
    executor = RecordingExecutor(inner, keep_logits)
    engine = Engine(executor, None, EngineConfig(model_name="tiny-llama", block_size=BLOCK_SIZE, **config))
    return engine, executor


def run_to_completion(engine: Engine, max_steps: int = 5_000) -> dict[str, RequestOutput]:
    """The final output of every request."""
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("engine did not finish")


def generate(engine: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, greedy(max_tokens))
    return {rid: out.output_token_ids for rid, out in run_to_completion(engine).items()}


def test_single_request_equals_transformers_generate(tiny_llama_dir):
    engine, _ = make_engine(tiny_llama_dir)
    ids = prompt(11, seed=1)

    outputs = generate(engine, {"r": ids}, max_tokens=12)

    assert outputs["r"] == hf_greedy(tiny_llama_dir, ids, 12)


def test_sixteen_mixed_length_requests_batched_together_equal_generate(tiny_llama_dir):
    engine, executor = make_engine(tiny_llama_dir)
    lengths = [1, 2, 3, 5, 7, 8, 9, 12, 15, 16, 17, 21, 24, 29, 33, 40]
    prompts = {f"r{i}": prompt(n, seed=100 + i) for i, n in enumerate(lengths)}

    outputs = generate(engine, prompts, max_tokens=8)

    assert len(executor.batches[0].chunks) == 16  # every prompt prefilled in one step
    assert all(len(batch.chunks) == 16 for batch in executor.batches)  # and decoded together
    assert outputs == {rid: hf_greedy(tiny_llama_dir, ids, 8) for rid, ids in prompts.items()}


@pytest.mark.parametrize(
    ("num_shared_tokens", "second_tail_len", "expected_cached_tokens"),
    [(12, 7, 12), (10, 7, 8), (13, 0, 12), (12, 0, 8)],
    ids=["shared-prefix-ends-on-block-boundary", "shared-prefix-ends-mid-block",
         "whole-prompt-cached-mid-block", "whole-prompt-cached-on-boundary-recomputes-last-block"],
)
def test_request_sharing_a_cached_prefix_reuses_blocks_and_equals_generate(
    tiny_llama_dir, num_shared_tokens, second_tail_len, expected_cached_tokens
):
    engine, executor = make_engine(tiny_llama_dir)
    first = prompt(13, seed=3)
    generate(engine, {"first": first}, max_tokens=3)
    second = first[:num_shared_tokens] + prompt(second_tail_len, seed=4)
    engine.add_request("second", second, greedy(6))

    out = run_to_completion(engine)["second"]

    assert out.num_cached_tokens == expected_cached_tokens
    assert executor.batches[-6].chunks[0].start_pos == expected_cached_tokens  # prefill skips the hit
    assert out.output_token_ids == hf_greedy(tiny_llama_dir, second, 6)
    assert engine.stats().prefix_cache_hits_tokens == expected_cached_tokens


def test_chunked_prefill_under_a_tiny_token_budget_equals_generate(tiny_llama_dir):
    engine, executor = make_engine(tiny_llama_dir, max_num_batched_tokens=8)
    prompts = {f"r{i}": prompt(n, seed=200 + i) for i, n in enumerate([3, 9, 14, 23, 30])}

    outputs = generate(engine, prompts, max_tokens=6)

    assert max(batch.num_tokens for batch in executor.batches) == 8
    assert any(c.sampling is None for batch in executor.batches for c in batch.chunks)  # prompts were split
    assert any(len({len(c.token_ids) > 1 for c in b.chunks}) == 2 for b in executor.batches)  # prefill + decode
    assert outputs == {rid: hf_greedy(tiny_llama_dir, ids, 6) for rid, ids in prompts.items()}


@pytest.mark.parametrize("enable_prefix_caching", [True, False], ids=["prefix-cache-on", "prefix-cache-off"])
def test_preemption_under_too_few_blocks_still_equals_generate(tiny_llama_dir, enable_prefix_caching):
    # 12 blocks hold 48 tokens; four requests want 26 tokens (7 blocks) each.
    engine, _ = make_engine(tiny_llama_dir, num_blocks=12, enable_prefix_caching=enable_prefix_caching)
    prompts = {f"r{i}": prompt(10, seed=300 + i) for i in range(4)}

    outputs = generate(engine, prompts, max_tokens=16)

    assert engine.stats().num_preemptions > 0
    assert outputs == {rid: hf_greedy(tiny_llama_dir, ids, 16) for rid, ids in prompts.items()}
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("engine_config", [{}, {"max_num_batched_tokens": 8}], ids=["one-step-prefill", "chunked"])
def test_last_step_logits_are_within_1e_4_of_transformers(tiny_llama_dir, hf_reference, engine_config):
    engine, executor = make_engine(tiny_llama_dir, keep_logits=True, **engine_config)
    prompts = {f"r{i}": prompt(n, seed=400 + i) for i, n in enumerate([5, 11, 18])}

    outputs = generate(engine, prompts, max_tokens=5)

    last_logits: dict[int, torch.Tensor] = {}  # seq id -> logits of its last sampling step
    for batch, logits in zip(executor.batches, executor.logits, strict=True):
        sampling = [c for c in batch.chunks if c.sampling is not None]
        last_logits.update({c.seq_id: row for c, row in zip(sampling, logits, strict=True)})
    for seq_id, (rid, ids) in enumerate(prompts.items()):  # seq ids follow the order of add_request
        context = ids + outputs[rid][:-1]  # the last token was sampled from the logits after these
        torch.testing.assert_close(last_logits[seq_id], hf_reference.last_logits(tiny_llama_dir, context),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5),
    SamplingParams(temperature=1.5, top_k=20, seed=7, max_tokens=6, ignore_eos=True, logprobs=3),
], ids=["greedy", "sampled-hot-top-k"])
def test_each_tokens_logprobs_are_transformers_log_softmax_at_its_position(tiny_llama_dir, hf_reference, sampling):
    """Logprobs are the model's own distribution (raw logits' log-softmax), whatever temperature and
    top-k drew the token: checked at every position, the chosen token's and the likeliest ones'."""
    executor = TorchExecutor.from_pretrained(tiny_llama_dir, block_size=BLOCK_SIZE, num_blocks=256)
    engine = Engine(executor, None, EngineConfig(model_name="tiny-llama", block_size=BLOCK_SIZE,
                                                 max_num_batched_tokens=8))  # the prompt in chunks
    ids = prompt(13, seed=500)
    engine.add_request("r", ids, sampling)
    steps = []
    while engine.has_unfinished():
        steps.extend(engine.step())

    assert [len(step.new_logprobs) for step in steps] == [1] * sampling.max_tokens
    output = steps[-1].output_token_ids
    for i, step in enumerate(steps):
        (entry,) = step.new_logprobs
        reference = hf_reference.last_logits(tiny_llama_dir, ids + output[:i]).log_softmax(-1)
        top = reference.topk(sampling.logprobs)
        assert entry.logprob == pytest.approx(reference[output[i]].item(), abs=1e-4)
        assert entry.top_token_ids == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(entry.top_logprobs), top.values, atol=1e-4, rtol=0)
        if sampling.is_greedy:
            assert entry.top_token_ids[0] == output[i] and entry.logprob == entry.top_logprobs[0]


def test_a_repetition_penalty_equals_transformers_generate_with_the_same_penalty(tiny_llama_dir):
    """Both penalize every token of the prompt and of the output so far, dividing positive logits and
    multiplying negative ones: greedy output is the same token for token."""
    engine = Engine(TorchExecutor.from_pretrained(tiny_llama_dir, block_size=BLOCK_SIZE, num_blocks=256), None,
                    EngineConfig(model_name="tiny-llama", block_size=BLOCK_SIZE))
    prompts = {f"r{i}": prompt(n, seed=600 + i) for i, n in enumerate([6, 15])}
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                           repetition_penalty=1.8))
    outputs = {rid: out.output_token_ids for rid, out in run_to_completion(engine).items()}

    assert outputs == {rid: hf_greedy(tiny_llama_dir, ids, 12, repetition_penalty=1.8) for rid, ids in prompts.items()}
    assert outputs != {rid: hf_greedy(tiny_llama_dir, ids, 12) for rid, ids in prompts.items()}  # it did change them
