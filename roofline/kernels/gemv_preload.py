"""One-row skinny GEMM whose weight block is in registers before the previous kernel finishes.

In a batch-1 decode chain every kernel is a programmatic dependent (PDL): it may start while
its predecessor runs, and must wait for it (``griddepcontrol.wait``) before reading its output.
``kernels.gemv`` prefetches a program's first weight lines into L2 before that wait and loads
them after it, so each GEMV still pays an L2 (or DRAM) round trip for its weights once its input
is ready. Here a program loads its whole ``[BLOCK_N, K]`` weight block into registers *before*
the wait (the weights never depend on the step), so after it only x is read: the critical path
of a layer loses one memory round trip per GEMV.

The block is ``BLOCK_N`` rows of ``K``, held as two tiles: the largest power of two not above K
(``BLOCK_K``) and the rest rounded up to a power of two (``BLOCK_K2``, masked; 0 when K is a power
of two), so K = 3072 holds 2048 + 1024 columns rather than a padded 4096. It applies when the
block fits ``MAX_TILE_ELEMS``; ``OVERRIDES`` maps ``(N, K)`` to the program's ``(BLOCK_N,
num_warps)`` where a measurement chose them (else the skinny GEMM's tuned BLOCK_N).

The prologues and epilogues are ``kernels.gemv``'s (RMSNorm of x with its roundings, SiLU-and-mul
of a gate/up input, bias, the residual add with the separate add's roundings); the products are
summed over each tile in one reduction, so the fp32 sum's order (not the roundings) differs from
``skinny_gemm``'s tiled loop. ``skinny_gemm_ref`` and friends in
``kernels.gemv`` are the references. On by default in the fused decode layer;
``ROOFLINE_GEMV_PRELOAD=0`` (or ``set_enabled(False)``) turns it off. A row's bits at one row
already differ from the same row's among several (the batched rows take a separate RMSNorm and
the tensor-core skinny GEMM, the one-row fused layer the norm prologue and CUDA-core sums), so
this order is one more of the one-row path's, not a new kind of batch dependence.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from roofline.kernels import is_interpret
from roofline.kernels.gemv import _mul_rn, _silu_mul, pick_config
from roofline.kernels.pdl import pdl_enabled

# Weight elements a program holds: Qwen3-0.6B's blocks (8 x 1024, 4 x 2048, 4 x 3072). Not
# Qwen3-30B-A3B's 16k-element qkv and o blocks: its 8-layer batch-1 decode measured 1,110 ->
# 1,075 tok/s with them (H100, scripts/gpu_qwen06.py).
MAX_TILE_ELEMS = 12288
# (N, K) -> (BLOCK_N, num_warps) where measured; else pick_config's BLOCK_N and _num_warps
OVERRIDES: dict[tuple[int, int], tuple[int, int]] = {}
_ENABLED = os.environ.get("ROOFLINE_GEMV_PRELOAD", "1") != "0"


def set_enabled(enabled: bool) -> None:
    global _ENABLED
    _ENABLED = enabled


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row, and the tuned skinny config's block of rows fits a program's registers."""
    if not (_ENABLED and x.shape[0] == 1 and (x.is_cuda or is_interpret())):
        return False
    n, k = weight.shape
    block_n, _ = _block_n_warps(n, k, x.device)
    block_k, block_k2 = k_tiles(k)
    return block_n * (block_k + block_k2) <= MAX_TILE_ELEMS


def k_tiles(k: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_K2): the largest power of two <= K, and the rest's next power of two."""
    block_k = 1 << (k.bit_length() - 1)
    rest = k - block_k
    return block_k, (triton.next_power_of_2(rest) if rest else 0)


