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

The result is ``x @ dequantize(W)^T`` with fp32 accumulation (the weight is never rounded to 16
bits), rounded once to x's dtype. ``int4_layout.int4_gemv_ref`` is the plain-torch reference.
Configs (``int4_gemv_configs``, re-exported here): ``TUNED_CONFIGS[(bits, N, K, group,
m_bucket(M))]`` (H100, ``scripts/gpu_quant.py --quick --sweep``), else ``heuristic_config``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret
from roofline.kernels.gemv import _first, _mul_rn, _silu_mul, m_bucket
from roofline.kernels.int4_gemv_configs import (
    MAX_ROWS,
    PROLOGUE_TUNED_CONFIGS,
    TUNED_CONFIGS,
    Int4GemvConfig,
    _resolve,
    heuristic_config,
    pick_config,
    prologue_heuristic,
    takes,
)
from roofline.kernels.int4_layout import (
    TILE_K,
    can_repack,
    int4_gemv_ref,
    pack_scales,
    repack_int4,
    repack_int8,
    unrepack_int4,
    unrepack_int8,
)
from roofline.kernels.pdl import pdl_enabled, prefetch_l2

__all__ = [
    "MAX_ROWS", "PROLOGUE_TUNED_CONFIGS", "TILE_K", "TUNED_CONFIGS", "Int4GemvConfig",
    "_resolve", "can_repack", "heuristic_config", "int4_gemv", "int4_gemv_ref", "pack_scales",
    "pick_config", "prologue_heuristic", "repack_int4", "repack_int8", "supports", "takes",
    "unrepack_int4", "unrepack_int8",
]  # fmt: skip


@triton.jit
def _pair(words, SH: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr, DTYPE: tl.constexpr):
    """Nibbles SH/4 and SH/4 + 4 of every word as two 16-bit floats ``B + q``, laid out as the
    ``[rows, 2 * words]`` operand (element ``2 w`` = low half of word w)."""
    src = words >> SH if SH > 0 else words
    if ASM:  # one lop3: (src & 0x000F000F) | MAGIC
        v = tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, 983055, " + _decimal(MAGIC) + ", 234;", "=r,r", [src],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        v = (src & 0x000F000F) | MAGIC
    lo = v.to(tl.int16).to(DTYPE, bitcast=True)
    hi = (v >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))


@triton.constexpr_function
def _decimal(value):
    return str(int(value))


@triton.jit
def _cat(a, b):
    """``[R, C]`` and ``[R, C]`` -> ``[R, 2C]`` (a's columns first)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _operand(words, PAIRS: tl.constexpr, P0: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr,
             DTYPE: tl.constexpr):  # fmt: skip
    """Nibble pairs P0 .. P0 + PAIRS - 1 of a tile's words: the ``[rows, 32 * PAIRS]`` operand of
    tile elements ``32 P0 ..``."""
    if PAIRS == 1:
        a = _pair(words, 4 * P0, MAGIC, ASM, DTYPE)
    elif PAIRS == 2:
        a = _cat(
            _pair(words, 4 * P0, MAGIC, ASM, DTYPE), _pair(words, 4 * P0 + 4, MAGIC, ASM, DTYPE)
        )
    else:
        a = _cat(
            _cat(_pair(words, 0, MAGIC, ASM, DTYPE), _pair(words, 4, MAGIC, ASM, DTYPE)),
            _cat(_pair(words, 8, MAGIC, ASM, DTYPE), _pair(words, 12, MAGIC, ASM, DTYPE)),
        )
    return a


@triton.jit
def _norm_tile(x, w, rstd, ASM: tl.constexpr):
    """``w * (x * rstd).to(dtype)`` rounded as ``rms_norm`` rounds it, for one x tile; computed
    once per element in the load layout (the reduction over an axis of one element keeps
    Triton from recomputing it in the dot operand's replicated layout, as ``gemv._silu_mul``)."""
    normed = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
    out = (normed * w.to(tl.float32)).to(x.dtype)
    if ASM:
        out = tl.reduce(tl.reshape(out, (out.shape[0], 1, out.shape[1])), 1, _first)
    return out


@triton.jit
def _scale_pair(ptrs, PAIR32: tl.constexpr):
    """The (scale, offset) pairs at ``ptrs`` as fp32: one 32-bit load for 16-bit pairs."""
    if PAIR32:
        v = tl.load(ptrs.to(tl.pointer_type(tl.int32)))  # [BN]: scale low, offset high
        S_DTYPE: tl.constexpr = ptrs.dtype.element_ty
        s = v.to(tl.int16).to(S_DTYPE, bitcast=True).to(tl.float32)
        o = (v >> 16).to(tl.int16).to(S_DTYPE, bitcast=True).to(tl.float32)
    else:
        s = tl.load(ptrs).to(tl.float32)
        o = tl.load(ptrs + 1).to(tl.float32)
    return s, o


@triton.jit(do_not_specialize=["M"])
def _int4_gemv_kernel(
    x_ptr,  # [M, K] ([M, 2K] gate | up with SILU_MUL), rows contiguous
    q_ptr,  # [N, K // 8] int32, repacked
    so_ptr,  # [N, K // GROUP, 2] (scale, offset)
    bias_ptr,
    out_ptr,  # [M, N]
    norm_w_ptr,  # [K] RMSNorm weight (NORM)
    residual_ptr,  # [M, N] added to the result (RESIDUAL)
    part_ptr,  # [KGRID, N, BLOCK_M] fp32 partial sums (KGRID > 1)
    count_ptr,  # [row blocks] int32 arrival counters, zero between launches (KGRID > 1)
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
    BITS: tl.constexpr,  # 4, or 8 (two nibble planes of q + 128 per tile)
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # MMA rows: KSPLIT slices of BLOCK_N // KSPLIT weight rows
    BLOCK_M: tl.constexpr,  # x rows per slice (M's bucket)
    KSPLIT: tl.constexpr,
    KGRID: tl.constexpr,  # K parts on grid axis 1
    TILES: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SILU_MUL: tl.constexpr,
    NORM: tl.constexpr,  # x is the residual stream (one row): the GEMM's x is rms_norm(x) * w
    RESIDUAL: tl.constexpr,  # out = residual + result, each rounded as separate kernels round
    ASM: tl.constexpr,  # compiled: lop3 inline asm and libdevice SiLU (not interpreted)
    PAIR32: tl.constexpr,  # 16-bit scale pairs: one 32-bit load each
    PDL: tl.constexpr,  # launched as a programmatic dependent: prefetch, then wait
    PREFETCH_WORDS: tl.constexpr,  # words per MMA row prefetched into L2 before the wait
):
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    # low nibbles: B + q (bf16 128, fp16 1024); int8's high nibbles: 16 (B' + q), B' = 128 / 1024
    MAGIC: tl.constexpr = 0x64006400 if DTYPE == tl.float16 else 0x43004300
    MAGIC_HI: tl.constexpr = 0x74007400 if DTYPE == tl.float16 else 0x45004500
    if BITS == 4:
        BASE: tl.constexpr = 1024.0 if DTYPE == tl.float16 else 128.0
    else:  # sum (B + lo) x + sum 16 (B' + hi) x = sum (q + 128) x + 17 B X
        BASE: tl.constexpr = 17 * 1024.0 + 128.0 if DTYPE == tl.float16 else 17 * 128.0 + 128.0
    WPT: tl.constexpr = 16 * (BITS // 4)  # words per row per 128-element tile
    GK: tl.constexpr = GROUP if GROUP < 128 else 128  # K per dot: a group, or a whole tile
    PAIRS: tl.constexpr = GK // 32
    ROWS: tl.constexpr = BLOCK_N // KSPLIT
    COLS: tl.constexpr = KSPLIT * BLOCK_M
    pid = tl.program_id(0)
    k_origin = tl.program_id(1) * (k_slice * KSPLIT)  # this program's K part
    r = tl.arange(0, BLOCK_N)
    slice_r = r // ROWS  # [BN]: the K-slice of each MMA row
    rows = tl.minimum(pid * ROWS + r % ROWS, N - 1).to(tl.int64)  # clamped: padding re-reads
    c = tl.arange(0, COLS)
    slice_c = c // BLOCK_M  # [C]: the K-slice of each x column
    m_c = tl.minimum(c % BLOCK_M, M - 1).to(tl.int64)
    offs_w = tl.arange(0, 16)
    slice_words = k_slice // 128 * WPT
    q_row = q_ptr + k_origin // 128 * WPT + rows * stride_qn + slice_r * slice_words  # [BN]
    q_ptrs = q_row[:, None] + offs_w[None, :]
    x_col = k_origin + m_c * stride_xm + slice_c * k_slice  # [C]
    x_ptrs = x_ptr + x_col[None, :] + tl.arange(0, GK)[:, None]
    so_ptrs = so_ptr + rows * stride_so  # [BN]
    if GROUP <= 128:  # slices hold whole groups
        so_ptrs += 2 * ((k_origin + slice_r * k_slice) // GROUP)
    k_row = k_origin + slice_r * k_slice  # [BN]: where each MMA row's slice starts in K
    if PDL:  # the weight is no earlier kernel's output: pull it toward L2, then wait for x
        offs_p = tl.minimum(tl.arange(0, PREFETCH_WORDS // 32) * 32, slice_words - 1)  # lines
        prefetch_l2(q_row[:, None] + offs_p[None, :])  # [BN, lines]
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if NORM:  # the row's fp32 statistic (BLOCK_M == 1), as rms_norm: sum of squares * (1 / K)
        offs_s = tl.arange(0, 1024)
        sq = tl.zeros((1024,), dtype=tl.float32)
        for s0 in range(0, K, 1024):
            xs0 = tl.load(x_ptr + s0 + offs_s, mask=offs_s < K - s0, other=0.0).to(tl.float32)
            sq += _mul_rn(xs0, xs0, ASM)
        rstd = tl.rsqrt(tl.sum(sq, axis=0) * inv_k + eps)  # scalar
        nw_col = k_origin + slice_c * k_slice  # [C]
        nw_ptrs = norm_w_ptr + nw_col[None, :] + tl.arange(0, GK)[:, None]
    ones = tl.full((BLOCK_N, GK), 1.0, tl.float32).to(DTYPE)
    acc = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    for k0 in tl.range(0, k_slice, 128 * TILES, num_stages=NUM_STAGES):
        for t in tl.static_range(TILES):
            kt = k0 + 128 * t
            words = tl.load(q_ptrs + kt // 128 * WPT)  # [BN, 16] int32 (int8: low nibbles)
            if BITS == 8:
                words_hi = tl.load(q_ptrs + kt // 128 * WPT + 16)  # [BN, 16]: high nibbles
            for j in tl.static_range(128 // GK):
                kg = kt + GK * j
                a = _operand(words, PAIRS, PAIRS * j, MAGIC, ASM, DTYPE)  # [BN, GK]
                if SILU_MUL:
                    xt = _silu_mul(tl.load(x_ptrs + kg), tl.load(x_ptrs + kg + K), ASM, True)
                    xt1 = xt
                elif NORM:
                    xt = _norm_tile(tl.load(x_ptrs + kg), tl.load(nw_ptrs + kg), rstd, ASM)
                    xt1 = xt
                else:  # two loads of the same tile (one per dot's operand layout): both are
                    # pipelined by cp.async, where one tile feeding both dots would not be
                    xt = tl.load(x_ptrs + kg)  # [GK, C]
                    xt1 = tl.load(x_ptrs + kg, eviction_policy="evict_last")
                d = tl.dot(a, xt)  # [BN, C]: sum (BASE + q) x over the group (or tile)
                if BITS == 8:
                    d = tl.dot(_operand(words_hi, PAIRS, PAIRS * j, MAGIC_HI, ASM, DTYPE), xt, d)
                xs = tl.dot(ones, xt1)  # [BN, C]: sum x, in the same layout
                if GROUP <= 128:
                    s, o = _scale_pair(so_ptrs + 2 * (kg // GROUP), PAIR32)  # [BN] fp32 each
                else:  # a slice may start inside a group; a 128-tile never straddles one
                    s, o = _scale_pair(so_ptrs + 2 * ((k_row + kg) // GROUP), PAIR32)
                acc += d * s[:, None] + xs * (o - BASE * s)[:, None]
    acc = tl.where(slice_r[:, None] == slice_c[None, :], acc, 0.0)  # the diagonal blocks
    acc4 = tl.reshape(acc, (KSPLIT, ROWS, KSPLIT, BLOCK_M))
    res = tl.sum(tl.sum(acc4, axis=2), axis=0)  # [ROWS, BM]
    offs_n = pid * ROWS + tl.arange(0, ROWS)
    offs_m = tl.arange(0, BLOCK_M)
    if KGRID == 1:
        _finish(res, bias_ptr, out_ptr, residual_ptr, offs_n, offs_m, M, N, stride_om, stride_rm,
                HAS_BIAS, RESIDUAL)  # fmt: skip
    else:  # partial sums out; the row block's last program to arrive adds them in part order
        rows_p = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * BLOCK_M + offs_m[None, :]
        tl.store(part_ptr + tl.program_id(1) * N * BLOCK_M + rows_p, res)  # [ROWS, BM]
        tl.debug_barrier()  # every thread's partials before the arrival (release, gpu scope)
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == KGRID - 1:
            total = tl.zeros((ROWS, BLOCK_M), dtype=tl.float32)
            for part in range(KGRID):
                total += tl.load(part_ptr + part * N * BLOCK_M + rows_p, cache_modifier=".cg")
            tl.store(count_ptr + pid, 0)  # zero again for the next launch
            _finish(total, bias_ptr, out_ptr, residual_ptr, offs_n, offs_m, M, N, stride_om,
                    stride_rm, HAS_BIAS, RESIDUAL)  # fmt: skip


@triton.jit
def _finish(res, bias_ptr, out_ptr, residual_ptr, offs_n, offs_m, M, N, stride_om, stride_rm,
            HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr):  # fmt: skip
    """Bias, rounding, the residual add and the masked store of a ``[ROWS, BM]`` fp32 result."""
    if HAS_BIAS:
        res += tl.load(bias_ptr + tl.minimum(offs_n, N - 1)).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    res = res.to(out_ptr.dtype.element_ty)
    if RESIDUAL:  # the GEMM's output rounded, then the add rounded: two eager ops' bits
        r_ptrs = residual_ptr + offs_m[None, :].to(tl.int64) * stride_rm + offs_n[:, None]
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        res = (res.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, res, mask=mask)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, num: int) -> torch.Tensor:
    """Arrival counters for split-K row blocks, zero between launches (each launch's last
    program zeroes its own); allocated (zeroed) once per device and grown when needed."""
    counts = _COUNTERS.get(device)
    if counts is None or counts.numel() < num:
        counts = torch.zeros(max(num, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = counts
    return counts


def supports(
    x: torch.Tensor, words: torch.Tensor, group: int, silu_mul: bool = False, bits: int = 4
) -> bool:
    """Whether ``int4_gemv`` takes this x against a repacked weight (with its picked config)."""
    k = words.shape[1] * 32 // bits
    if x.shape[1] != (2 * k if silu_mul else k) or x.stride(1) != 1:
        return False
    prologue = "silu" if silu_mul else None
    return takes(x.shape[0], x.dtype, x.device, words, group, bits, prologue)


def int4_gemv(
    x: torch.Tensor,  # [M, K] ([M, 2K] with silu_mul), rows contiguous, bf16 / fp16
    words: torch.Tensor,  # [N, K // 8] int32 from repack_int4
    scale_pairs: torch.Tensor,  # [N, K // group, 2] from pack_scales
    bias: torch.Tensor | None = None,  # [N]
    *,
    silu_mul: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    bits: int = 4,
    config: Int4GemvConfig | None = None,
    warmup: bool = False,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ dequantize(W)^T (+ bias)`` in one launch (see the module doc). ``silu_mul`` feeds
    ``silu(x[:, :K]) * x[:, K:]``; ``norm = (weight [K], eps)`` feeds ``rms_norm(x)`` (one
    row), rounded as ``kernels.rmsnorm`` rounds it (only the fp32 sum's order differs);
    ``residual [M, N]`` is added to the rounded result and the sum rounded (a decoder layer's
    next residual stream). ``config`` overrides the picked one (sweeps); one that cannot run
    raises ValueError. ``warmup`` compiles without launching."""
    check_device(x, words)
    if bits not in (4, 8):
        raise ValueError(f"int4_gemv: bits must be 4 or 8, got {bits}")
    m, n = x.shape[0], words.shape[0]
    k = words.shape[1] * 32 // bits
    if x.shape[1] != (2 * k if silu_mul else k) or x.stride(1) != 1:
        raise ValueError(f"int4_gemv: x {tuple(x.shape)} does not match weight [{n}, {k}]")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"int4_gemv: M = {m} rows; it takes 1 to {MAX_ROWS}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int4_gemv: x must be bf16 or fp16, got {x.dtype}")
    num_groups = scale_pairs.shape[1]
    if scale_pairs.shape != (n, num_groups, 2) or k % num_groups or not scale_pairs.is_contiguous():
        raise ValueError(f"int4_gemv: scale pairs {tuple(scale_pairs.shape)} do not fit [{n}, {k}]")
    group = k // num_groups
    if not can_repack(k, group):
        raise ValueError(f"int4_gemv: K = {k} with groups of {group} cannot be repacked")
    if norm is not None and (m != 1 or silu_mul or norm[0].shape != (k,)):
        raise ValueError(f"int4_gemv: the norm prologue takes one row and a [{k}] weight")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"int4_gemv: residual must be [{m}, {n}] with contiguous rows")
    prologue = "silu" if silu_mul else "norm" if norm is not None else None
    cfg = config or pick_config(n, k, group, m, x.device, bits, prologue)
    if cfg is None:
        raise ValueError(f"int4_gemv: not taken for [{n}, {k}] at M = {m} (TUNED_CONFIGS)")
    k_slice = _resolve(cfg, k, group)
    if k_slice is None:
        raise ValueError(f"int4_gemv: config {tuple(cfg)} cannot run K = {k}, group {group}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    rows = cfg.block_n // cfg.ksplit
    grid = (triton.cdiv(n, rows), cfg.kgrid)
    if cfg.kgrid > 1:
        parts = torch.empty(cfg.kgrid, n, m_bucket(m), dtype=torch.float32, device=x.device)
        counts = _counters(x.device, grid[0])
    else:
        parts = counts = out
    launch = _int4_gemv_kernel.warmup if warmup else _int4_gemv_kernel[grid]
    extra = {"grid": grid} if warmup else {}
    compiled = not is_interpret()
    pdl = compiled and pdl_enabled()
    pair32 = scale_pairs.element_size() == 2
    # prefetch the start of each MMA row's slice: at most ~16 KiB a program, whole 128-byte lines
    lines = min(triton.cdiv(k_slice * bits // 32, 32), max(1, 16384 // (128 * cfg.block_n)))
    prefetch = 32 * triton.next_power_of_2(lines)
    if pdl:
        extra["launch_pdl"] = True
    launch(
        x, words, scale_pairs, bias if bias is not None else scale_pairs, out,
        norm[0] if norm is not None else x, residual if residual is not None else out, parts,
        counts,
        m, n, k, k_slice, x.stride(0), words.stride(0), scale_pairs.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, 1.0 / k,
        norm[1] if norm is not None else 0.0,
        BITS=bits, GROUP=group, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_M=m_bucket(m),
        KSPLIT=cfg.ksplit, KGRID=cfg.kgrid, TILES=cfg.tiles, NUM_STAGES=cfg.num_stages,
        SILU_MUL=silu_mul, NORM=norm is not None, RESIDUAL=residual is not None,
        ASM=compiled, PAIR32=pair32, PDL=pdl, PREFETCH_WORDS=prefetch if pdl else 32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )  # fmt: skip
    return out
