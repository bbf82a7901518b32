"""Finding a model's dimensions for the planner: a ``config.json`` path, a short name of the
configs kept in ``roofline/model_configs``, a few built-in dimension sets (models whose configs
the repo does not keep, such as the literature's Llama-2-70B and the GGUF-only SmolLM2), or
explicit dimensions.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from roofline.config import ModelConfig


def model_from_dims(
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    architecture: str = "LlamaForCausalLM",
) -> ModelConfig:
    """A Llama-shaped ``ModelConfig`` from explicit dimensions."""
    dims = (num_layers, hidden_size, num_heads, num_kv_heads, intermediate_size, vocab_size)
    if min(dims) <= 0:
        raise ValueError("model dimensions must be positive")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} heads do not group into {num_kv_heads} KV heads")
    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        tie_word_embeddings=tie_word_embeddings,
        torch_dtype="bfloat16",
    )


BUILTIN_MODELS: dict[str, dict[str, int | bool]] = {
    "llama-2-7b": dict(
        num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
        intermediate_size=11008, vocab_size=32000,
    ),
    "llama-2-70b": dict(
        num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
        intermediate_size=28672, vocab_size=32000,
    ),
    "llama-3.1-70b": dict(
        num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
        intermediate_size=28672, vocab_size=128256,
    ),
    "smollm2-135m": dict(
        num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
    ),
}  # fmt: skip
"""Dimensions of models the repo keeps no config.json for (from their HF configs)."""

_ALIASES = {"smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}


def _config_dir() -> Path:
    return Path(str(resources.files("roofline"))) / "model_configs"


def known_model_names() -> list[str]:
    kept = sorted(p.parent.name for p in _config_dir().glob("*/config.json"))
    return kept + sorted(BUILTIN_MODELS)


def resolve_model(spec: str) -> ModelConfig:
    """A ``config.json`` (or a folder holding one), a kept short name or a built-in name."""
    path = Path(os.path.expanduser(spec))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_json(path / "config.json")
    if path.is_file():
        return ModelConfig.from_json(path)
    key = spec.strip().lower()
    key = _ALIASES.get(key, key)
    kept = _config_dir() / key / "config.json"
    if kept.is_file():
        return ModelConfig.from_json(kept)
    if key in BUILTIN_MODELS:
        return model_from_dims(**BUILTIN_MODELS[key])  # type: ignore[arg-type]
    raise ValueError(
        f"unknown model {spec!r}: give a config.json path, explicit dimensions, or one of "
        f"{', '.join(known_model_names())}"
    )
