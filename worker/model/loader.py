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
# Fused parameter <- the checkpoint's parameters it stacks (along the output dimension), per layer.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


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
    state = fuse_projections(_read_state_dict(safetensors_files(model_dir), device, dtype))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(_checkpoint_names(set(missing) - allowed_missing) - set(state))
    # The other parts of a group that lacks one stay unfused: the missing part is the error, not them.
    fused_parts = {part for parts in FUSED_PROJECTIONS.values() for part in parts}
    unexpected = [name for name in unexpected if not any(f".{part}." in name for part in fused_parts)]
    if missing or unexpected:
        raise UnsupportedModelError(
            f"weights in {model_dir} do not match {config.architecture}: "
            f"missing {missing[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.inv_freq = inverse_frequencies(config.rope, config.head_dim).to(device)
    return model.eval()


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's state with each FUSED_PROJECTIONS group stacked into its fused tensor. A group
    with a part missing is left as it is, so load_model names the missing tensor."""
    fused = dict(state)
    for name in state:
        for target, parts in FUSED_PROJECTIONS.items():
            for suffix in ("weight", "bias"):
                first = f"{parts[0]}.{suffix}"
                if not name.endswith("." + first):
                    continue
                prefix = name[: -len(first)]
                names = [f"{prefix}{part}.{suffix}" for part in parts]
                if all(n in state for n in names):
                    fused[f"{prefix}{target}.{suffix}"] = torch.cat([fused.pop(n) for n in names])
    return fused


def _checkpoint_names(names: set[str]) -> set[str]:
    """Model parameter names as the checkpoint spells them (a fused name -> the names it stacks)."""
    out = set()
    for name in names:
        for target, parts in FUSED_PROJECTIONS.items():
            if f".{target}." in name:
                out.update(name.replace(target, part) for part in parts)
                break
        else:
            out.add(name)
    return out


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
