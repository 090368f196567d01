"""Tiny model variants for worker tests (the plain Llama is tests/conftest.py's tiny_llama_dir), and
transformers references.

Each model folder is built once per session. transformers is the test-only reference (a declared test
dependency: the modules that compare against it import it plainly, so a broken install fails them).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from tests.tiny_models import build_model_dir


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2ForCausalLM: bias on q/k/v."""
    return build_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3ForCausalLM: RMSNorm on q and k per head."""
    return build_model_dir(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_tied_llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with tied embeddings (no lm_head in the file) and llama3 rope scaling."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return build_model_dir(tmp_path_factory.mktemp("tiny-tied"), tie_word_embeddings=True, rope_parameters=rope)


@lru_cache(maxsize=8)
def hf_model(model_dir: Path):
    """transformers' own model for the folder, fp32, eval mode (cached per folder)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, **generation) -> list[int]:
    """transformers' generate(do_sample=False) output tokens (EOS does not stop it); generation: more
    GenerationConfig settings (repetition_penalty, ...)."""
    import torch
    import transformers

    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                                           eos_token_id=[], pad_token_id=0, **generation)
    with torch.no_grad():
        out = hf_model(model_dir).generate(torch.tensor([prompt_ids]), generation_config=config,
                                           attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def hf_last_logits(model_dir: Path, token_ids: list[int]):
    """transformers' fp32 logits [vocab] at the last position of token_ids."""
    import torch

    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([token_ids])).logits[0, -1]


class HFReference:
    """transformers as the reference: greedy generate and last-position logits."""

    greedy = staticmethod(hf_greedy)
    last_logits = staticmethod(hf_last_logits)


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    return HFReference()


class GreedyDriver:
    """Drives an executor directly: its own block allocator, chunked prefill, all sequences per step."""

    def __init__(self, executor, chunk_size: int | None = None) -> None:
        self.executor = executor
        self.chunk_size = chunk_size
        self.free_blocks = list(range(executor.num_blocks))
        self.block_tables: dict[int, list[int]] = {}

    def ensure_blocks(self, seq_id: int, num_tokens: int) -> list[int]:
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * self.executor.block_size < num_tokens:
            table.append(self.free_blocks.pop(0))
        return table

    def generate(self, prompts: list[list[int]], max_new_tokens: int, params=None,
                 start_positions: list[int] | None = None, seq_ids: list[int] | None = None) -> list[list[int]]:
        """Greedy (or `params`) outputs per prompt; start_positions: tokens already in the cache."""
        from worker.engine.sampling_params import SamplingParams
        from worker.executor.base import SeqChunk, StepBatch

        params = params or SamplingParams(temperature=0.0)
        done = list(start_positions or [0] * len(prompts))
        outputs: list[list[int]] = [[] for _ in prompts]
        seq_ids = seq_ids or list(range(len(prompts)))
        while any(len(out) < max_new_tokens for out in outputs):
            chunks = []
            rows = []
            for row, prompt in enumerate(prompts):
                if len(outputs[row]) >= max_new_tokens:
                    continue
                tokens = prompt + outputs[row]
                if done[row] < len(prompt):
                    take = len(prompt) - done[row] if self.chunk_size is None else self.chunk_size
                    new = tokens[done[row] : min(len(prompt), done[row] + take)]
                else:
                    new = tokens[done[row] :]
                end = done[row] + len(new)
                table = self.ensure_blocks(seq_ids[row], end)
                sampling = params if end >= len(prompt) else None
                chunks.append(SeqChunk(seq_ids[row], new, done[row], list(table), sampling, len(outputs[row])))
                rows.append(row)
            sampled = iter(self.executor.execute(StepBatch(chunks)))
            for row, chunk in zip(rows, chunks, strict=True):
                done[row] += len(chunk.token_ids)
                if chunk.sampling is not None:
                    outputs[row].append(next(sampled))
        return outputs


@pytest.fixture(scope="session")
def greedy_driver() -> type[GreedyDriver]:
    return GreedyDriver


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def write_config(model_dir: Path, config: dict) -> None:
    (model_dir / "config.json").write_text(json.dumps(config))
