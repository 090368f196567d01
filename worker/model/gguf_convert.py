"""Convert a llama-architecture GGUF file into a Hugging Face model folder.

Writes config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json and
generation_config.json into a temporary folder, then renames it into place in one step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from worker.model.errors import UnsupportedModelError

# gguf tensor name (within a block) -> Hugging Face Llama name
_BLOCK_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# llama.cpp `tokenizer.ggml.pre` -> the splits llama.cpp applies before byte-level BPE (llama-vocab.cpp)
_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write the HF folder for `gguf_path` at `out_dir`, which must not exist yet; return it."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"conversion target already exists: {out_dir}")
    reader = _open(gguf_path)
    config = build_config(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=_partial_prefix(out_dir), dir=out_dir.parent))
    try:
        _write_json(tmp_dir / "config.json", config)
        _write_json(tmp_dir / "generation_config.json", _generation_config(config))
        _write_json(tmp_dir / "tokenizer_config.json", build_tokenizer_config(reader))
        build_tokenizer(reader).save(str(tmp_dir / "tokenizer.json"))
        tensors = dict(iter_hf_tensors(reader, config, progress=progress))
        save_file(tensors, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        _make_world_readable(tmp_dir)
        os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def remove_partial_conversions(out_dir: str | Path) -> None:
    """Delete temp folders a killed conversion into `out_dir` left behind; call only under its lock."""
    out_dir = Path(out_dir)
    for partial in out_dir.parent.glob(f"{_partial_prefix(out_dir)}*"):
        shutil.rmtree(partial, ignore_errors=True)


def _partial_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.tmp-"


def _open(gguf_path: Path) -> GGUFReader:
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    reader = GGUFReader(gguf_path)
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise UnsupportedModelError(
            f"{gguf_path.name}: GGUF architecture {architecture!r} is not supported (only 'llama')"
        )
    return reader


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader: GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise UnsupportedModelError(f"GGUF metadata lacks {key!r}")
    return value


def build_config(reader: GGUFReader) -> dict[str, Any]:
    """config.json for LlamaForCausalLM, from the GGUF's `llama.*` metadata."""
    num_heads = int(_required(reader, "llama.attention.head_count"))
    hidden_size = int(_required(reader, "llama.embedding_length"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, "llama.vocab_size") or len(tokens.data)),
        "hidden_size": hidden_size,
        "intermediate_size": int(_required(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_required(reader, "llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden_size // num_heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(_required(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_required(reader, "llama.context_length")),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if config[key] is not None}


def iter_hf_tensors(
    reader: GGUFReader, config: dict[str, Any], progress: bool = True
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, float32 array) for every tensor: dequantized, q/k un-permuted."""
    for tensor in tqdm(reader.tensors, desc="Converting GGUF tensors", unit="tensor", disable=not progress):
        hf_name = hf_tensor_name(tensor.name)
        weights = _dequantized(tensor)
        if hf_name.endswith("q_proj.weight"):
            weights = unpermute_rope_rows(weights, config["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            weights = unpermute_rope_rows(weights, config["num_key_value_heads"])
        yield hf_name, np.ascontiguousarray(weights, dtype=np.float32)


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names raise."""
    if gguf_name in _TOP_TENSOR_NAMES:
        return _TOP_TENSOR_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_TENSOR_NAMES:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    return f"model.layers.{match.group(1)}.{_BLOCK_TENSOR_NAMES[match.group(2)]}.weight"


def _dequantized(tensor: ReaderTensor) -> np.ndarray:
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(tensor.data, dtype=np.float32).reshape(shape)
    return dequantize(tensor.data, tensor.tensor_type).reshape(shape)


def unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (convert_hf_to_gguf.py `permute`).

    llama.cpp stores each head's rows as interleaved (x0, x_half, x1, x_half+1, ...) pairs:
    reshape(heads, 2, half, in).swapaxes(1, 2); this is its inverse.
    """
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from the `tokenizer.ggml.*` metadata."""
    model_type, pre_type = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre")
    if model_type != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer {model_type!r} is not supported (only byte-level BPE 'gpt2')"
        )
    if pre_type not in _PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre_type!r} is not supported; known: {sorted(_PRE_TOKENIZERS)}"
        )
    tokens = _required(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ")) for merge in _required(reader, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre_type]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(reader, tokens)
    tokenizer.add_tokens(_added_tokens(reader, tokens, _TOKEN_TYPE_USER_DEFINED, special=False))
    tokenizer.add_special_tokens(_added_tokens(reader, tokens, _TOKEN_TYPE_CONTROL, special=True))
    return tokenizer


def _added_tokens(reader: GGUFReader, tokens: list[str], token_type: int, special: bool) -> list[AddedToken]:
    types = _field(reader, "tokenizer.ggml.token_type") or []
    return [
        AddedToken(token, special=special, normalized=False)
        for token, kind in zip(tokens, types)
        if kind == token_type
    ]


def _post_processor(reader: GGUFReader, tokens: list[str]) -> processors.PostProcessor:
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if not _field(reader, "tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return processors.ByteLevel(trim_offsets=False)
    bos = tokens[bos_id]
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def build_tokenizer_config(reader: GGUFReader) -> dict[str, Any]:
    """tokenizer_config.json: special token strings, BOS/EOS flags and the chat template."""
    tokens = _required(reader, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_required(reader, "llama.context_length")),
    }
    for name in ("bos", "eos", "unk", "pad"):
        key = "unknown" if name == "unk" else "padding" if name == "pad" else name
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{name}_token"] = tokens[token_id]
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


def _make_world_readable(folder: Path) -> None:
    """mkdtemp makes a private (0700) folder; a shared model cache should be readable by all."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
