"""ModelConfig: the few numbers of a Hugging Face `config.json` that the engine needs.

Reads the raw JSON (not transformers' config classes) so that both the older layout
(`rope_theta`, `rope_scaling` at the top level) and transformers 5's `rope_parameters`
are accepted, and so that loading a model never imports a model class from transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# architecture name in config.json -> (qkv bias, q/k RMSNorm per head)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope: RopeConfig
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ValueError(f"unsupported architecture {archs!r}; minisgl supports {supported}")
        default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        if raw.get("sliding_window") and raw.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported by minisgl")
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", default_bias)),
            qk_norm=qk_norm,
            rope=_rope_from_dict(raw),
            eos_token_ids=frozenset(_as_id_list(raw.get("eos_token_id"))),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        config = cls.from_dict(raw)
        gen_path = model_dir / "generation_config.json"
        if gen_path.exists():
            gen_eos = _as_id_list(json.loads(gen_path.read_text()).get("eos_token_id"))
            config = replace(config, eos_token_ids=config.eos_token_ids | frozenset(gen_eos))
        return config


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_from_dict(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 nests everything under rope_parameters; older configs use rope_theta
    # and rope_scaling at the top level.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; minisgl supports default, llama3")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged["factor"]),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )
