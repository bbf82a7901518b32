"""Decode GEMV for int4 weights on tensor cores (M <= 16): ``out[M, N] = x[M, K] @ W^T`` with W
group-quantized (``w = q s + offset``, groups of 32, 64 or a multiple of 128), read from a
kernel-specific repack of the canonical int4 layout made once after loading.

Why: widening int4 on CUDA cores costs about three instructions per element (a logic op, an FMA
to recover q, an FMA with x), so the GEMV is bound by instruction issue near 40% of the HBM
bandwidth at one row. Here the widening is half a logic op per element and the products run on
tensor cores, at any M up to 16:

* Repack (``int4_layout.repack_int4``): each row's K is cut into 128-element tiles of 16 int32
  words; nibble ``4h + i`` of word ``w`` holds element ``32 i + 2 w + h`` of the tile. One
  ``lop3`` per word and nibble pair i, ``((word >> 4i) & 0x000F000F) | 0x43004300``, leaves two
  bf16 values ``128 + q`` (fp16: ``0x64006400``, ``1024 + q``) for elements ``32 i + 2 w`` and
  ``32 i + 2 w + 1``: exactly the register pair an MMA A-fragment holds for those two K
  columns. So the four pairs i concatenated are the tile's ``[rows, 128]`` A operand with K in
  natural order and x's tile is a contiguous load. The words are copied to shared memory by
  ``cp.async`` (``num_stages`` tiles in flight) and read from there straight into the MMA layout.
* The weight is the MMA's A operand (16 rows per warp) and x the B operand (its M rows are the
  MMA's N columns, at least 8). The dot of a group gives ``D = sum (B + q) x``; a second dot of
  ones against the same x tile gives ``X = sum x`` in the same layout, so a group adds
  ``s D + (offset - B s) X`` (B = 128 or 1024) with no cross-thread reduction.
* Split-K inside the MMA (``ksplit``): at one row the MMA's N columns are idle padding, so the
  program's A rows are ``ksplit`` K-slices of ``block_n / ksplit`` weight rows and its x columns
  the same ``ksplit`` slices of x; only the diagonal blocks (slice of the row = slice of the
  column) are kept and summed once at the end. This spreads small-N layers over more programs
  with no second launch and no atomics. ``kgrid`` further splits K over a second grid axis (each
  program then reads only its part of x): partial sums go to a scratch buffer, and the row
  block's last program to arrive (an arrival counter, zeroed again by that program) adds them
  in part order, so results stay deterministic.
* Scales and offsets are interleaved (``int4_layout.pack_scales``: ``[N, groups, 2]``, their
  own dtype) so a group's pair is one 32-bit load per row (16-bit scales; two loads for fp32).
* Programmatic dependent launch (``kernels.pdl``): a program prefetches the start of its weight
  rows into L2, lets the next kernel launch, and only then waits for the previous one's x.

* int8 (``bits=8``, ``repack_int8``): ``u = q + 128`` split into two nibble planes per tile,
  each laid out as int4's; the high plane's magic (bf16 ``0x4500``: ``2048 + 16 hi``, fp16
  ``0x7400``: ``16384 + 16 hi``) puts the factor 16 into the operand, so both planes feed one
  accumulator.
* fp8 e4m3 (``words`` of dtype float8_e4m3fn: the canonical ``[N, K]`` weight itself, no
  repack; ``scale_pairs`` the fp32 ``[N]`` per-channel scales): a tile is 128 bytes a row,
  widened to bf16 by ``mixed_gemm._e4m3_to_bf16`` (byte permutes and one bf16x2 multiply per
  two elements, exact) or to fp16 by the hardware's paired conversion; the row's scale
  multiplies the finished sum.
* per-channel int8 (``words`` of dtype int8: the canonical ``[N, K]`` weight itself, no repack;
  ``scale_pairs`` its ``[N]`` scales in any float dtype): fp8's loop, each byte widened by
  ``int4_gemv_tiles._int8_asm`` (bf16: ``128 + (q & 127)`` and the sign's ``128`` or ``256`` by
  one lop3 each, their difference by one paired FMA; fp16: one lop3 and one FMA), exactly; no
  sum of x and no per-tile scale, unlike the nibble planes (``repack_int8``, which group-wise
  int8 keeps).
* canonical int4 (``words`` of dtype uint8: the ``[N, K // 2]`` weight itself, groups of 128k;
  ``CANON4_XPERM``): its int32 words widened by the repack's nibble-pair lop3s, which puts
  element ``8 w + 4 h + n`` of a tile at operand column ``32 n + 2 w + h``; each x tile is
  permuted in registers to that K order instead (the same sum, no weight copy).
* symmetric int4 (``scale_pairs`` the ``[N, groups]`` scales alone): the offset ``-8 s`` is
  rebuilt in registers, no pairs copy.

The result is ``x @ dequantize(W)^T`` with fp32 accumulation (the weight is never rounded to 16
bits), rounded once to x's dtype. ``int4_layout.int4_gemv_ref`` is the plain-torch reference.
Configs (``int4_gemv_configs``, re-exported here): ``TUNED_CONFIGS[(bits, N, K, group,
m_bucket(M))]`` (H100, ``scripts/gpu_quant.py --quick --sweep``), else ``heuristic_config``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret
from roofline.kernels.gemv import _mul_rn, m_bucket
from roofline.kernels.int4_gemv_configs import (
    MAX_ROWS,
    PROLOGUE_TUNED_CONFIGS,
    TILED_MAX_ROWS,
    TUNED_CONFIGS,
    Int4GemvConfig,
    _resolve,
    heuristic_config,
    pick_config,
    prologue_heuristic,
    table_format,
    takes,
)
from roofline.kernels.int4_gemv_tiles import _epilogue, _gate_up_rows, _tile
from roofline.kernels.int4_layout import (
    TILE_K,
    can_repack,
    int4_gemv_ref,
    pack_scales,
    repack_int4,
    repack_int8,
    unrepack_int4,
    unrepack_int8,
    weight_k,
)
from roofline.kernels.last_program import counters
from roofline.kernels.pdl import pdl_enabled, prefetch_l2

__all__ = [
    "MAX_ROWS", "PROLOGUE_TUNED_CONFIGS", "TILED_MAX_ROWS", "TILE_K", "TUNED_CONFIGS",
    "Int4GemvConfig", "_resolve", "can_repack", "heuristic_config", "int4_gemv", "int4_gemv_ref",
    "pack_scales", "pick_config", "prologue_heuristic", "repack_int4", "repack_int8", "supports",
    "splits_gate_up", "table_format", "takes", "unrepack_int4", "unrepack_int8", "weight_k",
]  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _int4_gemv_kernel(
    x_ptr,  # [M, K] ([M, 2K] gate | up with SILU_MUL), rows contiguous
    q_ptr,  # [N, K // 8] int32, repacked (int8: [N, K // 4]; FP8: the e4m3 [N, K] as int32)
    so_ptr,  # [N, K // GROUP, 2] (scale, offset) (SCALES 2: [N, K // GROUP] scales); FP8: [N]
    bias_ptr,
    out_ptr,  # [M, N]
    norm_w_ptr,  # [K] RMSNorm weight (NORM)
    residual_ptr,  # [M, N] added to the result (RESIDUAL)
    part_ptr,  # [KGRID, N, M blocks * BLOCK_M] fp32 partial sums (KGRID > 1)
    count_ptr,  # [programs] int32 arrival counters, zero between launches (KGRID > 1)
    M,
    N,
    K,
    k_slice,  # K // (KGRID * KSPLIT)
    stride_xm,
    stride_qn,
    stride_so,
    stride_om,
    stride_rm,
    inv_k,  # fp32(1 / K): RMSNorm's mean factor
    eps,
    BITS: tl.constexpr,  # 4, or 8 (two nibble planes of q + 128 per tile, or FP8)
    FP8: tl.constexpr,  # bytes in natural order, one scale per row (BITS == 8): e4m3, or
    INT8: tl.constexpr,  # int8 (per-channel int8 read as it is)
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # MMA rows: KSPLIT slices of BLOCK_N // KSPLIT weight rows
    BLOCK_M: tl.constexpr,  # x rows per slice and program (M's bucket; above 16 rows a tile)
    KSPLIT: tl.constexpr,
    KGRID: tl.constexpr,  # K parts on grid axis 1
    TILES: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SILU_MUL: tl.constexpr,
    NORM: tl.constexpr,  # x is the residual stream (one row): the GEMM's x is rms_norm(x) * w
    RESIDUAL: tl.constexpr,  # out = residual + result, each rounded as separate kernels round
    ASM: tl.constexpr,  # compiled: lop3 inline asm and libdevice SiLU (not interpreted)
    SCALES: tl.constexpr,  # 0: (scale, offset) pairs; 1: 16-bit pairs, one 32-bit load each;
    # 2: [N, K // GROUP] scales alone, offset -8 s (symmetric int4: no pairs copy)
    PDL: tl.constexpr,  # launched as a programmatic dependent: prefetch, then wait
    PREFETCH_LINES: tl.constexpr,  # 128-byte lines per MMA row prefetched before the wait
    PRELOAD: tl.constexpr,  # the first 1 or 2 tiles loaded into registers before the wait
    NORM_CHUNKS: tl.constexpr,  # cdiv(K, 1024) with NORM: the statistic's loads, unrolled
    NORM_EVEN: tl.constexpr,  # K % 1024 == 0
    SILU_OUT: tl.constexpr,  # gate | up weight: out = silu(gate) * up, [M, N // 2]
    CANON: tl.constexpr,  # the canonical int4 / int8 bytes read as int32 words (GROUP >= 128)
    XPERM: tl.constexpr,  # canonical int4: repacked-order operands, x permuted per tile instead
):
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    if BITS == 4:
        BASE: tl.constexpr = 1024.0 if DTYPE == tl.float16 else 128.0
    else:  # sum (B + lo) x + sum 16 (B' + hi) x = sum (q + 128) x + 17 B X
        BASE: tl.constexpr = 17 * 1024.0 + 128.0 if DTYPE == tl.float16 else 17 * 128.0 + 128.0
    WPT: tl.constexpr = 32 if FP8 else 16 * (BITS // 4)  # int32 words per row and tile
    GK: tl.constexpr = GROUP if GROUP < 128 else 128  # K per dot: a group, or a whole tile
    PAIRS: tl.constexpr = GK // 32
    ROWS: tl.constexpr = BLOCK_N // KSPLIT
    COLS: tl.constexpr = KSPLIT * BLOCK_M
    num_mb = tl.cdiv(M, BLOCK_M)  # row tiles of x (one up to 16 rows): adjacent programs
    pid_m = tl.program_id(0) % num_mb  # share their weight rows (L2)
    pid = tl.program_id(0) // num_mb
    k_origin = tl.program_id(1) * (k_slice * KSPLIT)  # this program's K part
    r = tl.arange(0, BLOCK_N)
    slice_r = r // ROWS  # [BN]: the K-slice of each MMA row
    if SILU_OUT:  # gate | up: a program's rows are ROWS // 2 gate rows and the same up rows
        rows = _gate_up_rows(r % ROWS, pid, N, ROWS // 2)
    else:
        rows = tl.minimum(pid * ROWS + r % ROWS, N - 1).to(tl.int64)  # clamped: padding re-reads
    c = tl.arange(0, COLS)
    slice_c = c // BLOCK_M  # [C]: the K-slice of each x column
    m_c = tl.minimum(pid_m * BLOCK_M + c % BLOCK_M, M - 1).to(tl.int64)
    WLOAD: tl.constexpr = 32 if FP8 or (CANON and BITS == 8) else 16
    offs_w = tl.arange(0, WLOAD)  # one plane's words of a tile (canonical int8: both)
    slice_words = k_slice // 128 * WPT
    q_row = q_ptr + k_origin // 128 * WPT + rows * stride_qn + slice_r * slice_words  # [BN]
    q_ptrs = q_row[:, None] + offs_w[None, :]
    x_col = k_origin + m_c * stride_xm + slice_c * k_slice  # [C]
    x_ptrs = x_ptr + x_col[None, :] + tl.arange(0, GK)[:, None]
    so_ptrs = so_ptr + rows * stride_so  # [BN]
    if GROUP <= 128 and not FP8:  # slices hold whole groups
        so_ptrs += (1 if SCALES == 2 else 2) * ((k_origin + slice_r * k_slice) // GROUP)
    k_row = k_origin + slice_r * k_slice  # [BN]: where each MMA row's slice starts in K
    if PRELOAD:  # the first tile(s) into registers before the wait (TILES == 1)
        w_first = tl.load(q_ptrs)
        w_first_hi = w_first
        if BITS == 8 and not FP8 and not CANON:
            w_first_hi = tl.load(q_ptrs + 16)
        if PRELOAD == 2:
            w_second = tl.load(q_ptrs + WPT)
            w_second_hi = w_second
            if BITS == 8 and not FP8 and not CANON:
                w_second_hi = tl.load(q_ptrs + WPT + 16)
    if PDL:  # the weight is no earlier kernel's output: pull it toward L2, then wait for x
        offs_p = tl.minimum(tl.arange(0, PREFETCH_LINES) * 32, slice_words - 1)  # 128-B lines
        prefetch_l2(q_row[:, None] + offs_p[None, :])  # [BN, lines]
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if NORM:  # the row's fp32 statistic (BLOCK_M == 1), as rms_norm: sum of squares * (1 / K)
        offs_s = tl.arange(0, 1024)
        sq = tl.zeros((1024,), dtype=tl.float32)
        for s0 in tl.static_range(0, NORM_CHUNKS * 1024, 1024):  # every load in flight at once
            if NORM_EVEN:  # K a multiple of 1024: unmasked, vectorized
                xs0 = tl.load(x_ptr + s0 + offs_s).to(tl.float32)
            else:
                xs0 = tl.load(x_ptr + s0 + offs_s, mask=offs_s < K - s0, other=0.0).to(tl.float32)
            sq += _mul_rn(xs0, xs0, ASM)
        rstd = tl.rsqrt(tl.sum(sq, axis=0) * inv_k + eps)  # scalar
        nw_col = k_origin + slice_c * k_slice  # [C]
        nw_ptrs = norm_w_ptr + nw_col[None, :] + tl.arange(0, GK)[:, None]
    else:
        rstd = 1.0
        nw_ptrs = x_ptrs
    ones = tl.full((BLOCK_N, GK), 1.0, tl.float32).to(DTYPE)
    acc = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    k_start = 0
    if PRELOAD:  # the first tile(s) came in before the wait
        acc = _tile(acc, w_first, w_first_hi, 0, x_ptrs, nw_ptrs, so_ptrs, k_row, rstd, ones, K,
                    BITS, FP8, GROUP, GK, PAIRS, BASE, SILU_MUL, NORM, ASM, SCALES,
                    CANON, INT8, XPERM)  # fmt: skip
        k_start = 128
        if PRELOAD == 2:
            acc = _tile(acc, w_second, w_second_hi, 128, x_ptrs, nw_ptrs, so_ptrs, k_row, rstd,
                        ones, K, BITS, FP8, GROUP, GK, PAIRS, BASE, SILU_MUL, NORM, ASM, SCALES,
                        CANON, INT8, XPERM)  # fmt: skip
            k_start = 256
    for k0 in tl.range(k_start, k_slice, 128 * TILES, num_stages=NUM_STAGES):
        for t in tl.static_range(TILES):
            kt = k0 + 128 * t
            words = tl.load(q_ptrs + kt // 128 * WPT)  # [BN, 16] int32 (int8: low nibbles)
            words_hi = words
            if BITS == 8 and not FP8 and not CANON:
                words_hi = tl.load(q_ptrs + kt // 128 * WPT + 16)  # [BN, 16]: high nibbles
            acc = _tile(acc, words, words_hi, kt, x_ptrs, nw_ptrs, so_ptrs, k_row, rstd, ones, K,
                        BITS, FP8, GROUP, GK, PAIRS, BASE, SILU_MUL, NORM, ASM, SCALES,
                        CANON, INT8, XPERM)  # fmt: skip
    acc = tl.where(slice_r[:, None] == slice_c[None, :], acc, 0.0)  # the diagonal blocks
    acc4 = tl.reshape(acc, (KSPLIT, ROWS, KSPLIT, BLOCK_M))
    res = tl.sum(tl.sum(acc4, axis=2), axis=0)  # [ROWS, BM]
    offs_n = pid * ROWS + tl.arange(0, ROWS)  # (SILU_OUT: the program's slots, not rows)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if SILU_OUT:
        real_n = _gate_up_rows(tl.arange(0, ROWS), pid, N, ROWS // 2)
    else:
        real_n = tl.minimum(offs_n, N - 1)
    if FP8:  # the row's scale (partial sums are scaled before they are added: still ordered)
        res *= tl.load(so_ptr + real_n).to(tl.float32)[:, None]
    if KGRID == 1:
        _epilogue(res, bias_ptr, out_ptr, residual_ptr, offs_n, real_n, pid, offs_m, M, N,
                  stride_om, stride_rm, HAS_BIAS, RESIDUAL, SILU_OUT, ROWS, ASM)  # fmt: skip
    else:  # partial sums out; the row block's last program to arrive adds them in part order
        m_pad = num_mb * BLOCK_M
        rows_p = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * m_pad + offs_m[None, :]
        part_size = N.to(tl.int64) * m_pad
        tl.store(part_ptr + tl.program_id(1) * part_size + rows_p, res)  # [ROWS, BM]
        tl.debug_barrier()  # every thread's partials before the arrival (release, gpu scope)
        arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == KGRID - 1:
            total = tl.zeros((ROWS, BLOCK_M), dtype=tl.float32)
            for part in range(KGRID):
                total += tl.load(part_ptr + part * part_size + rows_p, cache_modifier=".cg")
            tl.store(count_ptr + tl.program_id(0), 0)  # zero again for the next launch
            _epilogue(total, bias_ptr, out_ptr, residual_ptr, offs_n, real_n, pid, offs_m, M, N,
                      stride_om, stride_rm, HAS_BIAS, RESIDUAL, SILU_OUT, ROWS, ASM)  # fmt: skip


FP8_DTYPE = torch.float8_e4m3fn
CANON_BITS = {torch.uint8: 4, torch.int8: 8}
CANON4_XPERM = os.environ.get("ROOFLINE_CANON4_XPERM", "1") != "0"
"""Canonical int4 words widened as repacked ones are (each lop3 a ready MMA register), x's tile
permuted to their K order; 0: the words' halves interleaved into natural order instead."""
PREFETCH_BYTES = int(os.environ.get("ROOFLINE_INT4_GEMV_PREFETCH", "16384"))
"""Weight bytes a program asks into L2 before its PDL wait (the start of each MMA row's slice,
whole 128-byte lines), while the previous kernel still runs."""


