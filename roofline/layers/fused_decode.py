"""Batch-1 decode through a Llama-family decoder layer in fewer kernels: each RMSNorm runs inside
the skinny GEMM that reads its output, each residual add inside the GEMM that produces its
addend.

At one row, a decoder layer's kernels are each a few microseconds and the step is bound by their
count. This path carries the residual stream ``h`` as one tensor and runs the layer as four
GEMMs (plus RoPE/store and attention)::

    qkv = rms_norm(h, ln_1) @ W_qkv^T          # kernels.gemv: norm prologue
    h   = h + attention(...) @ W_o^T           # residual epilogue
    gu  = rms_norm(h, ln_2) @ W_gate_up^T      # norm prologue
    h   = h + silu_and_mul(gu) @ W_down^T      # SiLU prologue + residual epilogue

where the unfused layer launches two ``fused_add_rms_norm`` kernels besides. Every rounding is
the unfused path's (``kernels.gemv``), except that each GEMM program sums the norm's fp32
statistic in its own order. The layer returns ``(h, None)``: to the next layer (fused or not) and
to the final norm, ``residual=None`` means "x is the whole stream", as after the embedding.

It applies (``applies``) where every GEMM of the layer would run the Triton skinny GEMM on
16-bit weights (``layers.linear.skinny_gemm_applies``) with the unquantized method, or
``kernels.int4_gemv`` on a quantized layer's repacked weight (``gemv_words``: the same norm
prologue, SiLU prologue and residual epilogue), at most ``MAX_ROWS`` rows, a dense MLP, and no
tensor-parallel all-reduce between a GEMM and its add.
``ROOFLINE_FUSED_DECODE=0`` (or ``set_enabled(False)``) turns it off.

An MoE layer (``layers.moe.FusedMoE`` as its MLP, one token) runs its attention half the same
way and its sparse block as ``moe_norm_add``: ``kernels.moe_router`` (the post-attention norm,
the router GEMV and the top-k routing in one launch, which also writes the normalised row), the
two expert GEMVs of ``kernels.fused_moe``, and the residual add; ``ROOFLINE_FUSED_MOE_DECODE=0``
(or ``set_moe_enabled(False)``) keeps such layers unfused.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from roofline.layers.linear import MergedLinear, skinny_gemm_applies

if TYPE_CHECKING:
    from roofline.layers.moe import FusedMoE

# Rows up to which the fused layer runs. Every program of a norm-prologue GEMM re-reads all M x K
# inputs for the statistic, which pays at one row (as the SiLU prologue: layers.linear).
MAX_ROWS = 1
_ENABLED = os.environ.get("ROOFLINE_FUSED_DECODE", "1") != "0"
SILU_EPILOGUE = os.environ.get("ROOFLINE_GEMV_SILU_EPILOGUE", "1") != "0"
"""Quantized (repacked) MLPs: the gate | up GEMV computes the SiLU-and-mul in its epilogue."""
_MOE_ENABLED = os.environ.get("ROOFLINE_FUSED_MOE_DECODE", "1") != "0"
MOE_FUSE_RESIDUAL = True
"""``moe_norm_add`` adds the residual in the down GEMV's store (False: a separate add launch;
benchmarks compare)."""
MOE_ROUTE_IN_GATE_UP = True
"""``moe_norm_add``'s router stores its logits only and each gate/up GEMV program routes them
itself (``fused_moe(route_logits=...)``): no counter and no last-program routing between the
router and the experts. H100, Qwen3-30B-A3B batch 1 (48 layers): 3.381 -> 3.329 ms a step
alone, 3.083 -> 3.040 with the fused attention (``scripts/gpu_moe5.py``). False: the router
routes (``moe_router``)."""


def set_enabled(enabled: bool) -> None:
    """Turn the fused decode layer on or off for forwards from now on (benchmarks compare)."""
    global _ENABLED
    _ENABLED = enabled


def set_moe_enabled(enabled: bool) -> None:
    """Turn the fused MoE layers (``moe_norm_add``) on or off for forwards from now on."""
    global _MOE_ENABLED
    _MOE_ENABLED = enabled


def _plain_skinny(linear: nn.Module) -> bool:
    from roofline.quantization.base import UnquantizedLinearMethod

    return (
        isinstance(linear, MergedLinear)
        and type(linear).forward is MergedLinear.forward
        and type(linear.method) is UnquantizedLinearMethod
    )


def _gemv_linear(linear: nn.Module) -> bool:
    """A quantized linear with the repacked weight ``kernels.int4_gemv`` reads."""
    return (
        isinstance(linear, MergedLinear)
        and type(linear).forward is MergedLinear.forward
        and getattr(linear, "gemv_words", None) is not None
    )


def layer_supports(layer: nn.Module) -> bool:
    """Shape-independent part of ``applies``: plain 16-bit (or repacked quantized) linears, a
    dense MLP or an MoE block with a plain router, no TP reduce."""
    from roofline.layers.moe import FusedMoE
    from roofline.models.llama import LlamaMLP

    attn, mlp = layer.self_attn, layer.mlp
    if attn.reduce is not None:
        return False
    if isinstance(mlp, FusedMoE):  # experts of any MoE method; a 16-bit router
        return (
            all(_plain_skinny(m) or _gemv_linear(m) for m in (attn.qkv_proj, attn.o_proj))
            and _plain_skinny(mlp.gate)
            and mlp.gate.bias is None
            and mlp.dispatch is None
            and mlp.reduce is None
        )
    return (
        isinstance(mlp, LlamaMLP)
        and mlp.reduce is None
        and all(
            _plain_skinny(m) or _gemv_linear(m)
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        )
    )


def applies(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``layer`` (a ``LlamaDecoderLayer`` whose ``layer_supports``) runs fused on
    ``x: [num_tokens, hidden]``. Shapes only: no host sync, capturable."""
    from roofline.layers.moe import FusedMoE

    if not (_ENABLED and x.is_cuda and x.shape[0] <= MAX_ROWS):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    m = x.shape[0]
    if not (
        layer.input_layernorm.weight.dtype == x.dtype
        and layer.post_attention_layernorm.weight.dtype == x.dtype
        and _linear_applies(m, attn.qkv_proj, x, "norm", first=True)
        and _linear_applies(m, attn.o_proj, x)
    ):
        return False
    if isinstance(mlp, FusedMoE):  # one token: moe_norm_add
        return _MOE_ENABLED and m == 1 and mlp.gate.weight.dtype == x.dtype
    return _linear_applies(m, mlp.gate_up_proj, x, "norm") and _linear_applies(
        m, mlp.down_proj, x, "silu"
    )


