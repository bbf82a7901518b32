"""SiLU-and-mul, the gated activation of Llama/Qwen MLPs: ``silu(x[:, :I]) * x[:, I:]``.

The gate and up projections come out of one fused matmul as ``x: [N, 2 * I]``; this kernel
reads each row once and writes ``[N, I]``. Numerics match the eager ``F.silu(gate) * up`` (HF's
``act_fn(gate_proj(x)) * up_proj(x)``) op by op: the SiLU is computed in fp32 the way torch's CUDA
kernel computes it, ``g / (1 + expf(-g))`` with libdevice's ``expf`` and an IEEE division (not
Triton's default ``ex2.approx`` exp and approximate division), rounded to the input dtype; then
the product is computed in fp32 and rounded once more. In the CPU interpreter the exp is numpy's,
which can differ from torch's by an ulp. Grid: (rows, column blocks of BLOCK features).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from roofline.kernels import check_device, is_interpret


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _expf(x, LIBDEVICE: tl.constexpr):
    """fp32 exp: libdevice's ``expf`` (what torch's CUDA kernels call), or ``tl.exp`` where there
    is no libdevice (the CPU interpreter)."""
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)  # [BLOCK]
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = tl.math.div_rn(g, 1.0 + _expf(-g, LIBDEVICE))  # torch: x / (1 + exp(-x)) in fp32
    act = act.to(gate.dtype).to(tl.float32)  # F.silu's result, stored in the input dtype
    out = act * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    check_device(x)
    assert x.shape[-1] % 2 == 0 and x.stride(-1) == 1
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)  # [N, 2I]
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)  # [N, I]
    if x2.shape[0] == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (x2.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=block, LIBDEVICE=not is_interpret(),
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out
