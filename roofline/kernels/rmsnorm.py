"""RMSNorm and fused residual-add + RMSNorm, one program per row, fp32 statistics.

Numerics follow HF Llama/Qwen's ``LlamaRMSNorm`` op by op: the row is widened to fp32, scaled by
``rsqrt(mean(x^2) + eps)``, rounded back to the input dtype, and only then multiplied by the
weight (a product rounded once more to the input dtype). ``mean`` is taken as torch's CUDA
reduction does, ``sum(x^2) * fp32(1 / hidden)`` (not a division), and mul-add fusion is off so each
square is rounded before it is summed; only the summation order differs from torch's, which can
move the fp32 statistic by an ulp. The fused variant first forms the new residual
``x + residual`` rounded to the input dtype (what a separate ``torch`` add would store),
normalises that, and returns both, so a decoder layer reads ``x`` and ``residual`` once and
writes two rows instead of three passes over memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret
from roofline.kernels.pdl import pdl_enabled


def rms_norm_ref(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden]
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new_residual), both [..., hidden]
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    inv_hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # a programmatic dependent: the weight before the wait, x after it
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)  # [BLOCK] input dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) * inv_hidden + eps)  # torch's mean: sum * (1/n)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 512))


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_device(x, weight)
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and x.stride(-1) == 1
    x2 = x.reshape(-1, hidden)  # [rows, hidden]
    rows = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        r2 = residual.reshape(-1, hidden)
        res_out = torch.empty_like(x)
        ro2 = res_out.view(-1, hidden)
    else:
        r2, res_out, ro2 = x2, None, out2
    if rows == 0:
        return out, res_out
    block = triton.next_power_of_2(hidden)
    num_warps = _num_warps(block)
    pdl = x.is_cuda and not is_interpret() and pdl_enabled()
    meta: dict = {"launch_pdl": True} if pdl else {}
    _rms_norm_kernel[(rows,)](
        x2,
        r2,
        weight,
        out2,
        ro2,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        ro2.stride(0),
        hidden,
        1.0 / hidden,  # rounded to fp32 at launch: exactly fp32(1 / hidden), torch's mean factor
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        PDL=pdl,
        num_warps=num_warps,
        enable_fp_fusion=False,  # square, then sum (no fma), as pow(2).mean() does
        **meta,
    )
    return out, res_out


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden]
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new_residual = x + residual)
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out
