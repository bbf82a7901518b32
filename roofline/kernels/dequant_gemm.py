"""Fused dequantize-and-multiply GEMMs for quantized weights: ``out[M, N] = x[M, K] @ W^T`` with
W held in one of the canonical layouts of ``roofline.quantization.formats`` (int8 with group
scales, int4 nibbles with group scales and offsets, fp8 e4m3 with per-channel scales).

``dequant_gemm`` is the decode kernel (M up to 16; larger batches take row blocks of 32 or 64,
re-reading W once per block): the structure of
``kernels.gemv`` (one program per BLOCK_N output columns, the whole of K walked in
``[BLOCK_N, BLOCK_K]`` tiles with ``num_stages`` tiles in flight, a second grid axis for further
blocks of BLOCK_M rows), except that a tile is read quantized (1 or 1/2 byte per element) and
widened in registers: ``w = q * s (+ offset)`` in fp32, rounded to x's dtype, then reduced on
tensor cores (``tl.dot``) or, for one row, by CUDA-core FMAs. A group's scale (and offset) is
loaded once per tile row when BLOCK_K <= group, or once per group and broadcast over it when
BLOCK_K spans several groups. Where a row has one scale (fp8, per-channel int8) the scale is
applied once to the finished dot products instead of to every weight. ``silu_mul=True`` takes an
MLP's gate/up output ``[M, 2K]`` and feeds ``silu(gate) * up`` to the GEMM (the prologue of
``kernels.gemv``).

``dequantize_weight`` writes the dequantized ``[N, K]`` weight in x's dtype with the same tile
code, for the large-M path (dequantize into a cuBLAS GEMM). No split-K: at the Llama-3.1-8B
shapes N / BLOCK_N already gives over 1.5 programs per SM. ``dequant_gemm_ref`` (plain torch:
dequantize, round to x's dtype, fp32 matmul) defines what both compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret, num_sms
from roofline.kernels.gemv import _silu_mul, heuristic_config, m_bucket
from roofline.quantization import formats

KIND_INT8, KIND_INT4, KIND_FP8 = 0, 1, 2
MAX_DECODE_BLOCK_M = 16  # up to here BLOCK_M = M's power-of-two bucket; above, 32 or 64 rows
_KINDS = {"int8": KIND_INT8, "int4": KIND_INT4, "fp8": KIND_FP8}


def dequantize_ref(
    kind: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K] in dtype
    if kind == "int8":
        return formats.dequantize_int8(qweight, scales, dtype)
    if kind == "int4":
        assert offsets is not None
        return formats.dequantize_int4(qweight, scales, offsets, dtype)
    return formats.dequantize_fp8(qweight, scales, dtype)


def dequant_gemm_ref(
    kind: str,
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    w = dequantize_ref(kind, qweight, scales, offsets, x.dtype)  # [N, K]
    out = x.float() @ w.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@triton.jit
def _load_tile(
    q_ptrs,  # [BN, BK] element pointers (int8/fp8) or [BN, BK // 2] byte pointers (int4)
    s_ptr,
    o_ptr,
    rows_n,  # [BN] int64
    k0,  # first K element of the tile
    stride_s,
    KIND: tl.constexpr,
    GROUP: tl.constexpr,
    ROW_SCALE: tl.constexpr,  # one scale per row: applied after the loop, not here
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One weight tile dequantized to fp32 [BN, BK] (unscaled when ROW_SCALE)."""
    if KIND == 1:
        b = tl.load(q_ptrs, eviction_policy="evict_first")  # [BN, BK // 2] uint8
        q = tl.join(b & 0xF, b >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)
    else:
        q = tl.load(q_ptrs, eviction_policy="evict_first").to(tl.float32)  # [BN, BK]
    if ROW_SCALE:
        return q
    if BLOCK_K <= GROUP:
        col = k0 // GROUP
        s = tl.load(s_ptr + rows_n * stride_s + col).to(tl.float32)[:, None]  # [BN, 1]
        w = q * s
        if KIND == 1:
            w += tl.load(o_ptr + rows_n * stride_s + col).to(tl.float32)[:, None]
    else:
        NG: tl.constexpr = BLOCK_K // GROUP
        cols = k0 // GROUP + tl.arange(0, NG)  # [NG]
        idx = rows_n[:, None] * stride_s + cols[None, :]  # [BN, NG]
        s = tl.load(s_ptr + idx).to(tl.float32)
        s = tl.broadcast_to(s[:, :, None], (BLOCK_N, NG, GROUP)).reshape(BLOCK_N, BLOCK_K)
        w = q * s
        if KIND == 1:
            o = tl.load(o_ptr + idx).to(tl.float32)
            w += tl.broadcast_to(o[:, :, None], (BLOCK_N, NG, GROUP)).reshape(BLOCK_N, BLOCK_K)
    return w


