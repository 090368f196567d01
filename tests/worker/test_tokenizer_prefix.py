"""The worker's tokenizer reuses the tokens of a prompt it tokenized before (kvgate/text_prefix_cache.py):
every prompt still encodes as the model's tokenizer.json does, whole."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from tests.tiny_models import build_model_dir
from worker.model.tokenizer import load_tokenizer


def test_prompts_sharing_a_long_context_encode_as_a_whole_encode_and_reuse_it(tmp_path: Path) -> None:
    model_dir = build_model_dir(tmp_path / "model")
    tokenizer = load_tokenizer(model_dir)
    whole = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    context = "Hello world, this is a tiny tokenizer for kvgate tests. def f(x): return x * 2 " * 30
    for question in ("first?", " second, longer question 0123", "\n\nthird  with  spaces", ""):
        for add_special_tokens in (True, False):
            prompt = context + question
            expected = whole.encode(prompt, add_special_tokens=add_special_tokens).ids
            assert tokenizer.encode(prompt, add_special_tokens) == expected
    cache = tokenizer._prefix.cache
    assert cache is not None and cache.hits >= 6