def splits_gate_up(n: int, cfg: Int4GemvConfig) -> bool:
    """Whether a program of ``cfg`` can own ``rows / 2`` gate rows and the same up rows of a
    gate | up weight of ``n`` rows (``silu_out``), with no program straddling the halves."""
    rows = cfg.block_n // cfg.ksplit
    return n % 2 == 0 and rows % 2 == 0 and (n // 2) % (rows // 2) == 0


def supports(
    x: torch.Tensor, words: torch.Tensor, group: int, silu_mul: bool = False, bits: int = 4
) -> bool:
    """Whether ``int4_gemv`` takes this x against a weight in one of its layouts (with its
    picked config)."""
    k = weight_k(words, bits)
    if x.shape[1] != (2 * k if silu_mul else k) or x.stride(1) != 1:
        return False
    prologue = "silu" if silu_mul else None
    return takes(x.shape[0], x.dtype, x.device, words, group, bits, prologue)


def int4_gemv(
    x: torch.Tensor,  # [M, K] ([M, 2K] with silu_mul), rows contiguous, bf16 / fp16
    words: torch.Tensor,  # [N, K // 8] int32 from repack_int4 (repack_int8; fp8 [N, K] as is)
    scale_pairs: torch.Tensor,  # [N, K // group, 2] from pack_scales (fp8: fp32 [N] scales)
    bias: torch.Tensor | None = None,  # [N]
    *,
    silu_mul: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    silu_out: bool = False,
    bits: int = 4,
    config: Int4GemvConfig | None = None,
    warmup: bool = False,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ dequantize(W)^T (+ bias)`` in one launch (see the module doc). ``silu_mul`` feeds
    ``silu(x[:, :K]) * x[:, K:]``; ``norm = (weight [K], eps)`` feeds ``rms_norm(x)`` (one
    row), rounded as ``kernels.rmsnorm`` rounds it (only the fp32 sum's order differs);
    ``residual [M, N]`` is added to the rounded result and the sum rounded (a decoder layer's
    next residual stream); ``silu_out`` (a gate | up weight) returns ``silu(gate) * up``
    ``[M, N / 2]`` with ``silu_and_mul``'s bits. ``config`` overrides the picked one (sweeps);
    one that cannot run raises ValueError. ``warmup`` compiles without launching. An fp8 e4m3
    ``words`` (with ``bits=8``) is the canonical fp8 weight, its ``scale_pairs`` the
    per-channel fp32 scales; an int8 ``words`` with ``[N]`` ``scale_pairs`` the canonical
    per-channel int8 weight and its scales."""
    check_device(x, words)
    fp8 = words.dtype == FP8_DTYPE
    canon = words.dtype in (torch.uint8, torch.int8)  # the canonical int4 / int8 bytes
    if bits not in (4, 8) or (fp8 and bits != 8) or (canon and bits != CANON_BITS[words.dtype]):
        raise ValueError(f"int4_gemv: bits {bits} do not fit a {words.dtype} weight")
    int8_rows = words.dtype == torch.int8 and scale_pairs.dim() == 1  # per-channel, as fp8
    sym = bits == 4 and scale_pairs.dim() == 2  # symmetric int4: the scales alone, offset -8 s
    m, n = x.shape[0], words.shape[0]
    k = weight_k(words, bits)
    if x.shape[1] != (2 * k if silu_mul else k) or x.stride(1) != 1:
        raise ValueError(f"int4_gemv: x {tuple(x.shape)} does not match weight [{n}, {k}]")
    if not 1 <= m <= TILED_MAX_ROWS:
        raise ValueError(
            f"int4_gemv: M = {m} rows; it takes 1 to {MAX_ROWS} (to {TILED_MAX_ROWS} in row tiles)"
        )
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int4_gemv: x must be bf16 or fp16, got {x.dtype}")
    if fp8:
        if scale_pairs.shape != (n,) or scale_pairs.dtype != torch.float32:
            raise ValueError(f"int4_gemv: fp8 takes fp32 [{n}] scales, not {scale_pairs.shape}")
        num_groups = 1
    elif int8_rows:
        if scale_pairs.shape != (n,) or not scale_pairs.dtype.is_floating_point:
            raise ValueError(f"int4_gemv: int8 takes [{n}] per-channel scales, not "
                             f"{tuple(scale_pairs.shape)} {scale_pairs.dtype}")  # fmt: skip
        num_groups = 1
    else:
        num_groups = scale_pairs.shape[1]
        shape = (n, num_groups) if sym else (n, num_groups, 2)
        if scale_pairs.shape != shape or k % num_groups:
            raise ValueError(f"int4_gemv: scale pairs {tuple(scale_pairs.shape)} do not fit {n, k}")
    if not scale_pairs.is_contiguous() or not words.is_contiguous():
        raise ValueError("int4_gemv: the weight and its scales must be contiguous")
    group = k // num_groups
    if canon and not int8_rows and words.dtype == torch.int8 and group == k:
        raise ValueError("int4_gemv: per-channel int8 bytes take their [N] scales (not pairs)")
    if canon and group % TILE_K:
        raise ValueError(f"int4_gemv: the canonical layout takes groups of 128k, not {group}")
    if not can_repack(k, group):
        raise ValueError(f"int4_gemv: K = {k} with groups of {group} cannot be repacked")
    if norm is not None and (m != 1 or silu_mul or norm[0].shape != (k,)):
        raise ValueError(f"int4_gemv: the norm prologue takes one row and a [{k}] weight")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"int4_gemv: residual must be [{m}, {n}] with contiguous rows")
    prologue = "silu" if silu_mul else "norm" if norm is not None else None
    if silu_out and (silu_mul or residual is not None or n % 2):
        raise ValueError("int4_gemv: silu_out takes a gate | up weight, no SiLU prologue or add")
    fmt = table_format(words, bits, group)
    cfg = config or pick_config(n, k, group, m, x.device, fmt, prologue)
    if cfg is None:
        raise ValueError(f"int4_gemv: not taken for [{n}, {k}] at M = {m} (TUNED_CONFIGS)")
    k_slice = _resolve(cfg, k, group)
    if k_slice is None:
        raise ValueError(f"int4_gemv: config {tuple(cfg)} cannot run K = {k}, group {group}")
    rows = cfg.block_n // cfg.ksplit
    if silu_out and not splits_gate_up(n, cfg):
        raise ValueError(f"int4_gemv: config {tuple(cfg)} cannot split a gate | up of {n} rows")
    out = torch.empty(m, n // 2 if silu_out else n, dtype=x.dtype, device=x.device)
    block_m = cfg.block_m or m_bucket(m)
    num_mb = triton.cdiv(m, block_m)
    grid = (triton.cdiv(n, rows) * num_mb, cfg.kgrid)
    if cfg.kgrid > 1:
        parts = torch.empty(cfg.kgrid, n, num_mb * block_m, dtype=torch.float32, device=x.device)
        counts = counters(x.device, grid[0], "int4_gemv")  # split-K row blocks' arrivals
    else:
        parts = counts = out
    launch = _int4_gemv_kernel.warmup if warmup else _int4_gemv_kernel[grid]
    extra = {"grid": grid} if warmup else {}
    compiled = not is_interpret()
    pdl = compiled and pdl_enabled()
    scales_kind = 2 if sym else int(scale_pairs.element_size() == 2 and not int8_rows)
    # prefetch the start of each MMA row's slice: at most PREFETCH_BYTES a program, whole lines
    budget = max(1, PREFETCH_BYTES // (128 * cfg.block_n))
    lines = triton.next_power_of_2(min(triton.cdiv(k_slice * bits // 8, 128), budget))
    if pdl:
        extra["launch_pdl"] = True
    q = words.view(torch.int32) if fp8 or canon else words  # bytes read four to a word
    launch(
        x, q, scale_pairs, bias if bias is not None else scale_pairs, out,
        norm[0] if norm is not None else x, residual if residual is not None else out, parts,
        counts,
        m, n, k, k_slice, x.stride(0), q.stride(0), scale_pairs.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, 1.0 / k,
        norm[1] if norm is not None else 0.0,
        BITS=bits, FP8=fp8 or int8_rows, INT8=int8_rows, GROUP=group, HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_M=block_m,
        KSPLIT=cfg.ksplit, KGRID=cfg.kgrid, TILES=cfg.tiles, NUM_STAGES=cfg.num_stages,
        SILU_MUL=silu_mul, NORM=norm is not None, RESIDUAL=residual is not None,
        ASM=compiled, SCALES=scales_kind, PDL=pdl, PREFETCH_LINES=lines if pdl else 1,
        PRELOAD=cfg.preload, NORM_CHUNKS=triton.cdiv(k, 1024) if norm is not None else 1,
        NORM_EVEN=k % 1024 == 0, SILU_OUT=silu_out, CANON=canon and not int8_rows,
        XPERM=CANON4_XPERM,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )  # fmt: skip
    return out