def _linear_applies(
    m: int, linear: MergedLinear, x: torch.Tensor, prologue: str | None = None, first=False
) -> bool:
    """int4_gemv's conditions with that prologue for a repacked quantized linear; else the
    skinny GEMM's (the layer's first GEMM reads x itself: ``skinny_gemm_applies``)."""
    if _gemv_linear(linear):
        from roofline.kernels import int4_gemv

        if prologue == "silu" and not _gemv_fuses_silu(linear):
            prologue = None  # a separate silu_and_mul launch, then the GEMV
        words, group, bits = linear.gemv_words, linear.gemv_group, linear.gemv_bits
        return int4_gemv.takes(m, x.dtype, x.device, words, group, bits, prologue)
    if first:
        return skinny_gemm_applies(x, linear.weight)
    return _applies_to(m, linear.weight, x)


def _gemv_fuses_silu(linear: MergedLinear) -> bool:
    from roofline.quantization import common

    return common.gemv_fuses_silu(linear)


def _applies_to(m: int, weight: torch.Tensor, x: torch.Tensor) -> bool:
    # The GEMM's input is a fresh contiguous [m, K] tensor of x's dtype and device, and x has
    # passed skinny_gemm_applies: only the weight's measured config is left to check.
    from roofline.kernels.gemv import TUNED_CONFIGS, m_bucket

    n, k = weight.shape
    return weight.dtype == x.dtype and (n, k, m_bucket(m)) in TUNED_CONFIGS


