"""From ``quantization=`` (``LLM``, ``EngineArgs``, ``--quantization``) and the checkpoint's own
metadata to a :class:`QuantizationConfig`, every check done before any weight loads.

On-the-fly methods (round-to-nearest of a 16/32-bit checkpoint as it loads):

* ``int8``: int8 weights, one scale per output channel;
* ``int4`` (group 128, symmetric), ``int4-g32``/``int4-g64``/``int4-g128``, ``int4-asym`` (with
  zero points) and ``int4-asym-g<N>``;
* ``fp8``: fp8 e4m3 weights, per-channel scales, 16-bit activations;
* ``fp8-w8a8``: the same weights, activations quantized per token for fp8 tensor-core GEMMs.

Checkpoint formats, chosen from ``config.json``'s ``quantization_config`` (``quantization``
left unset or naming the same method): ``gptq``, ``awq``, ``fp8``. GGUF files: ``gguf`` keeps
Q8_0/Q4_0/Q4_1 tensors quantized (see ``gguf.py``); without it GGUF tensors are dequantized
as before. ``quantize_lm_head`` gives the LM head the same method (16-bit by default).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch

from roofline.config import ModelConfig
from roofline.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from roofline.quantization.fp8 import Fp8LinearMethod, check_fp8_device
from roofline.quantization.int4 import INT4_GROUP_SIZES, Int4LinearMethod
from roofline.quantization.int8 import Int8LinearMethod
from roofline.quantization.moe import GroupInt4MoEMethod, MoEMethod, moe_method_for

ON_THE_FLY = ("int8", "int4", "int4-asym", "fp8", "fp8-w8a8")
CHECKPOINT_FORMATS = ("gptq", "awq", "fp8", "gguf")
_INT4 = re.compile(r"^int4(?P<asym>-asym)?(?:-g(?P<group>\d+))?$")


class OnTheFlyConfig(QuantizationConfig):
    """One method for every linear layer (the LM head only if ``lm_head``)."""

    def __init__(
        self, name: str, make_method: Callable[[], LinearMethod], lm_head: bool = False
    ) -> None:
        self.name, self.make_method, self.lm_head = name, make_method, lm_head

    def get_linear_method(self, prefix: str) -> LinearMethod:
        if prefix == "lm_head" and not self.lm_head:
            return UnquantizedLinearMethod()
        return self.make_method()

    def quantizes_lm_head(self) -> bool:
        return self.lm_head

    def get_moe_method(self, prefix: str) -> MoEMethod | None:
        match = _INT4.match(self.name)
        if match is not None:
            return GroupInt4MoEMethod(int(match["group"] or 128), match["asym"] is None)
        return moe_method_for(self.name)

    def planner_precision(self) -> tuple[str, str | None, int]:
        if self.name == "int8":
            return "int8", "bf16", 128
        if self.name in ("fp8", "fp8-w8a8"):
            return "fp8", None if self.name == "fp8-w8a8" else "bf16", 128
        match = _INT4.match(self.name)
        return "int4", "bf16", int(match["group"] or 128) if match else 128


def layer_in_features(cfg: ModelConfig) -> dict[str, int]:
    """Input size of each linear layer kind of the Llama family (for group checks)."""
    return {
        "qkv_proj / gate_up_proj / lm_head": cfg.hidden_size,
        "o_proj": cfg.num_attention_heads * cfg.head_dim,
        "down_proj": cfg.intermediate_size,
    }


def _check_groups(cfg: ModelConfig, group_size: int, what: str) -> None:
    for layer, k in layer_in_features(cfg).items():
        if k % group_size:
            raise ValueError(
                f"{what}: group size {group_size} does not divide {layer}'s {k} input features"
            )


def _on_the_fly(
    name: str, cfg: ModelConfig, device: torch.device, lm_head: bool
) -> QuantizationConfig:
    if name == "int8":
        return OnTheFlyConfig(name, Int8LinearMethod, lm_head)
    if name in ("fp8", "fp8-w8a8"):
        check_fp8_device(device)
        w8a8 = name == "fp8-w8a8"
        return OnTheFlyConfig(name, functools.partial(Fp8LinearMethod, w8a8=w8a8), lm_head)
    match = _INT4.match(name)
    if match is None:
        raise ValueError(
            f"unknown quantization {name!r}; choose one of: {', '.join(ON_THE_FLY)}, "
            "int4[-asym]-g<32|64|128>, or a checkpoint format (gptq, awq, fp8, gguf)"
        )
    group = int(match["group"] or 128)
    if group not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group}")
    _check_groups(cfg, group, name)
    symmetric = match["asym"] is None
    return OnTheFlyConfig(name, functools.partial(Int4LinearMethod, group, symmetric), lm_head)


def checkpoint_quantization(cfg: ModelConfig) -> dict[str, Any] | None:
    """``config.json``'s ``quantization_config`` (None for unquantized checkpoints)."""
    qc = cfg.hf_config.get("quantization_config")
    return dict(qc) if isinstance(qc, dict) else None


