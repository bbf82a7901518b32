"""Dynamic per-token fp8 (e4m3) activation quantization for W8A8 GEMMs, in one launch.

``quantize_fp8_per_token(x)`` returns ``(q, scales)``: ``scales[m] = max(max|x[m]| / 448,
1e-12)`` in fp32 and ``q[m] = clamp(x[m] / scales[m], -448, 448)`` rounded to e4m3, the values of
``formats.quantize_fp8_per_token`` computed in IEEE arithmetic (plain torch: five launches and
an fp32 copy of x; torch on CUDA divides by a scalar as a multiplication by its reciprocal, so
its scales can differ from these by an ulp). One program per row holds the row in registers
(rows up to ``ONE_CHUNK_MAX``: one read), else walks K twice in ``BLOCK_K`` chunks.

``silu_mul_quantize_fp8_per_token(gate_up)`` quantizes ``silu(gate) * up`` of an MLP's gate/up
output ``[M, 2I]``, so the down projection of a W8A8 MLP never writes or reads the 16-bit
activation. By default (``KERNEL``) it runs ``_fp8_rows_kernel``: persistent (one program per
SM walks rows, the next row's loads issued before this row's arithmetic), a row held as three
power-of-two parts (no pad lanes at 14336), the SiLU's division approximate (2 ulp of fp32
before the activation is rounded to 16 bits as ``kernels.activation.silu_and_mul`` rounds it)
and the quotients taken as products with the row's reciprocal scale (within an ulp of the
quotient): the same scales as ``silu_and_mul`` followed by ``quantize_fp8_per_token`` but for a
16-bit activation rounded the other way now and then, the same e4m3 values but for a rare one a
step apart. ``kernel="rows"`` / ``"row"`` compute exactly those two kernels' values.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret, num_sms
from roofline.kernels.activation import _expf
from roofline.quantization.formats import FP8_DTYPE, FP8_MAX


@triton.jit
def _load_row_chunk(x_ptr, offs, mask, K, SILU_MUL: tl.constexpr, LIBDEVICE: tl.constexpr):
    """fp32 [BLOCK_K] of the row (SILU_MUL: of silu(gate) * up, rounded as silu_and_mul)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if SILU_MUL:
        g = x.to(tl.float32)
        act = tl.math.div_rn(g, 1.0 + _expf(-g, LIBDEVICE)).to(x.dtype).to(tl.float32)
        up = tl.load(x_ptr + K + offs, mask=mask, other=0.0).to(tl.float32)
        return (act * up).to(x.dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _fp8_per_token_kernel(
    x_ptr,  # [M, K] ([M, 2K] gate | up with SILU_MUL)
    q_ptr,  # [M, K] fp8
    s_ptr,  # [M] fp32
    K,
    stride_xm,
    stride_qm,
    FP8_MAX_: tl.constexpr,
    OUT_FP8: tl.constexpr,
    SILU_MUL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # BLOCK_K >= K
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    if ONE_CHUNK:  # the whole row in registers: read (and the SiLU computed) once
        mask = offs < K
        x = _load_row_chunk(x_row, offs, mask, K, SILU_MUL, LIBDEVICE)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX_), 1e-12)
        tl.store(s_ptr + row, scale)
        _store_quantized(q_ptr + row * stride_qm + offs, x, scale, mask, FP8_MAX_, OUT_FP8)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = _load_row_chunk(x_row, k0 + offs, k0 + offs < K, K, SILU_MUL, LIBDEVICE)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX_), 1e-12)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = _load_row_chunk(x_row, k0 + offs, mask, K, SILU_MUL, LIBDEVICE)
            q_ptrs = q_ptr + row * stride_qm + k0 + offs
            _store_quantized(q_ptrs, x, scale, mask, FP8_MAX_, OUT_FP8)


