"""The sampler: greedy, temperature, top-k, top-p, and per-request seeds indexed by output position."""

from __future__ import annotations

import pytest
import torch

from worker.engine.sampling_params import SamplingParams
from worker.executor.base import LogitsContext, SeqChunk
from worker.executor.sampler import (ModelLogprobs, Sampler, adjust_logits, apply_min_p, apply_top_k_top_p,
                                     seed_for)

VOCAB = 50


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_picks_the_argmax_of_every_row():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0)] * 6
    assert Sampler().sample(logits, params, [0] * 6) == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = random_logits(8, seed=1)
    params = [SamplingParams(temperature=2.0, top_k=1)] * 8
    assert Sampler().sample(logits, params, list(range(8))) == logits.argmax(-1).tolist()


def test_greedy_and_sampled_rows_mix_in_one_call():
    logits = random_logits(2, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)]
    assert Sampler().sample(logits, params, [0, 0]) == logits.argmax(-1).tolist()


def test_same_seed_and_index_draw_the_same_token_whatever_the_row():
    logits = random_logits(1, seed=3).expand(5, VOCAB)
    params = [SamplingParams(temperature=1.0, seed=42)] * 5
    tokens = Sampler().sample(logits, params, [7] * 5)
    assert len(set(tokens)) == 1
    assert Sampler().sample(logits[:1], params[:1], [7]) == tokens[:1]


def test_seeded_draws_depend_on_the_sample_index():
    logits = torch.zeros(1, VOCAB)  # uniform: different indices give different tokens
    params = [SamplingParams(temperature=1.0, seed=42)]
    tokens = [Sampler().sample(logits, params, [i])[0] for i in range(20)]
    assert len(set(tokens)) > 5
    assert tokens == [Sampler().sample(logits, params, [i])[0] for i in range(20)]
    assert seed_for(42, 0) != seed_for(42, 1) != seed_for(43, 1)


def test_unseeded_sampling_follows_the_samplers_generator():
    logits = torch.zeros(4, VOCAB)
    params = [SamplingParams(temperature=1.0)] * 4
    first = Sampler(torch.Generator().manual_seed(0)).sample(logits, params, [0] * 4)
    assert Sampler(torch.Generator().manual_seed(0)).sample(logits, params, [0] * 4) == first


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(apply_top_k_top_p(logits, None, 0.8))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(apply_top_k_top_p(logits, None, 0.81))
    assert kept.tolist() == [True, True, True, False]


def test_top_p_never_samples_outside_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.06, 0.04]]))
    params = SamplingParams(temperature=1.0, top_p=0.85, seed=1)
    tokens = {Sampler().sample(logits, [params], [i])[0] for i in range(200)}
    assert tokens == {0, 1}


def test_top_k_cut():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert torch.isfinite(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [False, True, True, False]


@pytest.mark.parametrize("temperature, expected_top_share", [(0.2, 0.95), (5.0, 0.4)], ids=["cold", "hot"])
def test_temperature_sharpens_or_flattens_the_distribution(temperature, expected_top_share):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    params = SamplingParams(temperature=temperature, seed=3)
    draws = [Sampler().sample(logits, [params], [i])[0] for i in range(400)]
    share = draws.count(0) / len(draws)
    assert share > expected_top_share if temperature < 1 else share < expected_top_share


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="one SamplingParams"):
        Sampler().sample(random_logits(2), [SamplingParams()], [0])


def sampling_chunk(params: SamplingParams | None) -> SeqChunk:
    return SeqChunk(seq_id=0, token_ids=[1], start_pos=0, block_table=[0], sampling=params)


def test_logprobs_are_the_raw_logits_log_softmax_whatever_the_sampling():
    logits = random_logits(3, seed=9)
    chunks = [sampling_chunk(SamplingParams(temperature=0.0, logprobs=4)),
              sampling_chunk(SamplingParams(temperature=0.3, top_k=2, logprobs=0)),
              sampling_chunk(SamplingParams(temperature=1.0))]
    tokens = [5, 17, 3]

    ModelLogprobs(logits, chunks).attach(chunks, tokens)

    expected = logits.log_softmax(-1)
    first, second, third = (chunk.logprobs for chunk in chunks)
    assert first.logprob == pytest.approx(expected[0, 5].item(), abs=1e-6)
    assert first.top_token_ids == expected[0].topk(4).indices.tolist()
    assert first.top_logprobs == pytest.approx(expected[0].topk(4).values.tolist(), abs=1e-6)
    assert second.logprob == pytest.approx(expected[1, 17].item(), abs=1e-6)  # not the tempered distribution's
    assert second.top_token_ids == [] and second.top_logprobs == []
    assert third is None  # a request that asked for none gets none