def resolve_quantization(
    quantization: str | None,
    cfg: ModelConfig,
    source_kind: str,
    device: torch.device,
    quantize_lm_head: bool = False,
    gguf_path: str | None = None,
) -> QuantizationConfig | None:
    """The model's QuantizationConfig (None: 16-bit), or ValueError for a bad combination."""
    name = quantization.strip().lower() if quantization else None
    if name in ("none", ""):
        name = None
    ckpt = checkpoint_quantization(cfg) if source_kind == "hf" else None
    if ckpt is not None:
        from roofline.quantization.gptq import checkpoint_config

        method = str(ckpt.get("quant_method", "")).lower()
        if name is not None and name != method:
            raise ValueError(
                f"the checkpoint is already quantized ({method}); quantization={quantization!r} "
                "cannot requantize it (leave it unset or give the checkpoint's method)"
            )
        if quantize_lm_head:
            raise ValueError("quantize_lm_head applies to on-the-fly quantization only")
        return checkpoint_config(ckpt, cfg, device)
    if name is None:
        if quantize_lm_head:
            raise ValueError("quantize_lm_head needs a quantization method")
        return None
    if name == "gguf":
        if source_kind != "gguf" or gguf_path is None:
            raise ValueError("quantization='gguf' needs a .gguf model")
        from roofline.quantization.gguf import GGUFConfig

        return GGUFConfig.from_file(gguf_path)
    if name in ("gptq", "awq"):
        raise ValueError(f"quantization={name!r} needs a checkpoint whose config.json says so")
    return _on_the_fly(name, cfg, device, quantize_lm_head)


def check_tensor_parallel(
    quant_config: QuantizationConfig | None, cfg: ModelConfig, world_size: int
) -> None:
    """Refuse, before any worker starts, a quantization whose groups a rank's K slice of a
    row-parallel layer (``o_proj``: the heads, ``down_proj``: the intermediate size) would
    cut: each rank quantizes (or copies) whole groups of its own slice."""
    if quant_config is None or world_size == 1:
        return
    row_parallel = {
        "self_attn.o_proj": cfg.num_attention_heads * cfg.head_dim,
        "mlp.down_proj": cfg.intermediate_size,
    }
    if cfg.num_experts and not cfg.dense_mlp_layers:  # no dense MLP (MoE experts: their own check)
        del row_parallel["mlp.down_proj"]
    for module, in_features in row_parallel.items():
        method = quant_config.get_linear_method(f"model.layers.0.{module}")
        group = getattr(method, "group_size", None)
        local = in_features // world_size
        if group and local % group:
            raise ValueError(
                f"{quant_config.name}: {module}'s {in_features} input features split over "
                f"{world_size} ranks give {local} per rank, which groups of {group} do not "
                "divide; choose a smaller group or fewer ranks"
            )
