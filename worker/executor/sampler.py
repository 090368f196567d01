"""Pick one token per row of logits: greedy, or temperature / top-k / top-p sampling; before it, the
logits a request's penalties, min_tokens and logit_bias change (adjust_logits); and the
log-probabilities a request asks for beside its token (ModelLogprobs: of the model's own logits).

Sampling draws Exponential(1) noise E and picks argmax(p / E) (an exact sample from p). With a
seed, the noise for output token i comes from a generator seeded by hash(seed, i) alone, so a
request samples the same tokens whatever it was batched with, and again after a preemption.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from worker.engine.sampling_params import SamplingParams
from worker.executor.base import SeqChunk, TokenLogprobs


def seed_for(seed: int, sample_index: int) -> int:
    """A 63-bit generator seed that depends only on (seed, sample_index)."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Logits [V] with every token less likely than min_p times the likeliest one set to -inf."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Logits [V] with everything outside the top-k and the top-p nucleus set to -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    """sample(logits [N, V], params, sample_indices) -> N token ids."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for unseeded requests; None: torch's default generator

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        sample_indices: Sequence[int],
    ) -> list[int]:
        if len(params) != logits.shape[0] or len(sample_indices) != logits.shape[0]:
            raise ValueError("one SamplingParams and one sample index per row of logits")
        if not params:
            return []
        greedy = logits.argmax(dim=-1)
        if all(p.is_greedy for p in params):
            return greedy.tolist()
        tokens = greedy.tolist()
        for row, (p, index) in enumerate(zip(params, sample_indices, strict=True)):
            if not p.is_greedy:
                tokens[row] = self._sample_row(logits[row], p, index)
        return tokens

    def _sample_row(self, logits: torch.Tensor, params: SamplingParams, sample_index: int) -> int:
        tempered = apply_min_p(logits.to(torch.float32) / params.temperature, params.min_p)  # vLLM's order
        scaled = apply_top_k_top_p(tempered, params.top_k, params.top_p)
        probs = scaled.softmax(-1)
        noise = self._exponential_noise(probs, params.seed, sample_index)
        return int((probs / noise).argmax())

    def _exponential_noise(self, probs: torch.Tensor, seed: int | None, sample_index: int) -> torch.Tensor:
        if seed is None:
            generator = self.generator
            if generator is not None and generator.device != probs.device:
                return torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=generator).to(probs.device)
            return torch.empty_like(probs).exponential_(generator=generator)
        generator = torch.Generator(device="cpu").manual_seed(seed_for(seed, sample_index))
        # CPU noise: the same (seed, index) draws the same token on CPU and CUDA workers.
        return torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=generator).to(probs.device)


def adjust_logits(logits: torch.Tensor, chunks: Sequence[SeqChunk]) -> torch.Tensor:
    """Change, in place, the logits [N, V] of the sampling chunks (in order) whose params change them
    (SamplingParams: allowed_token_ids, logit_bias, then min_tokens' banned stop tokens, then the
    repetition, frequency and presence penalties, as vLLM applies them); returns logits. In place: a
    batch's logits are copied for nothing (take the model's own log-probabilities first: ModelLogprobs)."""
    vocab = logits.shape[-1]
    for row, chunk in enumerate(chunks):
        context = chunk.logits_context
        if context is None:
            continue
        params, scores = chunk.sampling, logits[row]
        if params.allowed_token_ids:
            ids = [token for token in params.allowed_token_ids if token < vocab]
            allowed = scores[ids]
            scores.fill_(float("-inf"))
            scores[ids] = allowed
        biases = [(token, bias) for token, bias in params.logit_bias if token < vocab]
        if biases:
            scores[[token for token, _ in biases]] += torch.tensor([bias for _, bias in biases], dtype=scores.dtype,
                                                                   device=scores.device)
        if context.banned_token_ids:
            scores[[token for token in context.banned_token_ids if token < vocab]] = float("-inf")
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(context.token_ids)), device=scores.device)
            seen = seen[seen < vocab]
            values = scores[seen]
            scores[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                       values * params.repetition_penalty)
        output = context.token_ids[context.num_prompt_tokens:]
        if output and (params.frequency_penalty or params.presence_penalty):
            counts = torch.bincount(torch.tensor(output), minlength=vocab)[:vocab].to(scores.device, scores.dtype)
            scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(scores.dtype)
    return logits


class ModelLogprobs:
    """The log-probabilities a step's requests asked for, under the model's own distribution: taken
    from the logits [N, V] of the sampling chunks (in order) before anything adjusts them, and given to
    each chunk that asked (chunk.logprobs) once its token is drawn. One log-softmax over the rows that
    ask, in fp32; nothing at all when none does."""

    def __init__(self, logits: torch.Tensor, chunks: Sequence[SeqChunk]) -> None:
        self._rows = [row for row, chunk in enumerate(chunks)
                      if chunk.sampling is not None and chunk.sampling.logprobs is not None]
        self._log_probs = logits[self._rows].to(torch.float32).log_softmax(-1) if self._rows else None  # a copy

    def attach(self, chunks: Sequence[SeqChunk], tokens: Sequence[int]) -> None:
        """Set chunk.logprobs for each chunk that asked: its drawn token's and its likeliest ones'."""
        if self._log_probs is None:
            return
        rows, log_probs = self._rows, self._log_probs
        chosen = log_probs.gather(1, torch.tensor([[tokens[row]] for row in rows], device=log_probs.device))
        top = log_probs.topk(max(chunks[row].sampling.logprobs for row in rows), dim=-1)
        for row, logprob, top_ids, top_values in zip(rows, chosen.squeeze(1).tolist(), top.indices.tolist(),
                                                     top.values.tolist()):
            asked = chunks[row].sampling.logprobs
            chunks[row].logprobs = TokenLogprobs(logprob, top_ids[:asked], top_values[:asked])