def test_rows_that_ask_for_no_logprobs_are_left_alone():
    chunks = [sampling_chunk(SamplingParams())]
    ModelLogprobs(torch.full((1, VOCAB), float("nan")), chunks).attach(chunks, [0])
    assert chunks[0].logprobs is None


def adjusted_chunk(params: SamplingParams, token_ids: list[int], num_prompt_tokens: int,
                   banned: tuple[int, ...] = ()) -> SeqChunk:
    chunk = sampling_chunk(params)
    chunk.logits_context = LogitsContext(token_ids, num_prompt_tokens, banned)
    return chunk


def test_penalties_bias_and_bans_change_the_logits_as_vllm_defines_them():
    logits = random_logits(1, seed=11)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias=((3, 2.0), (4, -1.0)), min_tokens=1)
    prompt, output = [3, 9, 9], [9, 12, 12, 12]
    chunk = adjusted_chunk(params, prompt + output, len(prompt), banned=(0,))
    expected = logits[0].clone()

    (adjusted,) = adjust_logits(logits, [chunk])

    expected[3] += 2.0
    expected[4] -= 1.0
    expected[0] = float("-inf")
    for token in {3, 9, 12}:  # repetition: every token of the prompt or the output
        expected[token] = expected[token] / 1.5 if expected[token] > 0 else expected[token] * 1.5
    for token, count in {9: 1, 12: 3}.items():  # frequency and presence: the output's tokens only
        expected[token] -= 0.5 * count + 0.25
    torch.testing.assert_close(adjusted, expected)


def test_only_the_rows_with_adjustments_change_in_place():
    logits = random_logits(2, seed=12)
    before = logits.clone()
    chunks = [sampling_chunk(SamplingParams()),
              adjusted_chunk(SamplingParams(frequency_penalty=1.0), [1, 2, 2], num_prompt_tokens=1)]

    adjusted = adjust_logits(logits, chunks)

    assert adjusted is logits  # no copy of the batch's logits
    torch.testing.assert_close(adjusted[0], before[0])
    assert adjusted[1, 2] == before[1, 2] - 2.0 and adjusted[1, 1] == before[1, 1]


def test_logprobs_are_taken_before_the_logits_are_adjusted():
    logits = random_logits(1, seed=16)
    expected = logits[0].log_softmax(-1)
    chunks = [adjusted_chunk(SamplingParams(logprobs=2, logit_bias=((7, 100.0),)), [1], 1)]

    logprobs = ModelLogprobs(logits, chunks)
    tokens = Sampler().sample(adjust_logits(logits, chunks), [chunks[0].sampling], [0])
    logprobs.attach(chunks, tokens)

    assert tokens == [7]
    assert chunks[0].logprobs.logprob == pytest.approx(expected[7].item(), abs=1e-6)
    assert chunks[0].logprobs.top_token_ids == expected.topk(2).indices.tolist()


def test_a_banned_token_is_never_drawn_greedy_or_sampled():
    logits = random_logits(1, seed=13)
    best = int(logits.argmax())
    for params in (SamplingParams(temperature=0.0, min_tokens=1),
                   SamplingParams(temperature=1.0, seed=5, min_tokens=1)):
        chunk = adjusted_chunk(params, [1], 1, banned=(best,))
        tokens = [Sampler().sample(adjust_logits(logits.clone(), [chunk]), [params], [i])[0] for i in range(20)]
        assert best not in tokens


def test_min_p_keeps_only_the_tokens_near_enough_to_the_likeliest():
    logits = random_logits(1, seed=14)[0]
    probs = logits.softmax(-1)
    kept = apply_min_p(logits, 0.2) > float("-inf")
    assert kept.tolist() == (probs >= 0.2 * probs.max()).tolist() and 1 <= int(kept.sum()) < VOCAB
    assert apply_min_p(logits, 0.0) is logits
    hot = SamplingParams(temperature=2.0, min_p=1.0, seed=3)  # only the likeliest is left: greedy at any temperature
    assert Sampler().sample(logits.expand(8, VOCAB), [hot] * 8, list(range(8))) == [int(logits.argmax())] * 8


def test_allowed_token_ids_are_the_only_ones_left():
    logits = random_logits(1, seed=15)
    before = logits[0].clone()
    chunk = adjusted_chunk(SamplingParams(allowed_token_ids=(4, 9)), [1], 1)
    (adjusted,) = adjust_logits(logits, [chunk])
    assert torch.isinf(adjusted).sum() == VOCAB - 2 and adjusted[4] == before[4] and adjusted[9] == before[9]
