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
from torch import nn

from roofline.config import ModelConfig
from roofline.distributed.expert_parallel import parse_expert_tensor
from roofline.distributed.parallel_state import SINGLE, ParallelContext
from roofline.layers.moe import FusedMoE
from roofline.models.llama import LlamaForCausalLM
from roofline.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from roofline.quantization.moe import MoEMethod

_SPARSE_BLOCKS = ("mlp", "block_sparse_moe")


def moe_method(
    quant_config: QuantizationConfig | None, cfg: ModelConfig, prefix: str
) -> MoEMethod | None:
    """The method of the experts at ``prefix`` (None: 16-bit), or a ValueError for a scheme
    that has no expert kernels (before any weight loads)."""
    if quant_config is None or quant_config.name == "none":
        return None
    method = quant_config.get_moe_method(prefix)
    if method is None:
        raise ValueError(
            f"{cfg.architecture}: {quant_config.name} has no quantized expert kernels; "
            "MoE models take quantization='int8', 'int4[-asym][-g<N>]', 'fp8' or 'fp8-w8a8'"
        )
    return method


class _DenseMlpsUnquantized(QuantizationConfig):
    """``quant_config`` for building the Llama layers, except that the dense MLPs of sparse
    layers (replaced by ``FusedMoE`` right after) get the 16-bit method: their sizes need not
    fit the scheme's groups (under tensor parallelism ``intermediate_size / tp``)."""

    def __init__(self, inner: QuantizationConfig, cfg: ModelConfig) -> None:
        self.inner = inner
        self.name = inner.name
        self.sparse = {
            f"model.layers.{i}.mlp."
            for i in range(cfg.num_hidden_layers)
            if i not in cfg.dense_mlp_layers
        }

    def get_linear_method(self, prefix: str) -> LinearMethod:
        if prefix.rsplit(".", 1)[0] + "." in self.sparse:
            return UnquantizedLinearMethod()
        return self.inner.get_linear_method(prefix)

    def quantizes_lm_head(self) -> bool:
        return self.inner.quantizes_lm_head()

    def embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Module | None:
        return self.inner.embedding(num_embeddings, embedding_dim)

    def planner_precision(self) -> tuple[str, str | None, int]:
        return self.inner.planner_precision()

    def get_moe_method(self, prefix: str) -> MoEMethod | None:
        return self.inner.get_moe_method(prefix)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose MLPs (except ``cfg.dense_mlp_layers``) are sparse MoE blocks."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        quant_config: QuantizationConfig | None = None,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        if cfg.num_experts <= 0 or cfg.num_experts_per_tok <= 0:
            raise ValueError(f"{cfg.architecture} needs num_experts and num_experts_per_tok > 0")
        moe_method(quant_config, cfg, "model.layers.0.mlp.experts")  # refused before building
        dense = quant_config
        if quant_config is not None:  # the sparse layers' dense MLPs are placeholders, replaced
            dense = _DenseMlpsUnquantized(quant_config, cfg)  # below: no quantized shapes for them
        super().__init__(cfg, max_positions, dense, parallel)
        for i, layer in enumerate(self.layers):
            if i not in cfg.dense_mlp_layers:
                layer.mlp = FusedMoE(
                    cfg.hidden_size,
                    cfg.moe_intermediate_size,
                    cfg.num_experts,
                    cfg.num_experts_per_tok,
                    cfg.norm_topk_prob,
                    method=moe_method(quant_config, cfg, f"model.layers.{i}.mlp.experts"),
                    parallel=parallel,
                    expert_parallel=parallel.expert_parallel,
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
        if parts[3:] == ["gate", "weight"]:
            block.load_router(tensor)
            return True
        where = parse_expert_tensor(name)
        if where is None:
            return False
        block.load_expert(where.expert, where.proj, tensor)
        return True

    def process_weights_after_loading(self) -> None:
        for _, block in self.moe_layers():
            block.process_weights_after_loading()
        super().process_weights_after_loading()

    def _check_loaded(self, loaded: set[str]) -> None:
        missing = []
        for i, block in self.moe_layers():
            gaps = block.missing()
            missing += [f"layers.{i}.mlp.{g}" for g in gaps]
            if not gaps:  # the router as a loaded linear layer, the experts as parameters
                loaded.add(f"layers.{i}.mlp.gate.weight#0")
                own = block.named_parameters(recurse=False)  # the experts' weights and scales
                loaded.update(f"layers.{i}.mlp.{n}" for n, _ in own)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
        super()._check_loaded(loaded)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3 attention (q/k RMSNorm; ``qk_norm`` is set for this architecture) with MoE MLPs."""


class MixtralForCausalLM(MoeForCausalLM):
    """Mistral attention with 8 experts, top-2, renormalised routing weights."""
