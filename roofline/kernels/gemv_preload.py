"""One-row skinny GEMM whose weight block is in registers before the previous kernel finishes.

In a batch-1 decode chain every kernel is a programmatic dependent (PDL): it may start while
its predecessor runs, and must wait for it (``griddepcontrol.wait``) before reading its output.
``kernels.gemv`` prefetches a program's first weight lines into L2 before that wait and loads
them after it, so each GEMV still pays an L2 (or DRAM) round trip for its weights once its input
is ready. Here a program loads its whole ``[BLOCK_N, K]`` weight block into registers *before*
the wait (the weights never depend on the step), so after it only x is read: the critical path
of a layer loses one memory round trip per GEMV.

The block is ``BLOCK_N`` rows of ``K`` (padded to a power of two, masked): it applies when that
fits ``MAX_TILE_ELEMS``. The prologues and epilogues are ``kernels.gemv``'s (RMSNorm of x with
its roundings, SiLU-and-mul of a gate/up input, bias, the residual add with the separate add's
roundings); the products are summed over K in one reduction, so the fp32 sum's order (not the
roundings) differs from ``skinny_gemm``'s tiled loop. ``skinny_gemm_ref`` and friends in
``kernels.gemv`` are the references. ``ROOFLINE_GEMV_PRELOAD=1`` (or ``set_enabled(True)``)
turns it on in the fused decode layer (off by default until measured).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from roofline.kernels import is_interpret
from roofline.kernels.gemv import _mul_rn, _rms_norm_tile, _silu_mul, pick_config
from roofline.kernels.pdl import pdl_enabled

MAX_TILE_ELEMS = 16384  # weight elements a program holds (8 x 1024, 4 x 4096 ...)
_ENABLED = os.environ.get("ROOFLINE_GEMV_PRELOAD", "0") == "1"


def set_enabled(enabled: bool) -> None:
    global _ENABLED
    _ENABLED = enabled


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row, and the tuned skinny config's block of rows fits a program's registers."""
    if not (_ENABLED and x.shape[0] == 1 and (x.is_cuda or is_interpret())):
        return False
    n, k = weight.shape
    cfg = pick_config(1, n, k, x.device)
    return cfg.block_n * triton.next_power_of_2(k) <= MAX_TILE_ELEMS


@triton.jit
def _gemv_preload_kernel(
    x_ptr,  # [1, K] ([1, 2K] gate | up with SILU_MUL)
    w_ptr,  # [N, K], rows stride_wn apart
    bias_ptr,
    out_ptr,  # [1, N]
    norm_w_ptr,  # [K]
    residual_ptr,  # [1, N]
    N,
    K,
    stride_wn,
    inv_k,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two of K
    SILU_MUL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    RMS_NORM: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
    k_ok = offs_k < K
    w = tl.load(w_ptr + rows_n[:, None] * stride_wn + offs_k, mask=k_ok, other=0.0)  # [BN, BK]
    if PDL:  # the weight predates the step: in registers before the wait for x
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)  # [1, BK]
    if SILU_MUL:
        x = _silu_mul(x, tl.load(x_ptr + K + offs_k, mask=k_ok, other=0.0), LIBDEVICE, False)
    if RMS_NORM:
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(_mul_rn(xf, xf, LIBDEVICE), axis=1) * inv_k + eps)  # [1]
        x = _rms_norm_tile(x, norm_w_ptr + offs_k, rstd, k_ok, True)
    result = tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)  # [BN]
    if HAS_BIAS:
        result += tl.load(bias_ptr + rows_n).to(tl.float32)
    n_ok = offs_n < N
    result = result.to(out_ptr.dtype.element_ty)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + offs_n, mask=n_ok, other=0.0)
        result = (result.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n, result, mask=n_ok)


def gemv_preload(
    x: torch.Tensor,  # [1, K] ([1, 2K] with silu_mul), contiguous
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: torch.Tensor | None = None,  # [N]
    *,
    silu_mul: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,  # [1, N]
) -> torch.Tensor:  # [1, N]
    """``skinny_gemm(x, weight, bias, silu_mul=..., norm=..., residual=...)`` for one row with
    the weight block loaded before the PDL wait (see the module docstring)."""
    n, k = weight.shape
    assert x.shape == (1, 2 * k if silu_mul else k) and x.is_contiguous()
    assert weight.stride(1) == 1 and x.dtype == weight.dtype
    assert residual is None or (residual.shape == (1, n) and residual.is_contiguous())
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    cfg = pick_config(1, n, k, x.device)
    block_k = triton.next_power_of_2(k)
    compiled = not is_interpret()
    pdl = compiled and pdl_enabled()
    norm_w, eps = norm if norm is not None else (weight, 0.0)
    meta: dict = {"launch_pdl": True} if pdl else {}
    _gemv_preload_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, out, norm_w,
        residual if residual is not None else out, n, k, weight.stride(0), 1.0 / k, eps,
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=block_k, SILU_MUL=silu_mul,
        LIBDEVICE=(silu_mul or norm is not None) and compiled, RMS_NORM=norm is not None,
        ADD_RESIDUAL=residual is not None, PDL=pdl,
        num_warps=4 if cfg.block_n * block_k <= 8192 else 8, **meta,
    )  # fmt: skip
    return out
