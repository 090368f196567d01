"""Tiny random Llama-family models saved as Hugging Face folders, and transformers references.

Each model folder is built once per session. transformers is a test-only reference: its imports
stay inside the functions so collecting these tests costs nothing when they are skipped.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = 'You are helpful.' %}{% endif %}"
    "{{ bos_token }}<|im_start|>system\n{{ system }}<|im_end|>\n"
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny tokenizer for kvgate tests.",
    "Paged attention stores keys and values in fixed size blocks.",
    "What is the capital of France? Paris is the capital of France.",
    "def f(x):\n    return x * 2  # numbers 0123456789",
] * 20


def build_tokenizer():
    """A byte-level BPE (any text encodes) with a few hundred tokens and ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return tokenizer


def build_word_tokenizer():
    """Whole words split on whitespace: decode(encode(text)) round-trips any text of its words,
    so generated text can be re-tokenized exactly (what text-based failover continuation needs)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for line in _CORPUS for w in line.split()})
    words += [f"w{i}" for i in range(384 - len(SPECIAL_TOKENS) - len(words) - 1)]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, "<unk>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def _save_tokenizer(model_dir: Path, words: bool = False) -> int:
    from transformers import PreTrainedTokenizerFast

    tokenizer = build_word_tokenizer() if words else build_tokenizer()
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                           pad_token="</s>")
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(model_dir)
    return len(hf_tokenizer)


def _randomize_norms_and_biases(model) -> None:
    """HF initializes norms to 1 and biases to 0; random values make weight-loading bugs visible."""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))


def build_model_dir(model_dir: Path, architecture: str = "llama", plain_words: bool = False, **overrides) -> Path:
    """Save a tiny random model + tokenizer + chat template into model_dir (created).

    plain_words: a word-level tokenizer and an lm_head that never picks a special token, so
    the model only ever "says" plain words (its output text re-tokenizes to the same ids).
    """
    import torch
    import transformers

    model_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_tokenizer(model_dir, words=plain_words)
    eos_id = SPECIAL_TOKENS.index("</s>")
    options = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   initializer_range=0.3, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=eos_id,
                   tie_word_embeddings=False)
    options.update(overrides)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[architecture]
    if architecture == "qwen3":
        options.setdefault("head_dim", 16)
    torch.manual_seed(0)
    model = model_class(config_class(**options)).to(torch.float32).eval()
    _randomize_norms_and_biases(model)
    if plain_words:
        with torch.no_grad():  # zero logits for specials and <unk>: random words always beat them
            model.lm_head.weight[: len(SPECIAL_TOKENS) + 1] = 0.0
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LlamaForCausalLM: 2 layers, 4 heads over 2 KV heads (GQA), untied lm_head."""
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama"))


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


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate(do_sample=False) output tokens (EOS does not stop it)."""
    import torch
    import transformers

    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                                           eos_token_id=[], pad_token_id=0)
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