def norm_linear(linear: MergedLinear, norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``linear(norm(h))`` in one kernel. h: [M, K] -> [M, N]."""
    if _gemv_linear(linear):
        from roofline.kernels.int4_gemv import int4_gemv

        return int4_gemv(h, linear.gemv_words, linear.gemv_pairs, linear.bias,
                         norm=(norm.weight, norm.eps), bits=linear.gemv_bits)  # fmt: skip
    from roofline.kernels import gemv_preload
    from roofline.kernels.gemv import skinny_gemm

    if gemv_preload.applies(h, linear.weight):  # the weight in registers before the PDL wait
        norm_w = (norm.weight, norm.eps)
        return gemv_preload.gemv_preload(h, linear.weight, linear.bias, norm=norm_w)
    return skinny_gemm(h, linear.weight, linear.bias, norm=(norm.weight, norm.eps))


def linear_add(
    linear: MergedLinear, x: torch.Tensor, residual: torch.Tensor, silu_mul: bool = False
) -> torch.Tensor:
    """``residual + linear(x)`` (``linear(silu_and_mul(x))`` with ``silu_mul``) in one kernel."""
    if _gemv_linear(linear):
        from roofline.kernels.activation import silu_and_mul
        from roofline.kernels.int4_gemv import int4_gemv

        fuse = silu_mul and _gemv_fuses_silu(linear)
        if silu_mul and not fuse:
            x = silu_and_mul(x)
        return int4_gemv(x, linear.gemv_words, linear.gemv_pairs, linear.bias, silu_mul=fuse,
                         residual=residual, bits=linear.gemv_bits)  # fmt: skip
    from roofline.kernels import gemv_preload
    from roofline.kernels.gemv import skinny_gemm

    if gemv_preload.applies(x, linear.weight):
        return gemv_preload.gemv_preload(x, linear.weight, linear.bias, silu_mul=silu_mul,
                                         residual=residual)  # fmt: skip
    return skinny_gemm(x, linear.weight, linear.bias, silu_mul=silu_mul, residual=residual)


def mlp_norm_add(
    gate_up: MergedLinear,
    down: MergedLinear,
    norm: nn.Module,
    h: torch.Tensor,  # [M, hidden]: the residual stream
    residual: torch.Tensor,  # [M, hidden]
) -> torch.Tensor:
    """``residual + down(silu_and_mul(gate_up(norm(h))))``: on repacked quantized linears the
    gate | up GEMV writes ``silu(gate) * up`` itself (``int4_gemv``'s ``silu_out``: no SiLU
    launch, half the down projection's input; ``SILU_EPILOGUE``), else as two GEMMs."""
    if SILU_EPILOGUE and _gemv_linear(gate_up) and _gemv_linear(down):
        from roofline.kernels import int4_gemv

        words, bits = gate_up.gemv_words, gate_up.gemv_bits
        k = int4_gemv.weight_k(words, bits)
        fmt = int4_gemv.table_format(words, bits, gate_up.gemv_group)
        cfg = int4_gemv.pick_config(words.shape[0], k, gate_up.gemv_group, h.shape[0], h.device,
                                    fmt, "norm")  # fmt: skip
        plain_down = int4_gemv.takes(h.shape[0], h.dtype, h.device, down.gemv_words,
                                     down.gemv_group, down.gemv_bits)  # fmt: skip
        if cfg is not None and plain_down and int4_gemv.splits_gate_up(words.shape[0], cfg):
            act = int4_gemv.int4_gemv(h, words, gate_up.gemv_pairs, gate_up.bias,
                                      norm=(norm.weight, norm.eps), silu_out=True, bits=bits,
                                      config=cfg)  # fmt: skip
            return linear_add(down, act, residual)
    return linear_add(down, norm_linear(gate_up, norm, h), residual, silu_mul=True)


def moe_norm_add(moe: FusedMoE, norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``h + moe(norm(h))`` for one token in three launches (``kernels.moe_router``: norm,
    router and top-k routing in one; the gate/up GEMV; the down GEMV with the routing weights,
    the top-k sum and the residual add in its store) where the unfused block took six. With
    ``MOE_ROUTE_IN_GATE_UP`` the router stores its logits and the gate/up GEMV routes them. The
    experts may be 16-bit or quantized (the method's scales go to the kernel)."""
    from roofline.kernels.fused_moe import GEMV_MAX_PAIRS, fused_moe, warm_up
    from roofline.kernels.moe_router import moe_router, router_logits

    quant = moe.quant_tensors()
    if not moe._warmed:  # the first (eager) forward compiles every variant, as FusedMoE's
        warm_up(h, moe.w13_weight, moe.w2_weight, moe.top_k, quant)
        moe._warmed = True
    routed = None  # (xn [1, H], logits [E]) where the router's preloading kernel runs
    if MOE_ROUTE_IN_GATE_UP and MOE_FUSE_RESIDUAL and moe.top_k <= GEMV_MAX_PAIRS:
        routed = router_logits(h, norm.weight, norm.eps, moe.gate.weight)
    if routed is not None:
        xn, logits = routed
        weights = torch.empty(1, moe.top_k, dtype=h.dtype, device=h.device)  # the gate/up's
        ids = torch.empty(1, moe.top_k, dtype=torch.int64, device=h.device)
        return fused_moe(xn, moe.w13_weight, moe.w2_weight, weights, ids, residual=h,
                         route_logits=(logits, moe.renormalize), **quant)  # fmt: skip
    xn, weights, ids = moe_router(h, norm.weight, norm.eps, moe.gate.weight, moe.top_k,
                                  moe.renormalize)  # fmt: skip
    if not MOE_FUSE_RESIDUAL:
        return h + fused_moe(xn, moe.w13_weight, moe.w2_weight, weights, ids, **quant)
    return fused_moe(xn, moe.w13_weight, moe.w2_weight, weights, ids, residual=h,
                     **quant)  # fmt: skip  # [1, hidden]
