"""Tokenizer folders for router tests: small BPE tokenizers trained on the fly, with a chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '[' + message['role'] + '] ' + message['content'] | trim + ' ' + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '[assistant]' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello there, how can I help you today? I would like to know about caching.",
    "KV caches store attention keys and values so prefixes are not recomputed.",
    "user assistant system: tell me a story about routers and gateways.",
    "def route(request): return min(workers, key=lambda w: w.load)  # 12345 67890",
]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _train(kind: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None if kind == "byte_level" else "<unk>"))
    if kind == "byte_level":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        specials = SPECIALS
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = []
        specials = SPECIALS + ["<unk>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return tokenizer


def write_model_dir(folder: Path, kind: str, template: str, *, template_file: bool = False) -> Path:
    """A model folder with tokenizer.json and the chat template in the config or a .jinja file."""
    folder.mkdir(parents=True, exist_ok=True)
    _train(kind).save(str(folder / "tokenizer.json"))
    config: dict = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    if template_file:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder
