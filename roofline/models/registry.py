"""Model registry: HF ``architectures`` name -> model class."""

from __future__ import annotations

from torch import nn

from roofline.config import ModelConfig
from roofline.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from roofline.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def get_model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported architecture {cfg.architecture!r}; supported: {supported}"
        ) from None
