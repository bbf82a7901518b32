"""How a sparse MoE layer (``layers.moe.FusedMoE``) stores, loads and multiplies its stacked
expert weights: the MoE counterpart of ``LinearMethod``, handed out by
``QuantizationConfig.get_moe_method``.

A method registers ``w13_weight [E, 2I, H]`` (each expert's gate rows, then its up rows) and
``w2_weight [E, H, I]`` on the layer, in its own dtype, plus whatever the kernel reads beside
them; ``load(layer, which, experts, rows, tensor)`` takes one checkpoint tensor (one expert's
``[rows, K]`` or a stack ``[E', rows, K]``) for the ``rows`` of ``which`` (``w13``/``w2``) of the
local ``experts`` as it streams in, quantizing it there, so loading never holds more than one
16-bit tensor beyond the final weights; ``apply(layer, x, topk_weights, topk_ids)`` runs the
fused kernel (CUDA) or the reference loop (CPU).

* ``UnquantizedMoEMethod``: 16-bit (or fp32) experts, today's path.
* ``GroupInt4MoEMethod`` (``int4``, ``int4-g32/64/128``, ``int4-asym*``): the canonical int4
  layout stacked over the experts (two per byte, group scales and offsets), unpacked and
  dequantized tile by tile in the kernel.
* ``PerChannelMoEMethod`` (``int8``, ``fp8``): int8 or fp8 e4m3 weights with one scale per
  output channel and expert, ``w13_scale [E, 2I]``, ``w2_scale [E, H]`` (int8: the model dtype,
  ``s = max|w| / 127``; fp8: fp32, ``s = max|w| / 448``): the canonical per-channel layouts of
  ``quantization/formats.py`` stacked over the experts. Quantizing a row needs only that row,
  so each expert (and each tensor-parallel slice of rows) quantizes on its own, exactly as the
  whole stack would. The fused kernel widens the 1-byte tiles in registers and applies the
  scales after the K loop; the CPU dequantizes the touched experts per call (correct, not fast).
  ``fp8-w8a8`` models keep fp8 weight-only experts (the activations of a decode-sized expert
  GEMM are a few rows: quantizing them buys nothing).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from roofline.quantization import formats
from roofline.quantization.int4 import INT4_GROUP_SIZES

EXPERT_TENSORS = ("w13", "w2")


class MoEMethod(ABC):
    """Storage, loading and the kernel of a MoE layer's experts (see the module doc)."""

    quantized: bool = True
    name: str = "16-bit"

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        intermediate_size: int,
        hidden_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Register ``w13_weight``/``w2_weight`` (and their scales) for ``num_experts`` local
        experts of ``intermediate_size`` local columns."""

    @abstractmethod
    def load(
        self,
        layer: nn.Module,
        which: str,
        experts: slice,
        rows: slice,
        tensor: torch.Tensor,
    ) -> None:
        """Copy (quantizing) ``tensor`` into ``rows`` of ``<which>_weight[experts]``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``; ids index the local experts, ``E_local`` = not here. The
        fused kernels on CUDA, the (dequantizing) reference loop elsewhere; the layer's
        ``quant_tensors()`` carry the scales and offsets."""
        from roofline.kernels import fused_moe as kernels

        fn = kernels.fused_moe if x.is_cuda else kernels.fused_moe_ref
        quant = layer.quant_tensors()
        return fn(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, **quant)

    def weight_bytes(self, layer: nn.Module, num_experts: int = 1) -> int:
        """Bytes ``num_experts`` experts' weights (and scales) occupy: what a step reads per
        touched expert."""
        total = 0
        for which in EXPERT_TENSORS:
            for suffix in ("weight", "scale", "offset"):
                t = getattr(layer, f"{which}_{suffix}", None)
                if t is not None:
                    total += t[0].numel() * t.element_size()
        return total * num_experts


def _target(layer: nn.Module, which: str, suffix: str) -> torch.Tensor:
    if which not in EXPERT_TENSORS:
        raise ValueError(f"expert tensor must be one of {EXPERT_TENSORS}, got {which!r}")
    return getattr(layer, f"{which}_{suffix}")


def _copy(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


class UnquantizedMoEMethod(MoEMethod):
    """16-bit or fp32 experts in the model dtype."""

    quantized = False

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        intermediate_size: int,
        hidden_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        e, i, h = num_experts, intermediate_size, hidden_size
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h, dtype=params_dtype))
        layer.w2_weight = nn.Parameter(torch.empty(e, h, i, dtype=params_dtype))

    def load(
        self, layer: nn.Module, which: str, experts: slice, rows: slice, tensor: torch.Tensor
    ) -> None:
        target = _target(layer, which, "weight")[experts, rows]  # [E', rows, K]
        _copy(target, tensor.unsqueeze(0) if tensor.dim() == 2 else tensor, which)


class PerChannelMoEMethod(MoEMethod):
    """int8 or fp8 e4m3 experts with per-(expert, output channel) scales (see the module doc)."""

    def __init__(self, kind: str) -> None:
        if kind not in ("int8", "fp8"):
            raise ValueError(f"per-channel MoE quantization is int8 or fp8, not {kind!r}")
        self.kind = kind
        self.name = kind

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        intermediate_size: int,
        hidden_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        e, i, h = num_experts, intermediate_size, hidden_size
        qdtype = torch.int8 if self.kind == "int8" else formats.FP8_DTYPE
        sdtype = params_dtype if self.kind == "int8" else torch.float32
        frozen = dict(requires_grad=False)
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h, dtype=qdtype), **frozen)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, i, dtype=qdtype), **frozen)
        layer.w13_scale = nn.Parameter(torch.zeros(e, 2 * i, dtype=sdtype), **frozen)
        layer.w2_scale = nn.Parameter(torch.zeros(e, h, dtype=sdtype), **frozen)

    def load(
        self, layer: nn.Module, which: str, experts: slice, rows: slice, tensor: torch.Tensor
    ) -> None:
        qtarget = _target(layer, which, "weight")[experts, rows]  # [E', rows, K]
        starget = _target(layer, which, "scale")[experts, rows]  # [E', rows]
        if tensor.dtype in (torch.int8, formats.FP8_DTYPE):
            raise ValueError(
                f"{which}: a {tensor.dtype} expert tensor without its scales; quantized MoE "
                "checkpoints are not supported (quantize a 16-bit checkpoint on the fly)"
            )
        k = qtarget.shape[-1]
        if tensor.shape[-1] != k or tensor.numel() != qtarget.numel():
            raise ValueError(
                f"{which}: checkpoint shape {tuple(tensor.shape)} != {tuple(qtarget.shape)}"
            )
        w = tensor.to(qtarget.device).reshape(-1, k)  # [E' * rows, K]
        if self.kind == "int8":
            q, s = formats.quantize_int8(w, k, starget.dtype)  # [n, K], [n, 1]
        else:
            q, s = formats.quantize_fp8(w)  # [n, K] fp8, [n] fp32
        _copy(qtarget, q.reshape(qtarget.shape), which)
        _copy(starget, s.reshape(starget.shape).to(starget.dtype), f"{which} scales")


class GroupInt4MoEMethod(MoEMethod):
    """int4 experts, two per byte (``w13_weight`` uint8 ``[E, 2I, H // 2]``, low nibble first),
    with scales and offsets per group of ``group_size`` input elements ``[E, N, K // group]``
    in the model dtype: ``w = q * s + offset`` (symmetric: ``offset = -8 s``; asymmetric: a
    zero point). The fused kernel unpacks and dequantizes each tile in registers."""

    def __init__(self, group_size: int, symmetric: bool = True) -> None:
        if group_size not in INT4_GROUP_SIZES:  # the kernels step through K a group at a time
            raise ValueError(f"int4 expert groups must be one of {INT4_GROUP_SIZES}")
        self.group_size = group_size
        self.symmetric = symmetric
        self.name = f"int4-g{group_size}" if symmetric else f"int4-asym-g{group_size}"

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        intermediate_size: int,
        hidden_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        e, i, h, g = num_experts, intermediate_size, hidden_size, self.group_size
        for k in (h, i):
            if k % g or k % 2:
                raise ValueError(
                    f"{self.name}: group size {g} does not divide the experts' {k} input "
                    "features (hidden size and moe_intermediate_size per rank)"
                )
        frozen = dict(requires_grad=False)
        for which, n, k in (("w13", 2 * i, h), ("w2", h, i)):
            w = torch.empty(e, n, k // 2, dtype=torch.uint8)
            setattr(layer, f"{which}_weight", nn.Parameter(w, **frozen))
            for part in ("scale", "offset"):
                t = torch.zeros(e, n, k // g, dtype=params_dtype)
                setattr(layer, f"{which}_{part}", nn.Parameter(t, **frozen))

    def load(
        self, layer: nn.Module, which: str, experts: slice, rows: slice, tensor: torch.Tensor
    ) -> None:
        qtarget = _target(layer, which, "weight")[experts, rows]  # [E', rows, K // 2]
        starget = _target(layer, which, "scale")[experts, rows]  # [E', rows, K // group]
        otarget = _target(layer, which, "offset")[experts, rows]
        k = qtarget.shape[-1] * 2
        if not tensor.is_floating_point() or tensor.shape[-1] != k:
            raise ValueError(
                f"{which}: expected a 16/32-bit [.., {k}] expert tensor to quantize, got "
                f"{tensor.dtype} {tuple(tensor.shape)}"
            )
        if tensor.numel() != starget.shape[0] * starget.shape[1] * k:
            raise ValueError(f"{which}: checkpoint shape {tuple(tensor.shape)} does not fit")
        w = tensor.to(qtarget.device).reshape(-1, k)  # [E' * rows, K]
        q = formats.quantize_int4(w, self.group_size, self.symmetric, starget.dtype)
        _copy(qtarget, q.qweight.reshape(qtarget.shape), which)
        _copy(starget, q.scales.reshape(starget.shape), f"{which} scales")
        _copy(otarget, q.offsets.reshape(otarget.shape), f"{which} offsets")


MOE_METHODS = {"int8": "int8", "fp8": "fp8", "fp8-w8a8": "fp8"}
"""On-the-fly quantization names -> the per-channel kind their experts take."""


def moe_method_for(quantization: str) -> MoEMethod | None:
    """The expert method of an on-the-fly int8 / fp8 scheme (None: no per-channel experts;
    int4 schemes build :class:`GroupInt4MoEMethod` from their group, see the registry)."""
    kind = MOE_METHODS.get(quantization)
    return None if kind is None else PerChannelMoEMethod(kind)
