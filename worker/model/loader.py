"""Load a Hugging Face-format model folder (config.json + *.safetensors, sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model.config import ModelConfig, load_model_config
from worker.model.errors import ModelFileNotFoundError, UnsupportedModelError
from worker.model.llama import LlamaForCausalLM
from worker.model.rope import inverse_frequencies

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files: the shards named by model.safetensors.index.json, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with index.open(encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [model_dir / name for name in names]
        for path in files:
            if not path.is_file():
                raise ModelFileNotFoundError(f"weight shard listed in {index} not found: {path}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def load_model(
    model_dir: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    config: ModelConfig | None = None,
) -> LlamaForCausalLM:
    """Build the decoder on `device` in `dtype` with the folder's weights, in eval mode."""
    config = config or load_model_config(model_dir)
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = _read_state_dict(safetensors_files(model_dir), device, dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise UnsupportedModelError(
            f"weights in {model_dir} do not match {config.architecture}: "
            f"missing {sorted(set(missing) - allowed_missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.inv_freq = inverse_frequencies(config.rope, config.head_dim).to(device)
    return model.eval()


def _read_state_dict(files: list[Path], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                tensor = f.get_tensor(name)
                state[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
    return state