def _block_n_warps(n: int, k: int, device: torch.device) -> tuple[int, int]:
    override = OVERRIDES.get((n, k))
    if override is not None:
        return override
    block_n = pick_config(1, n, k, device).block_n
    block_k, block_k2 = k_tiles(k)
    return block_n, 4 if block_n * (block_k + block_k2) <= 8192 else 8


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
    BLOCK_K: tl.constexpr,  # the largest power of two <= K: columns [0, BLOCK_K), unmasked
    BLOCK_K2: tl.constexpr,  # columns [BLOCK_K, K) in a masked tile of this width (0: none)
    SILU_MUL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    RMS_NORM: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
    w_rows = w_ptr + rows_n[:, None] * stride_wn  # [BN, 1]
    # Everything that predates the step is in registers before the wait: the weight block, the
    # norm weight, the bias.
    w = tl.load(w_rows + offs_k)  # [BN, BK]
    if BLOCK_K2 > 0:
        offs_k2 = BLOCK_K + tl.arange(0, BLOCK_K2)[None, :]  # [1, BK2]
        k2_ok = offs_k2 < K
        w2 = tl.load(w_rows + offs_k2, mask=k2_ok, other=0.0)  # [BN, BK2]
    if RMS_NORM:
        nw = tl.load(norm_w_ptr + offs_k).to(tl.float32)  # [1, BK]
        if BLOCK_K2 > 0:
            nw2 = tl.load(norm_w_ptr + offs_k2, mask=k2_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows_n).to(tl.float32)  # [BN]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # After the wait: the step's data, every load issued at once (the residual's too, which
    # would otherwise be a second round trip after the reductions).
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + offs_n, mask=n_ok, other=0.0)  # [BN]
    x = tl.load(x_ptr + offs_k)  # [1, BK]
    if SILU_MUL:
        x = _silu_mul(x, tl.load(x_ptr + K + offs_k), LIBDEVICE, False)
    if BLOCK_K2 > 0:
        x2 = tl.load(x_ptr + offs_k2, mask=k2_ok, other=0.0)  # [1, BK2]
        if SILU_MUL:  # silu(0) * 0 = 0 past K
            x2 = _silu_mul(x2, tl.load(x_ptr + K + offs_k2, mask=k2_ok, other=0.0), LIBDEVICE,
                           False)  # fmt: skip
    if RMS_NORM:  # rms_norm's roundings (kernels.gemv._rms_norm_tile)
        xf = x.to(tl.float32)
        sq = tl.sum(_mul_rn(xf, xf, LIBDEVICE), axis=1)  # [1]
        if BLOCK_K2 > 0:
            xf2 = x2.to(tl.float32)
            sq += tl.sum(_mul_rn(xf2, xf2, LIBDEVICE), axis=1)
        rstd = tl.rsqrt(sq * inv_k + eps)[:, None]  # [1, 1]
        x = ((xf * rstd).to(x.dtype).to(tl.float32) * nw).to(x.dtype)
        if BLOCK_K2 > 0:
            x2 = ((xf2 * rstd).to(x2.dtype).to(tl.float32) * nw2).to(x2.dtype)
    result = tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)  # [BN]
    if BLOCK_K2 > 0:
        result += tl.sum(w2.to(tl.float32) * x2.to(tl.float32), axis=1)
    if HAS_BIAS:
        result += bias
    result = result.to(out_ptr.dtype.element_ty)
    if ADD_RESIDUAL:
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
    block_n, num_warps = _block_n_warps(n, k, x.device)
    block_k, block_k2 = k_tiles(k)
    compiled = not is_interpret()
    pdl = compiled and pdl_enabled()
    norm_w, eps = norm if norm is not None else (weight, 0.0)
    meta: dict = {"launch_pdl": True} if pdl else {}
    _gemv_preload_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, norm_w,
        residual if residual is not None else out, n, k, weight.stride(0), 1.0 / k, eps,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_K2=block_k2,
        SILU_MUL=silu_mul, LIBDEVICE=(silu_mul or norm is not None) and compiled,
        RMS_NORM=norm is not None, ADD_RESIDUAL=residual is not None, PDL=pdl,
        num_warps=num_warps, **meta,
    )  # fmt: skip
    return out
