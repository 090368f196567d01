"""Tiny random Llama-family models saved as Hugging Face folders, with a small BPE and a chat template.

torch, transformers and tokenizers are imported inside the functions: importing this module is free.
"""

from __future__ import annotations

from pathlib import Path

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