@triton.jit
def _scale_bias_store(
    result,  # [BM, BN] fp32
    s_ptr,
    bias_ptr,
    out_ptr,
    rows_n,  # [BN] weight rows, clamped in range
    offs_m,  # [BM]
    offs_n,  # [BN]
    M,
    N,
    stride_om,
    ROW_SCALE: tl.constexpr,
    SCALAR_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """The quantized GEMMs' epilogue (``dequant_gemm`` and ``quant_gemv``): the per-row (or
    per-tensor) scale applied after the reduction, the bias, the masked store."""
    if ROW_SCALE:
        if SCALAR_SCALE:
            result *= tl.load(s_ptr).to(tl.float32)
        else:
            result *= tl.load(s_ptr + rows_n).to(tl.float32)[None, :]
    if HAS_BIAS:
        result += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _dequant_gemm_kernel(
    x_ptr,  # [M, K] ([M, 2K] gate | up with SILU_MUL)
    q_ptr,  # int8/fp8 [N, K] or uint8 [N, K // 2]
    s_ptr,  # [N, K // GROUP] (ROW_SCALE: [N], or [1] if SCALAR_SCALE)
    o_ptr,  # [N, K // GROUP] (int4 only)
    bias_ptr,
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_s,
    stride_om,
    KIND: tl.constexpr,
    GROUP: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    SCALAR_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_DOT: tl.constexpr,
    SILU_MUL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    if KIND == 1:
        q_ptrs = q_ptr + rows_n[:, None] * stride_qn + tl.arange(0, BLOCK_K // 2)[None, :]
        q_step = BLOCK_K // 2
    else:
        q_ptrs = q_ptr + rows_n[:, None] * stride_qn + offs_k[None, :]
        q_step = BLOCK_K
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    if USE_DOT or BLOCK_M > 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = _load_tile(
            q_ptrs, s_ptr, o_ptr, rows_n, k0, stride_s, KIND, GROUP, ROW_SCALE, BLOCK_N, BLOCK_K
        )
        if SILU_MUL:
            x = _silu_mul(tl.load(x_ptrs), tl.load(x_ptrs + K), LIBDEVICE, USE_DOT)  # [BM, BK]
        else:
            x = tl.load(x_ptrs)  # [BM, BK]
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        elif BLOCK_M == 1:
            acc += w.to(x.dtype).to(tl.float32) * x.to(tl.float32)
        else:
            wf = w.to(x.dtype).to(tl.float32)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * wf[None, :, :], axis=2)
        q_ptrs += q_step
        x_ptrs += BLOCK_K
    if USE_DOT or BLOCK_M > 1:
        result = acc
    else:
        result = tl.sum(acc, axis=1)[None, :]  # [1, BN]
    _scale_bias_store(
        result, s_ptr, bias_ptr, out_ptr, rows_n, offs_m, offs_n, M, N, stride_om,
        ROW_SCALE, SCALAR_SCALE, HAS_BIAS,
    )  # fmt: skip


@triton.jit
def _dequantize_kernel(
    q_ptr,
    s_ptr,
    o_ptr,
    out_ptr,  # [N, K] in the activation dtype
    N,
    K,
    stride_qn,
    stride_s,
    KIND: tl.constexpr,
    GROUP: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    SCALAR_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if KIND == 1:
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        q_ptrs = q_ptr + rows_n[:, None] * stride_qn + cols[None, :]
    else:
        q_ptrs = q_ptr + rows_n[:, None] * stride_qn + offs_k[None, :]
    w = _load_tile(
        q_ptrs, s_ptr, o_ptr, rows_n, k0, stride_s, KIND, GROUP, ROW_SCALE, BLOCK_N, BLOCK_K
    )
    if ROW_SCALE:
        if SCALAR_SCALE:
            w *= tl.load(s_ptr).to(tl.float32)
        else:
            w *= tl.load(s_ptr + rows_n).to(tl.float32)[:, None]
    ptrs = out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=offs_n[:, None] < N)


def _layout(
    kind: str, qweight: torch.Tensor, scales: torch.Tensor, k: int
) -> tuple[int, bool, bool, int]:
    """(group, row_scale, scalar_scale, stride_s) of a weight's scales. One scale per row
    (fp8, per-channel int8) is applied after the reduction; int4 always has groups (offsets)."""
    if kind == "fp8" or scales.dim() == 1:
        return k, True, scales.numel() == 1, 1
    num_groups = scales.shape[1]
    if k % num_groups:
        raise ValueError(f"dequant_gemm: {num_groups} scale groups do not divide K = {k}")
    return k // num_groups, kind == "int8" and num_groups == 1, False, scales.stride(0)


def _block_k(k: int, group: int, block_k: int) -> int:
    """The config's BLOCK_K, halved (down to 16) until it divides the group (a tile in one
    group), or until a power-of-two group divides it (a tile of whole groups)."""
    while block_k > 16 and group % block_k and not (block_k % group == 0):
        block_k //= 2
    if group % block_k and block_k % group:
        raise ValueError(f"dequant_gemm: no K tile fits groups of {group} (K = {k})")
    if k % block_k:
        raise ValueError(f"dequant_gemm: K = {k} is not a multiple of {block_k}")
    return block_k


def dequant_gemm(
    kind: str,
    x: torch.Tensor,  # [M, K] ([M, 2K] with silu_mul), half precision or fp32, rows contiguous
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ dequantize(W)^T (+ bias)`` in one launch (see the module doc)."""
    check_device(x, qweight)
    code = _KINDS[kind]
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if kind == "int4" else 1)
    if x.shape[1] != (2 * k if silu_mul else k) or x.stride(1) != 1:
        raise ValueError(f"dequant_gemm: x {tuple(x.shape)} does not match weight [{n}, {k}]")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    group, row_scale, scalar, stride_s = _layout(kind, qweight, scales, k)
    cfg = heuristic_config(n, k, num_sms(x.device))
    if m > MAX_DECODE_BLOCK_M:  # batches: taller row blocks, so W is re-read ceil(M / 64) times
        cfg = cfg._replace(block_k=min(cfg.block_k, 128), num_stages=3)
    bk = _block_k(k, group, block_k or cfg.block_k)
    bn = block_n or cfg.block_n
    block_m = m_bucket(m) if m <= MAX_DECODE_BLOCK_M else (32 if m <= 32 else 64)
    use_dot = x.dtype != torch.float32 and m > 1
    grid = (triton.cdiv(n, bn), triton.cdiv(m, block_m))
    _dequant_gemm_kernel[grid](
        x, qweight, scales, offsets if offsets is not None else scales,
        bias if bias is not None else scales, out, m, n, k,
        x.stride(0), qweight.stride(0), stride_s, out.stride(0),
        KIND=code, GROUP=group, ROW_SCALE=row_scale, SCALAR_SCALE=scalar,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        NUM_STAGES=num_stages or cfg.num_stages, USE_DOT=use_dot, SILU_MUL=silu_mul,
        LIBDEVICE=silu_mul and not is_interpret(), num_warps=num_warps or cfg.num_warps,
    )  # fmt: skip
    return out


def dequantize_weight(
    kind: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [N, K] in dtype
    """The whole weight dequantized (``dequantize_ref``'s values) by one Triton launch, into
    ``out`` when given (contiguous ``[N, K]`` of ``dtype``)."""
    check_device(qweight)
    code = _KINDS[kind]
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if kind == "int4" else 1)
    group, row_scale, scalar, stride_s = _layout(kind, qweight, scales, k)
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    elif out.shape != (n, k) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"dequantize_weight: out {tuple(out.shape)} {out.dtype} is not [{n}, {k}] {dtype}"
        )
    block_n, block_k = 32, _block_k(k, group, 128)
    grid = (triton.cdiv(n, block_n), k // block_k)
    _dequantize_kernel[grid](
        qweight, scales, offsets if offsets is not None else scales, out, n, k,
        qweight.stride(0), stride_s, KIND=code, GROUP=group, ROW_SCALE=row_scale,
        SCALAR_SCALE=scalar, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def dequant_cublas_gemm(
    kind: str,
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N]
    """The large-M path: the weight dequantized into x's dtype by one launch, then cuBLAS."""
    return F.linear(x, dequantize_weight(kind, qweight, scales, offsets, x.dtype), bias)
