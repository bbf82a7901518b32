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
16-bit weights (``layers.linear.skinny_gemm_applies``) with the unquantized method, at most
``MAX_ROWS`` rows, a dense MLP, and no tensor-parallel all-reduce between a GEMM and its add.
``ROOFLINE_FUSED_DECODE=0`` (or ``set_enabled(False)``) turns it off.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from roofline.layers.linear import MergedLinear, skinny_gemm_applies

# Rows up to which the fused layer runs. Every program of a norm-prologue GEMM re-reads all M x K
# inputs for the statistic, which pays at one row (as the SiLU prologue: layers.linear).
MAX_ROWS = 1
_ENABLED = os.environ.get("ROOFLINE_FUSED_DECODE", "1") != "0"


def set_enabled(enabled: bool) -> None:
    """Turn the fused decode layer on or off for forwards from now on (benchmarks compare)."""
    global _ENABLED
    _ENABLED = enabled


def _plain_skinny(linear: nn.Module) -> bool:
    from roofline.quantization.base import UnquantizedLinearMethod

    return (
        isinstance(linear, MergedLinear)
        and type(linear).forward is MergedLinear.forward
        and type(linear.method) is UnquantizedLinearMethod
    )


def layer_supports(layer: nn.Module) -> bool:
    """Shape-independent part of ``applies``: plain 16-bit linears, a dense MLP, no TP reduce."""
    from roofline.models.llama import LlamaMLP

    attn, mlp = layer.self_attn, layer.mlp
    return (
        isinstance(mlp, LlamaMLP)
        and attn.reduce is None
        and mlp.reduce is None
        and all(
            _plain_skinny(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        )
    )


def applies(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``layer`` (a ``LlamaDecoderLayer`` whose ``layer_supports``) runs fused on
    ``x: [num_tokens, hidden]``. Shapes only: no host sync, capturable."""
    if not (_ENABLED and x.is_cuda and x.shape[0] <= MAX_ROWS):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    m = x.shape[0]
    return (
        layer.input_layernorm.weight.dtype == x.dtype
        and layer.post_attention_layernorm.weight.dtype == x.dtype
        and skinny_gemm_applies(x, attn.qkv_proj.weight)
        and _applies_to(m, attn.o_proj.weight, x)
        and _applies_to(m, mlp.gate_up_proj.weight, x)
        and _applies_to(m, mlp.down_proj.weight, x)
    )


def _applies_to(m: int, weight: torch.Tensor, x: torch.Tensor) -> bool:
    # The GEMM's input is a fresh contiguous [m, K] tensor of x's dtype and device, and x has
    # passed skinny_gemm_applies: only the weight's measured config is left to check.
    from roofline.kernels.gemv import TUNED_CONFIGS, m_bucket

    n, k = weight.shape
    return weight.dtype == x.dtype and (n, k, m_bucket(m)) in TUNED_CONFIGS


def norm_linear(linear: MergedLinear, norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``linear(norm(h))`` in one kernel. h: [M, K] -> [M, N]."""
    from roofline.kernels.gemv import skinny_gemm

    return skinny_gemm(h, linear.weight, linear.bias, norm=(norm.weight, norm.eps))


def linear_add(
    linear: MergedLinear, x: torch.Tensor, residual: torch.Tensor, silu_mul: bool = False
) -> torch.Tensor:
    """``residual + linear(x)`` (``linear(silu_and_mul(x))`` with ``silu_mul``) in one kernel."""
    from roofline.kernels.gemv import skinny_gemm

    return skinny_gemm(x, linear.weight, linear.bias, silu_mul=silu_mul, residual=residual)