@triton.jit
def _store_quantized(q_ptrs, x, scale, mask, FP8_MAX_: tl.constexpr, OUT_FP8: tl.constexpr):
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX_), FP8_MAX_)
    if OUT_FP8:  # round to nearest even, as torch's conversion (not Triton's default)
        q = q.to(q_ptrs.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(q_ptrs, q, mask=mask)


@triton.jit
def _load_part(x_row, offs, mask, K, SILU_MUL: tl.constexpr):
    """The raw 16-bit values of one part of a row: (gate, up) with SILU_MUL, else (x, x)."""
    g = tl.load(x_row + offs, mask=mask, other=0.0)
    if SILU_MUL:
        u = tl.load(x_row + K + offs, mask=mask, other=0.0)
    else:
        u = g
    return g, u


@triton.jit
def _part_values(g, u, SILU_MUL: tl.constexpr, LIBDEVICE: tl.constexpr, FAST: tl.constexpr):
    """fp32 values of one part (SILU_MUL: silu(gate) * up, rounded as ``silu_and_mul``; FAST:
    the SiLU's division approximate, within 2 ulp of fp32 before the bf16 rounding)."""
    if SILU_MUL:
        gf = g.to(tl.float32)
        if FAST:
            act = tl.fdiv(gf, 1.0 + _expf(-gf, LIBDEVICE), ieee_rounding=False)
        else:
            act = tl.math.div_rn(gf, 1.0 + _expf(-gf, LIBDEVICE))
        act = act.to(g.dtype).to(tl.float32)
        return (act * u.to(tl.float32)).to(g.dtype).to(tl.float32)
    return g.to(tl.float32)


@triton.jit
def _store_part(q_ptrs, x, scale, inv_scale, mask, FP8_MAX_: tl.constexpr, OUT_FP8: tl.constexpr,
                FAST: tl.constexpr):  # fmt: skip
    """``_store_quantized``; FAST: x times the row's reciprocal scale instead of x / scale."""
    if FAST:
        q = tl.minimum(tl.maximum(x * inv_scale, -FP8_MAX_), FP8_MAX_)
        if OUT_FP8:
            q = q.to(q_ptrs.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q_ptrs, q, mask=mask)
    else:
        _store_quantized(q_ptrs, x, scale, mask, FP8_MAX_, OUT_FP8)


@triton.jit
def _fp8_rows_kernel(
    x_ptr,  # [M, K] ([M, 2K] gate | up with SILU_MUL)
    q_ptr,  # [M, K] fp8
    s_ptr,  # [M] fp32
    M,
    K,
    stride_xm,
    stride_qm,
    FP8_MAX_: tl.constexpr,
    OUT_FP8: tl.constexpr,
    SILU_MUL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    PART_A: tl.constexpr,  # a row is three parts (powers of two, PART_A + PART_B + PART_C >= K)
    PART_B: tl.constexpr,
    PART_C: tl.constexpr,
    FAST: tl.constexpr,  # approximate SiLU division, reciprocal scale (see the module doc)
):
    """Persistent: program p quantizes rows p, p + P, p + 2P, ... (P programs), each row held
    in registers as three parts (no lanes wasted on a power-of-two pad: 14336 = 8192 + 4096 +
    2048), and the next row's loads issued before this row is computed, so its HBM reads
    overlap this row's arithmetic."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    oa = tl.arange(0, PART_A)
    ob = PART_A + tl.arange(0, PART_B)
    oc = PART_A + PART_B + tl.arange(0, PART_C)
    ma, mb, mc = oa < K, ob < K, oc < K
    row = pid.to(tl.int64)
    x_row = x_ptr + row * stride_xm
    ga, ua = _load_part(x_row, oa, ma, K, SILU_MUL)  # (pid < M: the grid is at most M)
    gb, ub = _load_part(x_row, ob, mb, K, SILU_MUL)
    gc, uc = _load_part(x_row, oc, mc, K, SILU_MUL)
    for _ in range(pid, M, nprog):  # row = pid, pid + nprog, ...
        cga, cua, cgb, cub, cgc, cuc = ga, ua, gb, ub, gc, uc
        nxt = row + nprog
        has_next = nxt < M
        x_next = x_ptr + nxt * stride_xm
        ga, ua = _load_part(x_next, oa, ma & has_next, K, SILU_MUL)
        gb, ub = _load_part(x_next, ob, mb & has_next, K, SILU_MUL)
        gc, uc = _load_part(x_next, oc, mc & has_next, K, SILU_MUL)
        a = _part_values(cga, cua, SILU_MUL, LIBDEVICE, FAST)
        b = _part_values(cgb, cub, SILU_MUL, LIBDEVICE, FAST)
        c = _part_values(cgc, cuc, SILU_MUL, LIBDEVICE, FAST)
        amax = tl.maximum(
            tl.maximum(tl.max(tl.abs(a), axis=0), tl.max(tl.abs(b), axis=0)),
            tl.max(tl.abs(c), axis=0),
        )
        scale = tl.maximum(tl.div_rn(amax, FP8_MAX_), 1e-12)
        tl.store(s_ptr + row, scale)
        inv_scale = tl.div_rn(1.0, scale)
        q_row = q_ptr + row * stride_qm
        _store_part(q_row + oa, a, scale, inv_scale, ma, FP8_MAX_, OUT_FP8, FAST)
        _store_part(q_row + ob, b, scale, inv_scale, mb, FP8_MAX_, OUT_FP8, FAST)
        _store_part(q_row + oc, c, scale, inv_scale, mc, FP8_MAX_, OUT_FP8, FAST)
        row = nxt


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr,  # [M, H]
    residual_ptr,  # [M, H] (HAS_RESIDUAL)
    weight_ptr,  # [H]
    q_ptr,  # [M, H] fp8
    s_ptr,  # [M] fp32
    residual_out_ptr,  # [M, H] (HAS_RESIDUAL): x + residual
    H,
    inv_hidden,
    eps,
    stride_xm,
    stride_rm,
    stride_qm,
    stride_om,
    FP8_MAX_: tl.constexpr,
    OUT_FP8: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: (x + residual, stored), RMSNorm as ``kernels.rmsnorm`` rounds it (the normed
    row rounded to x's dtype, times the weight, rounded again), then per-token fp8 as
    ``_fp8_per_token_kernel``: the 16-bit normed row is never written."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_rm + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_om + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) * inv_hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (((xf * rstd).to(x.dtype).to(tl.float32)) * w).to(x.dtype).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(y), axis=0), FP8_MAX_), 1e-12)
    tl.store(s_ptr + row, scale)
    _store_quantized(q_ptr + row * stride_qm + offs, y, scale, mask, FP8_MAX_, OUT_FP8)


ONE_CHUNK_MAX = 16384
"""Rows up to this long are held in registers (16 warps: 32 fp32 per thread) and read once;
longer rows are walked twice in chunks (the second read mostly from L2). Measured on the H100:
the two-pass fused SiLU kernel was slower than SiLU-and-mul + quantization (11.5 vs 7.0 us at 16
rows, 410 vs 383 us at 8192 x 14336): it computed the SiLU twice."""


def row_parts(k: int) -> tuple[int, int, int]:
    """Three powers of two covering K with little padding (a row's registers in
    ``_fp8_rows_kernel``): the two largest binary digits of K, then the rest rounded up
    (14336 -> 8192 + 4096 + 2048; 4096 -> 2048 + 1024 + 1024; 11008 -> 8192 + 2048 + 1024)."""
    unit = 16
    k = max(triton.cdiv(k, unit) * unit, 3 * unit)
    parts: list[int] = []
    rest = k
    for _ in range(2):
        if rest <= 0:
            break
        p = 1 << (rest.bit_length() - 1)
        parts.append(max(p, unit))
        rest -= p
    if rest > 0:
        parts.append(max(unit, triton.next_power_of_2(rest)))
    while len(parts) < 3:  # K had fewer digits: halve the largest part
        parts.sort(reverse=True)
        half = parts.pop(0) // 2
        parts[:0] = [half, half]
    return tuple(sorted(parts, reverse=True))  # type: ignore[return-value]


KERNEL = os.environ.get("ROOFLINE_FP8_QUANT", "")
"""Which kernel quantizes (empty: by input, as measured on the H100: SiLU-and-mul rows take
``rows-fast``, plain rows ``row``). ``rows``: ``_fp8_rows_kernel`` (persistent, the next row
prefetched, exact divisions); ``rows-fast``: the same with an approximate SiLU division and the
row's reciprocal scale multiplied in; ``row``: one program per row, exact divisions.

H100, Llama-3.1-8B (SiLU rows: 2 x 14336 in, 14336 out; plain rows: 4096), us at M = 251 /
2048 / 8192: SiLU ``rows`` 14.8 / 73.3 / 267 (74% of the copy floor at 8192), ``row`` 18.5 /
137 / 532 (its one 16-warp program per SM holds a row in registers: loads and arithmetic never
overlap); plain ``row`` 2.7 / 9.5 / 35.8 (95% of the floor), ``rows`` 3.4 / 15.1 / 51.9. The
SiLU rows are bound by the arithmetic of one 16-warp program per SM (the division sequences of
the exact SiLU and quotient are long dependent chains): ``rows-fast`` cuts them, 10.0 / 57.0 /
205 (61% / 87% / 96% of the floor; 32 warps a program: 10.4 / 55.2 / 202)."""
ROWS_WARPS_MAX = 16
"""Warps of a ``_fp8_rows_kernel`` program (fewer for short rows: 8 elements per thread at
least); about 90 registers per thread at 16 warps and 14336 SiLU columns: one program per SM."""
ROWS_PROGRAMS_PER_SM = int(os.environ.get("ROOFLINE_FP8_QUANT_PER_SM", "0"))
"""Programs per SM of the persistent grid (0: one for SiLU rows, whose registers fill an SM,
else 1024 threads' worth)."""


def _launch(x: torch.Tensor, k: int, out_dtype: torch.dtype, silu_mul: bool, kernel: str = ""):
    check_device(x)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"fp8 per-token quantization: x must be 2-D, rows contiguous: {x.shape}")
    m = x.shape[0]
    q = torch.empty(m, k, dtype=out_dtype, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scales
    out_fp8 = out_dtype == FP8_DTYPE
    kernel = kernel or KERNEL or ("rows-fast" if silu_mul else "row")
    if kernel in ("rows", "rows-fast") and k <= ONE_CHUNK_MAX:
        pa, pb, pc = row_parts(k)
        num_warps = max(1, min(ROWS_WARPS_MAX, (pa + pb + pc) // (8 * 32)))
        # (a SiLU row of 14336 takes ~126 registers a thread at 16 warps: one program an SM)
        per_sm = ROWS_PROGRAMS_PER_SM or (1 if silu_mul else max(1, 32 // num_warps))
        grid = min(m, per_sm * num_sms(x.device))
        _fp8_rows_kernel[(grid,)](
            x, q, scales, m, k, x.stride(0), q.stride(0), FP8_MAX_=FP8_MAX, OUT_FP8=out_fp8,
            SILU_MUL=silu_mul, LIBDEVICE=not is_interpret(), PART_A=pa, PART_B=pb, PART_C=pc,
            FAST=kernel == "rows-fast", num_warps=num_warps, num_stages=1, enable_fp_fusion=False,
        )  # fmt: skip
        return q, scales
    block_k = min(ONE_CHUNK_MAX, triton.next_power_of_2(max(k, 16)))
    num_warps = 4 if block_k <= 1024 else (8 if block_k <= 4096 else 16)  # <= 32 fp32 / thread
    _fp8_per_token_kernel[(m,)](
        x, q, scales, k, x.stride(0), q.stride(0), FP8_MAX_=FP8_MAX, OUT_FP8=out_fp8,
        SILU_MUL=silu_mul, LIBDEVICE=not is_interpret(), BLOCK_K=block_k,
        ONE_CHUNK=block_k >= k, num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip
    return q, scales


def quantize_fp8_per_token(
    x: torch.Tensor,  # [M, K], rows contiguous
    out_dtype: torch.dtype = FP8_DTYPE,
    kernel: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:  # fp8 [M, K], fp32 scales [M, 1]
    """``out_dtype=torch.float32`` stores the clamped quotients before rounding to e4m3 (the
    tests use it under the interpreter, whose fp8 rounding differs from the hardware's);
    ``kernel`` overrides ``KERNEL``."""
    return _launch(x, x.shape[-1], out_dtype, False, kernel)


def silu_mul_quantize_fp8_per_token(
    gate_up: torch.Tensor,  # [M, 2I] (gate | up), rows contiguous
    out_dtype: torch.dtype = FP8_DTYPE,
    kernel: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:  # fp8 [M, I], fp32 scales [M, 1]
    """``quantize_fp8_per_token(silu_and_mul(gate_up))`` in one launch."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must hold gate and up halves: {tuple(gate_up.shape)}")
    return _launch(gate_up, gate_up.shape[-1] // 2, out_dtype, True, kernel)


def rms_norm_quantize_fp8_per_token(
    x: torch.Tensor,  # [M, H], rows contiguous
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [M, H]
    out_dtype: torch.dtype = FP8_DTYPE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``quantize_fp8_per_token(rms_norm(x (+ residual), weight, eps))`` in one launch:
    (fp8 [M, H], fp32 scales [M, 1], the new residual ``x + residual`` or None). Rows up to
    ``ONE_CHUNK_MAX`` (the row is held in registers)."""
    check_device(x, weight)
    m, h = x.shape
    if x.stride(1) != 1 or weight.shape != (h,) or h > ONE_CHUNK_MAX:
        raise ValueError(
            f"rms_norm_quantize_fp8_per_token: x {tuple(x.shape)}, weight "
            f"{tuple(weight.shape)} (rows contiguous, at most {ONE_CHUNK_MAX})"
        )
    q = torch.empty(m, h, dtype=out_dtype, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    res_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.stride(1) != 1:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {(m, h)}")
        res_out = torch.empty_like(x)
    if m == 0:
        return q, scales, res_out
    block = triton.next_power_of_2(h)
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else x
    _rms_norm_fp8_kernel[(m,)](
        x, r, weight, q, scales, ro, h, 1.0 / h, eps, x.stride(0), r.stride(0), q.stride(0),
        ro.stride(0), FP8_MAX_=FP8_MAX, OUT_FP8=out_dtype == FP8_DTYPE,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(4, block // 512)), enable_fp_fusion=False,
    )  # fmt: skip
    return q, scales, res_out
