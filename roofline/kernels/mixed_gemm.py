"""Mixed-input GEMM for quantized weights at batch and prefill sizes (M > 16 rows):
``out[M, N] = x[M, K] @ dequantize(W)^T (+ bias)``, x in bf16/fp16, W in one of the canonical
layouts of ``roofline.quantization.formats`` (int8 with group scales, int4 nibbles with group
scales and offsets, fp8 e4m3 with per-channel or per-tensor scales), read as stored.

Each program owns a ``[BLOCK_N, BLOCK_M]`` tile of ``out^T``. The quantized weight tile is
copied to shared memory by the software pipeline (``num_stages``, ``cp.async``), loaded to
registers, widened and scaled there (``w = q * s (+ offset)`` in fp32, rounded once to x's dtype,
the values of ``formats.dequantize_*``) and meets x (16-bit, from shared memory) in the tensor
cores in one of three ways (``MixedGemmConfig.mode``):

* ``MODE_REG``: ``W_tile @ x_tile^T`` with the widened weight as wgmma's A operand straight from
  registers, the MMAs of one K tile in flight while the next tile is widened. ptxas before 13.3
  (Triton 3.6 bundles 12.8) may give an A register of an MMA still in flight to the next tile's
  widening (triton-lang/triton#9433; seen in this kernel's SASS): wrong results, sometimes;
* ``MODE_REG_WAIT``: the same, but the accumulator goes through an opaque identity (inline
  PTX ``mov``) after each K tile, so all of a tile's MMAs complete before the loop goes on (one
  ``wgmma.wait_group 0`` per tile): no register can be reused early;
* ``MODE_SMEM``: ``x_tile @ W_tile^T``: the widened tile is stored to shared memory and is the
  MMA's B operand (x the A operand; fewer than 64 rows of x take ``mma.sync``); wide weight
  tiles (256 rows: m64n256 MMAs) read x from L2 a quarter as often as 64-row tiles.

int4 bytes are split into their nibbles with ``tl.join(low, high).reshape`` (the canonical
interleaved order, no repack: Triton's linear layouts make the split register-local). Group scales
(and int4 offsets) are loaded once per K tile per weight row (a tile never straddles groups unless
it holds whole groups, whose scales are broadcast); one scale per row (per-channel int8, fp8) is
applied to the finished accumulator in the epilogue instead. No int-to-float or fp8-to-float
conversion instructions (quarter rate on Hopper, they would bound the kernel): integers are widened
through the mantissa of 1.0f and one FMA, e4m3 by moving its bits into bf16 fields and one bf16x2
multiply (inline PTX; the interpreter takes the plain conversion).

W8A8 (``w8a8_gemm``, ``fp8_scaled_gemm``) is the same kernel with an fp8 x: both operands go to
the e4m3 tensor cores from shared memory, the per-token and per-channel scales multiply the
fp32 accumulator.

The tile order is grouped (``GROUP_M`` row blocks of x walk the same weight columns together, so a
weight tile is read from HBM once and served from L2 to its neighbours), and ``SPLIT_K`` (small M:
too few output tiles to occupy every SM) gives each program one slice of K (any number: slices hold
whole K tiles, differing by one at most); the slices' fp32 partial sums go to a workspace, and the
last slice of a tile to finish (an acq_rel atomic counts arrivals) adds them all in slice order,
applies the bias, stores the tile and resets its counter: one launch, deterministic, CUDA-graph
replayable. Configs come from ``mixed_gemm_configs.TUNED_CONFIGS[(kind, N, K, m_bucket)]`` (measured
on an H100 by ``scripts/gpu_mixedmma.py``), else ``heuristic_config``; ``mixed_gemm_ref`` is
``dequant_gemm_ref`` (dequantize, round to x's dtype, fp32 matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret
from roofline.kernels.dequant_gemm import _layout
from roofline.kernels.dequant_gemm import dequant_gemm_ref as mixed_gemm_ref
from roofline.kernels.last_program import stream_counters
from roofline.kernels.mixed_gemm_configs import (
    M_BUCKETS,
    MIXED_MAX_ROWS,
    MODE_REG,
    MODE_REG_WAIT,
    MODE_SMEM,
    TUNED_CONFIGS,
    MixedGemmConfig,
    check_config,
    heuristic_config,
    m_bucket,
    pick_config,
)

__all__ = [
    "M_BUCKETS", "TUNED_CONFIGS", "MIXED_MAX_ROWS", "MODE_REG", "MODE_REG_WAIT", "MODE_SMEM",
    "MixedGemmConfig", "check_config",
    "fp8_scaled_gemm", "heuristic_config", "m_bucket", "mixed_gemm", "mixed_gemm_ref",
    "pick_config", "supports", "w8a8_gemm",
]  # fmt: skip

KIND_INT8, KIND_INT4, KIND_FP8 = 0, 1, 2
_KINDS = {"int8": KIND_INT8, "int4": KIND_INT4, "fp8": KIND_FP8}


@triton.jit
def _e4m3_to_bf16(q):
    """fp8 e4m3 -> bf16, four at a time, without the conversion instructions (e4m3 -> f16 ->
    f32 -> bf16 goes through the quarter-rate conversion unit): each byte moves to the top of
    a 16-bit lane, its exponent and mantissa shift into bf16's fields (sign kept), and one
    bf16x2 multiply by 2^(127 - 7) rebiases the exponent; exact, subnormals and zeros included."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 a<2>, b<2>, c;
        mov.b32 c, 0x7B807B80;
        prmt.b32 a0, 0, $2, 0x5140;
        prmt.b32 a1, 0, $2, 0x7362;
        shr.b32 b0, a0, 4;
        shr.b32 b1, a1, 4;
        and.b32 b0, b0, 0x07F007F0;
        and.b32 b1, b1, 0x07F007F0;
        lop3.b32 b0, b0, 0x80008000, a0, 0xf8;
        lop3.b32 b1, b1, 0x80008000, a1, 0xf8;
        mul.rn.bf16x2 $0, b0, c;
        mul.rn.bf16x2 $1, b1, c;
        }""",
        "=r,=r,r",
        [q],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _opaque(v, PTX: tl.constexpr):
    """``v`` through an identity the compiler cannot see into (inline PTX; the interpreter has
    none and needs none): an MMA accumulator read this way is complete (``wgmma.wait_group 0``)
    before the loop goes on."""
    if PTX:
        return tl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1
        )
    return v


@triton.jit
def _row_scaled_tile(q_ptrs, dtype: tl.constexpr, KIND: tl.constexpr, FAST_FP8: tl.constexpr):
    """One [BN, BK] tile of a weight with one scale per row (applied in the epilogue), in x's
    dtype: int8 exactly (|q| <= 127; ptxas widens it with byte permutes, no I2F), e4m3 by
    ``_e4m3_to_bf16`` or kept as it is for W8A8 (fp8 x fp8 on the tensor cores)."""
    q = tl.load(q_ptrs)  # [BN, BK]
    if KIND == 2:
        if FAST_FP8 and dtype == tl.bfloat16:
            w = _e4m3_to_bf16(q)
        else:
            w = q.to(dtype)
    else:
        w = q.to(tl.float32).to(dtype)
    return w


@triton.jit
def _grouped_tile(
    q_ptrs,  # [BN, BK] int8 pointers or [BN, BK // 2] int4 byte pointers
    s_ptr,
    o_ptr,
    rows_n,  # [BN] int64
    k0,
    stride_s,
    dtype: tl.constexpr,
    KIND: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One [BN, BK] tile of a weight with group scales (int4: and offsets) in x's dtype.

    q is widened without int-to-float conversions (quarter rate on Hopper, the bottleneck of
    the naive tile): its bits go into the mantissa of 1.0f, ``v = 1 + q / 16`` (int8:
    ``1 + (q + 128) / 256``), and one FMA per element makes ``w = v * (SPAN s) + (offset -
    ZERO s)`` = ``q s + offset``, rounded once as ``formats.dequantize_*`` rounds (the per-row
    constants are exact in fp32 for 16-bit scales and offsets of similar magnitude)."""
    if KIND == 1:
        b = tl.load(q_ptrs).to(tl.uint32)  # [BN, BK // 2] bytes
        low = ((b & 0xF) << 19) | 0x3F800000
        high = ((b & 0xF0) << 15) | 0x3F800000
        v = tl.join(low, high).reshape(BLOCK_N, BLOCK_K).to(tl.float32, bitcast=True)
        SPAN: tl.constexpr = 16.0
        ZERO: tl.constexpr = 16.0  # v = 1 + q / 16: w = v * 16 s + (offset - 16 s)
    else:
        b = tl.load(q_ptrs).to(tl.uint8, bitcast=True).to(tl.uint32)  # [BN, BK] q mod 256
        v = (((b ^ 0x80) << 15) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + (q+128)/256
        SPAN: tl.constexpr = 256.0
        ZERO: tl.constexpr = 384.0  # w = v * 256 s - 384 s
    if BLOCK_K <= GROUP:
        col = k0 // GROUP
        s = tl.load(s_ptr + rows_n * stride_s + col).to(tl.float32)[:, None]  # [BN, 1]
        c = -ZERO * s
        if KIND == 1:
            c += tl.load(o_ptr + rows_n * stride_s + col).to(tl.float32)[:, None]
        w = v * (SPAN * s) + c
    else:
        NG: tl.constexpr = BLOCK_K // GROUP
        idx = rows_n[:, None] * stride_s + (k0 // GROUP + tl.arange(0, NG))[None, :]  # [BN, NG]
        s = tl.load(s_ptr + idx).to(tl.float32)[:, :, None]  # [BN, NG, 1]
        c = -ZERO * s
        if KIND == 1:
            c += tl.load(o_ptr + idx).to(tl.float32)[:, :, None]
        w = (v.reshape(BLOCK_N, NG, GROUP) * (SPAN * s) + c).reshape(BLOCK_N, BLOCK_K)
    return w.to(dtype)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _mixed_gemm_kernel(
    x_ptr,  # [M, K] 16-bit (fp8 with X_SCALE: W8A8)
    xs_ptr,  # fp32 [M] per-token scales of an fp8 x (X_SCALE)
    q_ptr,  # int8/fp8 [N, K] or uint8 [N, K // 2]
    s_ptr,  # [N, K // GROUP] (ROW_SCALE: [N], or [1] if SCALAR_SCALE)
    o_ptr,  # [N, K // GROUP] (int4 only)
    bias_ptr,  # [N]
    out_ptr,  # [M, N]
    ws_ptr,  # fp32 [SPLIT_K, M, N] partial sums (SPLIT_K > 1)
    lock_ptr,  # int32 [tiles] arrival counters, zero between launches (FIXUP)
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
    X_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K,  # K slices (any count up to K // BLOCK_K: slices differ by at most one tile)
    SPLIT: tl.constexpr,  # SPLIT_K > 1
    FIXUP: tl.constexpr,  # SPLIT_K > 1: the last slice reduces (else a second launch does)
    NUM_STAGES: tl.constexpr,
    FAST_FP8: tl.constexpr,  # inline PTX (e4m3 -> bf16, _opaque); False under the interpreter
    MODE: tl.constexpr = 0,  # mixed_gemm_configs.MODE_*: 0 weight in registers (A), 1 staged
    # in shared memory (B), 2 in registers with each K tile's MMAs completed before the next
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)  # clamped: rows past M are never stored
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    k_tiles = K // BLOCK_K  # whole tiles (the launcher checks); slice s takes tiles
    tile_first = (tl.program_id(1) * k_tiles) // SPLIT_K  # [s k_tiles / S, (s+1) k_tiles / S)
    k_first = tile_first * BLOCK_K
    k_len = (((tl.program_id(1) + 1) * k_tiles) // SPLIT_K - tile_first) * BLOCK_K
    offs_k = tl.arange(0, BLOCK_K)
    if KIND == 1:
        q_cols = k_first // 2 + tl.arange(0, BLOCK_K // 2)  # [BK // 2] bytes
        q_ptrs = q_ptr + rows_n[:, None] * stride_qn + q_cols[None, :]
        q_step = BLOCK_K // 2
    else:
        q_ptrs = q_ptr + rows_n[:, None] * stride_qn + (k_first + offs_k)[None, :]
        q_step = BLOCK_K
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_first + offs_k)[None, :]  # [BM, BK]
    if MODE == 1:
        acc_t = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(k_first, k_first + k_len, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs)  # [BM, BK]
        if ROW_SCALE:
            w = _row_scaled_tile(q_ptrs, x.dtype, KIND, FAST_FP8)  # [BN, BK]
        else:
            w = _grouped_tile(
                q_ptrs, s_ptr, o_ptr, rows_n, k0, stride_s, x.dtype, KIND, GROUP, BLOCK_N,
                BLOCK_K,
            )  # fmt: skip
        if MODE == 1:  # the weight from shared memory: wgmma's B operand
            acc_t = tl.dot(x, tl.trans(w), acc_t)  # [BM, BN]
        elif MODE == 2:  # the accumulator read after each tile: its MMAs complete first
            acc = _opaque(tl.dot(w, tl.trans(x), acc), FAST_FP8)  # [BN, BM]
        else:
            acc = tl.dot(w, tl.trans(x), acc)  # [BN, BM]
        q_ptrs += q_step
        x_ptrs += BLOCK_K
    if MODE == 1:
        acc = tl.trans(acc_t)  # [BN, BM]
    if ROW_SCALE:
        if SCALAR_SCALE:
            acc *= tl.load(s_ptr).to(tl.float32)
        else:
            acc *= tl.load(s_ptr + rows_n).to(tl.float32)[:, None]
    if X_SCALE:
        acc *= tl.load(xs_ptr + rows_m)[None, :]
    mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)  # [BN, BM]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows_n).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        slice_size = M.to(tl.int64) * N
        offs_ws = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]  # [BN, BM]
        tl.store(ws_ptr + tl.program_id(1) * slice_size + offs_ws, acc, mask=mask)
        if FIXUP:  # the tile's last slice to finish sums all of them, in slice order
            tl.debug_barrier()  # every thread's partial sums are written
            arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in range(SPLIT_K):  # .cg: L2, never a stale L1 line
                    part = ws_ptr + s * slice_size + offs_ws
                    total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + rows_n).to(tl.float32)[:, None]
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + pid, 0)  # ready for the next launch (graph replays)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(
    part_ptr,  # fp32 [SPLIT_K, M, N]
    bias_ptr,
    out_ptr,  # [M, N]
    M,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def supports(kind: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether ``mixed_gemm`` takes this call: 16-bit x (tensor cores), K a multiple of 32 and a
    group layout whose tiles fit (shapes only, no sync)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2 or kind not in _KINDS:
        return False
    k = x.shape[1]
    if k % 32:
        return False
    try:
        group = _layout(kind, qweight, scales, k)[0]
    except ValueError:
        return False
    return group % 32 == 0 or group == k


MAX_FIXUP_TILES = 1 << 16
"""Split-K launches of at most this many output tiles reduce in the kernel (the last slice of a
tile to arrive sums the others'); larger ones (never at the M where split-K pays) take the
reduce launch."""


def _locks(device: torch.device) -> torch.Tensor:
    """The arrival counters of split-K tiles on ``device``'s current stream (kernels of one
    stream run one after another; each leaves its counters at zero)."""
    return stream_counters(device, MAX_FIXUP_TILES, "mixed_gemm")


def _launch(
    code: int,
    x: torch.Tensor,  # [M, K]
    x_scales: torch.Tensor | None,  # fp32 [M, 1] (W8A8)
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,  # [M, N]
    layout: tuple[int, bool, bool, int],
    cfg: MixedGemmConfig,
    warmup: bool = False,
) -> torch.Tensor:
    m, k = x.shape
    n = qweight.shape[0]
    group, row_scale, scalar, stride_s = layout
    grid_mn = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    ws = locks = out
    fixup = False
    if cfg.split_k > 1:
        ws = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
        fixup = grid_mn <= MAX_FIXUP_TILES
        locks = _locks(x.device) if fixup else out
    grid = (grid_mn, cfg.split_k)
    launch = _mixed_gemm_kernel.warmup if warmup else _mixed_gemm_kernel[grid]
    reduce = _split_k_reduce_kernel.warmup if warmup else None
    launch(
        x, x_scales if x_scales is not None else scales, qweight, scales,
        offsets if offsets is not None else scales, bias if bias is not None else scales,
        out, ws, locks, m, n, k, x.stride(0), qweight.stride(0), stride_s, out.stride(0),
        KIND=code, GROUP=0 if row_scale else group, ROW_SCALE=row_scale, SCALAR_SCALE=scalar,
        HAS_BIAS=bias is not None, X_SCALE=x_scales is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=cfg.split_k,
        SPLIT=cfg.split_k > 1, FIXUP=fixup, NUM_STAGES=cfg.num_stages,
        FAST_FP8=not is_interpret(), MODE=cfg.mode, num_warps=cfg.num_warps,
        **({"grid": grid} if warmup else {}),
    )  # fmt: skip
    if cfg.split_k > 1 and not fixup:
        target = ws
        block = min(1024, triton.next_power_of_2(n))
        grid = (m, triton.cdiv(n, block))
        (reduce or _split_k_reduce_kernel[grid])(
            target, bias if bias is not None else target, out, m, n, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, BLOCK=block, num_warps=4,
            **({"grid": grid} if warmup else {}),
        )  # fmt: skip
    return out


def _check_x(x: torch.Tensor, n: int, k: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{what}: x {tuple(x.shape)} does not match weight [{n}, {k}]")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{what}: x must be bf16 or fp16, not {x.dtype}")


def mixed_gemm(
    kind: str,
    x: torch.Tensor,  # [M, K] bf16/fp16, rows contiguous
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: MixedGemmConfig | None = None,
    warmup: bool = False,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ dequantize(W)^T (+ bias)`` on 16-bit tensor cores (see the module doc).
    ``warmup=True`` compiles without launching (in parallel under ``triton.AsyncCompileMode``)."""
    check_device(x, qweight)
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if kind == "int4" else 1)
    _check_x(x, n, k, "mixed_gemm")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    layout = _layout(kind, qweight, scales, k)
    cfg = config or pick_config(kind, m, n, k, x.device) or heuristic_config(kind, m, n, k, 132)
    cfg = check_config(k, layout[0], cfg)
    return _launch(_KINDS[kind], x, None, qweight, scales, offsets, bias, out, layout, cfg, warmup)


def fp8_scaled_gemm(
    xq: torch.Tensor,  # fp8 e4m3 [M, K], rows contiguous
    x_scales: torch.Tensor,  # fp32 [M, 1] (or [M])
    qweight: torch.Tensor,  # fp8 e4m3 [N, K]
    scales: torch.Tensor,  # fp32 [N] or [1]
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: MixedGemmConfig | None = None,
    warmup: bool = False,
) -> torch.Tensor:  # [M, N] in out_dtype
    """``(xq * x_scales) @ (qweight * scales)^T (+ bias)`` on fp8 tensor cores, the scales
    applied to the fp32 accumulator (what ``torch._scaled_mm`` with row-wise scales computes)."""
    check_device(xq, qweight)
    n, k = qweight.shape
    if xq.dim() != 2 or xq.shape[1] != k or xq.stride(1) != 1 or xq.dtype != qweight.dtype:
        raise ValueError(f"fp8_scaled_gemm: x {tuple(xq.shape)} {xq.dtype} vs weight [{n}, {k}]")
    m = xq.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    layout = _layout("fp8", qweight, scales, k)
    dev = xq.device
    cfg = config or pick_config("w8a8", m, n, k, dev) or heuristic_config("w8a8", m, n, k, 132)
    cfg = check_config(k, layout[0], cfg._replace(block_k=max(cfg.block_k, 64)))
    x_scales = x_scales.reshape(m)
    return _launch(KIND_FP8, xq, x_scales, qweight, scales, None, bias, out, layout, cfg, warmup)


def w8a8_gemm(
    x: torch.Tensor,  # [M, K] bf16/fp16, rows contiguous
    qweight: torch.Tensor,  # fp8 e4m3 [N, K]
    scales: torch.Tensor,  # fp32 [N] or [1]
    bias: torch.Tensor | None = None,
    *,
    config: MixedGemmConfig | None = None,
    warmup: bool = False,
) -> torch.Tensor:  # [M, N] in x's dtype
    """fp8 W8A8: x quantized per token (``kernels.fp8_quant``, one launch), then
    ``fp8_scaled_gemm``."""
    from roofline.kernels.fp8_quant import quantize_fp8_per_token

    check_device(x, qweight)
    _check_x(x, qweight.shape[0], qweight.shape[1], "w8a8_gemm")
    xq, x_scales = quantize_fp8_per_token(x)  # fp8 [M, K], fp32 [M, 1]
    return fp8_scaled_gemm(
        xq, x_scales, qweight, scales, bias, x.dtype, config=config, warmup=warmup
    )
