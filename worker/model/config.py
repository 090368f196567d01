"""ModelConfig: the decoder's shape and options, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.model.errors import ModelFileNotFoundError, UnsupportedModelError

# architecture -> (bias on q/k/v projections by default, RMSNorm on q and k per head)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding: base theta and an optional scaling (linear, llama3) of its frequencies."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError("rope_theta must be > 0")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError("rope factor must be > 0")

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> RopeConfig:
        """Read transformers 5's rope_parameters, or 4.x's rope_theta + rope_scaling."""
        params = dict(raw.get("rope_scaling") or {})
        params.update(raw.get("rope_parameters") or {})
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type") or params.get("type") or "default"
        original = params.get("original_max_position_embeddings")
        if rope_type == "llama3" and original is None:
            original = raw.get("max_position_embeddings")
        return cls(
            theta=float(theta),
            rope_type=str(rope_type),
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=None if original is None else int(original),
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama-family decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.{name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("config.num_attention_heads must be a multiple of num_key_value_heads")
        if self.rms_norm_eps <= 0:
            raise ValueError("config.rms_norm_eps must be > 0")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from config.json's contents; raise UnsupportedModelError for other models."""
        architecture = _architecture(raw)
        qkv_bias_default, qk_norm = SUPPORTED_ARCHITECTURES[architecture]
        _reject_unsupported_options(raw)
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        attention_bias = bool(raw.get("attention_bias", qkv_bias_default))
        eos = raw.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf_dict(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            # Llama's attention_bias covers o_proj too; Qwen2 always has q/k/v bias and no o bias.
            o_bias=attention_bias and architecture != "Qwen2ForCausalLM",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=qk_norm,
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(eos),
        )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read model_dir/config.json."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelFileNotFoundError(f"model config not found: {path}")
    with path.open(encoding="utf-8") as f:
        raw = json.load(f)
    return ModelConfig.from_hf_dict(raw)


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    shown = ", ".join(architectures) or f"model_type={raw.get('model_type')!r}"
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    raise UnsupportedModelError(f"unsupported architecture {shown}; supported: {supported}")


def _reject_unsupported_options(raw: dict[str, Any]) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {raw['hidden_act']!r} (only 'silu')")
    if raw.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention (use_sliding_window) is not supported")
    if raw.get("architectures") == ["MistralForCausalLM"] and raw.get("sliding_window"):
        raise UnsupportedModelError("sliding-window attention (sliding_window) is not supported")


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
