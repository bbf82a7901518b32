"""Mixture-of-experts models of the Llama family: Qwen3-MoE (Qwen3 attention with q/k norm, 128
experts top-8 with renormalised probabilities in Qwen3-30B-A3B, no shared expert, optional dense
layers via ``mlp_only_layers`` / ``decoder_sparse_step``) and Mixtral (Mistral attention, 8
experts top-2). Attention, norms, embeddings and the head are ``LlamaForCausalLM``'s; each sparse
layer's MLP is a ``layers.moe.FusedMoE``.

Checkpoint names: Qwen3-MoE ``layers.N.mlp.gate.weight`` (router) and
``layers.N.mlp.experts.E.{gate,up,down}_proj.weight``; Mixtral ``layers.N.block_sparse_moe.gate``
and ``...experts.E.{w1,w3,w2}.weight`` (gate, up, down). Stacked forms are also taken:
``mlp.experts.{gate,up,down}_proj.weight [E, ., .]`` (GGUF's ``ffn_*_exps``) and transformers
5's fused ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``mlp.experts.down_proj [E, H, I]``.
"""

from __future__ import annotations

import torch

from roofline.config import ModelConfig
from roofline.layers.moe import FusedMoE
from roofline.models.llama import LlamaForCausalLM
from roofline.quantization.base import QuantizationConfig

_SPARSE_BLOCKS = ("mlp", "block_sparse_moe")
_EXPERT_PROJ = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_up_proj": "gate_up",
}


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose MLPs (except ``cfg.dense_mlp_layers``) are sparse MoE blocks."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        if cfg.num_experts <= 0 or cfg.num_experts_per_tok <= 0:
            raise ValueError(f"{cfg.architecture} needs num_experts and num_experts_per_tok > 0")
        if quant_config is not None and quant_config.name != "none":
            # the experts are this model's own stacked parameters: a quantized method for them
            # (FusedMoE's counterpart of LinearMethod) does not exist yet
            raise ValueError(
                f"{cfg.architecture}: quantized MoE models ({quant_config.name}) are not "
                "supported yet; run the 16-bit checkpoint"
            )
        super().__init__(cfg, max_positions, quant_config)
        for i, layer in enumerate(self.layers):
            if i not in cfg.dense_mlp_layers:
                layer.mlp = FusedMoE(
                    cfg.hidden_size,
                    cfg.moe_intermediate_size,
                    cfg.num_experts,
                    cfg.num_experts_per_tok,
                    cfg.norm_topk_prob,
                )

    def moe_layers(self) -> list[tuple[int, FusedMoE]]:
        return [(i, lay.mlp) for i, lay in enumerate(self.layers) if isinstance(lay.mlp, FusedMoE)]

    def load_other_weight(self, name: str, tensor: torch.Tensor) -> bool:
        parts = name.split(".")
        if len(parts) < 5 or parts[0] != "layers" or parts[2] not in _SPARSE_BLOCKS:
            return False
        block = self.layers[int(parts[1])].mlp
        if not isinstance(block, FusedMoE):
            return False  # a dense layer's MLP: the usual path
        rest = parts[3:]
        if rest == ["gate", "weight"]:
            block.load_router(tensor)
            return True
        if rest[0] != "experts":
            return False
        if len(rest) == 4 and rest[1].isdigit() and rest[3] == "weight":  # one expert
            expert: int | None = int(rest[1])
            proj = rest[2]
        elif len(rest) in (2, 3) and rest[-1] in ("weight", rest[1]):  # stacked over experts
            expert, proj = None, rest[1]
        else:
            raise KeyError(f"checkpoint tensor {name!r}: unknown expert tensor layout")
        if proj not in _EXPERT_PROJ:
            raise KeyError(f"checkpoint tensor {name!r}: unknown expert projection {proj!r}")
        block.load_expert(expert, _EXPERT_PROJ[proj], tensor)
        return True

    def _check_loaded(self, loaded: set[str]) -> None:
        missing = []
        for i, block in self.moe_layers():
            gaps = block.missing()
            missing += [f"layers.{i}.mlp.{g}" for g in gaps]
            if not gaps:  # the router as a loaded linear layer, the experts as parameters
                loaded.add(f"layers.{i}.mlp.gate.weight#0")
                loaded.update(f"layers.{i}.mlp.{p}" for p in ("w13_weight", "w2_weight"))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
        super()._check_loaded(loaded)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3 attention (q/k RMSNorm; ``qk_norm`` is set for this architecture) with MoE MLPs."""


class MixtralForCausalLM(MoeForCausalLM):
    """Mistral attention with 8 experts, top-2, renormalised routing weights."""
