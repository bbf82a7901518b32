"""Weight-only int8 / int4 GEMM for Hopper at batch sizes (about 64-512 rows), written in Gluon
(Triton's explicit-layout dialect): ``out[M, N] = x[M, K] @ dequantize(W)^T (+ bias)``, x bf16
or fp16 (the output's dtype too), W in the canonical layouts of ``roofline.quantization.formats``
(int8 ``[N, K]`` with one scale per row, int4 nibbles ``[N, K // 2]`` with group scales and
offsets), read as stored.

Swap-AB: a program owns a ``[BLOCK_N, BLOCK_M]`` tile of ``out^T``; each warpgroup's 64 weight
rows are wgmma's M side and the rows of x its N side (up to 256: at 256 rows every weight element
is widened exactly once). TMA copies x tiles and packed weight tiles into a ``STAGES``-deep ring
(one mbarrier per stage). Each K tile's packed weight is read from shared memory straight into
the wgmma A-operand register layout, widened there to x's dtype by integer bit moves and 16- or
32-bit float adds (no int-to-float conversions, quarter rate on Hopper) and issued as a
register-A ``wgmma``; while the tile's MMAs run, the next tile is widened, then
``warpgroup_mma_wait`` retires the MMAs with the tile's A registers among its ``deps``: ptxas
sees them read at the wait, so it cannot hand them to the next tile's widening while an MMA
still reads them (the hazard ptxas before 13.3 otherwise creates, triton-lang/triton#9433;
``tests/kernels/sm90_inspect.register_a_hazards`` checks the SASS). int8 row scales multiply
the finished accumulator; int4 group scales and offsets are applied per element: with scales and
offsets of x's dtype (a bf16 model's RTN; a GPTQ or AWQ checkpoint's fp16 constants in an fp16
model) in bf16x2 / f16x2 arithmetic, one FMA a pair of weights (``INT4_ASYM_TO_BF16_PTX``,
``INT4_ASYM_TO_F16_PTX``), else in fp32 (``w = q s + offset``, rounded once, as ``formats``
does).

``PIPE`` (``WoConfig.ws == PIPELINED``) keeps two K tiles' MMAs in flight instead: tile k's
MMAs are issued, ``warpgroup_mma_wait(1)`` retires tile k - 1's (whose stage then goes back to
the TMA ring), and tile k + 1 is widened while tile k's still run, so the tensor cores never
wait for a widening. The loop takes two tiles a trip (K tiles a slice even, ``fits``): each
tile's A registers are then the same on every trip, and the tile still in flight at a wait is
among its ``deps``, so ptxas 12.8 neither reuses its registers nor serializes the MMAs (the
SASS check counts a wait that leaves a group in flight). The warp-specialized form cannot: ptxas
serializes its pipelined register-A MMAs ("insufficient register resources"; the kernel's
``.maxnreg`` is 168 at its 384 threads), 12.8 and 13.5 alike.

``SPLIT_K`` slices K for shapes with few output tiles; the slices' fp32 partial sums go to a
workspace and the last slice of a tile to arrive (an acq_rel atomic counter) adds them in slice
order: deterministic, one launch, CUDA-graph replayable (the counters return to zero).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from roofline.kernels.last_program import stream_counters
from roofline.kernels.wo_gemm_configs import (
    PIPELINED,
    WO_CONFIGS,
    WO_SILU_CONFIGS,
    WoConfig,
    m_bucket,
    pick,
    pick_silu,
)

__all__ = [
    "WO_CONFIGS",
    "WO_SILU_CONFIGS",
    "WoConfig",
    "fits",
    "m_bucket",
    "pick",
    "pick_silu",
    "supports",
    "wo_gemm",
]

KIND_INT8, KIND_INT4, KIND_INT4_SYM, KIND_FP8, KIND_INT4_HALF2 = 0, 1, 2, 3, 4
INT4_KINDS = (KIND_INT4, KIND_INT4_SYM, KIND_INT4_HALF2)
"""``KIND_INT4``: asymmetric int4, scales and offsets of any float dtype, widened in fp32;
``KIND_INT4_HALF2``: the same with scales and offsets of x's dtype, widened in 16-bit pair
arithmetic (bf16x2: ``INT4_ASYM_TO_BF16_PTX``, f16x2: ``INT4_ASYM_TO_F16_PTX``);
``KIND_INT4_SYM``: symmetric (offset ``-8 s``, scales of x's dtype)."""
HALF_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
"""x's dtypes (the output's, and the widened weight's): bf16, or fp16 (a GPTQ / AWQ checkpoint
saved in fp16 runs in fp16)."""
ASYM_HALF2 = True
"""Asymmetric int4 with constants of x's dtype widened in pairs (``KIND_INT4_HALF2``); False
(sweeps): in fp32, as with other constants."""


INT8_TO_BF16_PTX: gl.constexpr = gl.constexpr(
    """{
    .reg .b32 u, f0, f1;
    cvt.u32.u16 u, $1;
    xor.b32 u, u, 0x8080;
    prmt.b32 f0, u, 0x4B000000, 0x7440;
    prmt.b32 f1, u, 0x4B000000, 0x7441;
    sub.f32 f0, f0, 0f4B000080;
    sub.f32 f1, f1, 0f4B000080;
    prmt.b32 $0, f0, f1, 0x7632;
    }"""
)
"""Two int8 (one 16-bit register, $1) -> two bf16 (one 32-bit register, $0), exact: u = q ^ 0x80
(= q + 128) goes into the mantissa of 2^23 (one byte permute per element), an fp32 subtract of
2^23 + 128 gives q, and the upper halves of the two fp32 values are one bf16x2 (|q| <= 128 has
at most 8 significant bits)."""

INT8_TO_F16_PTX: gl.constexpr = gl.constexpr(
    """{
    .reg .b32 u, c;
    cvt.u32.u16 u, $1;
    xor.b32 u, u, 0x8080;
    prmt.b32 $0, u, 0x64646464, 0x4140;
    mov.b32 c, 0x64806480;
    sub.rn.f16x2 $0, $0, c;
    }"""
)
"""Two int8 ($1) -> two fp16 ($0), exact: ``q + 128`` (the sign bits flipped) goes under the
exponent of fp16 1024 (one byte permute for the pair) and an f16x2 subtract of 1152 leaves
``q`` (as ``decode_attention.I8_TO_F16_PTX``, two at a time)."""


INT4_NIBBLES_PTX = """
    .reg .b32 b, p, l, h, c;
    cvt.u32.u16 b, $2;
    prmt.b32 p, b, 0, 0x4140;
    lop3.b32 l, p, 0x000F000F, {one}, 0xEA;
    shr.u32 h, p, 4;
    lop3.b32 h, h, 0x000F000F, {one}, 0xEA;"""
"""The int4 widenings' first half: the two bytes in ``$2`` spread over two 16-bit halves, each
low nibble (``l``) and each high nibble (``h``) under the mantissa of ``one``, a pair of 16-bit
numbers whose last mantissa bit is worth 1: bf16 128 (``128 + q``) or fp16 1024 (``1024 + q``)."""

INT4_SYM_PTX = """
    mov.b32 c, {c};
    sub.rn.{t} l, l, c;
    sub.rn.{t} h, h, c;
    mul.rn.{t} $0, l, $3;
    mul.rn.{t} $1, h, $3;
    }}"""
INT4_ASYM_PTX = """
    mov.b32 c, {one};
    sub.rn.{t} l, l, c;
    sub.rn.{t} h, h, c;
    fma.rn.{t} $0, l, $3, $4;
    fma.rn.{t} $1, h, $3, $4;
    }}"""
HALF2 = {  # x's dtype: (its pair type, the pair of ones, the pair of ones + 8)
    "bf16": ("bf16x2", "0x43004300", "0x43084308"),
    "f16": ("f16x2", "0x64006400", "0x64086408"),
}


def _int4_ptx(dtype: str, rest: str) -> str:
    """An int4 widening into pairs of ``dtype`` (``HALF2``): the nibbles, then ``rest``."""
    t, one, one8 = HALF2[dtype]
    return "{" + INT4_NIBBLES_PTX.format(one=one) + rest.format(t=t, one=one, c=one8)


INT4_SYM_TO_BF16_PTX: gl.constexpr = gl.constexpr(_int4_ptx("bf16", INT4_SYM_PTX))
"""Two bytes of symmetric int4 (one 16-bit register, $2) and their rows' bf16 scales ($3) -> the
bf16 weights of their low nibbles ($0) and of their high nibbles ($1): each nibble goes into the
mantissa of bf16 128 (``128 + q``, exact), a bf16x2 subtract of 136 gives ``q - 8`` exactly and a
bf16x2 multiply by the scale rounds ``(q - 8) s`` once, as ``formats.dequantize_int4`` does when
the offset is ``-8 s``."""
INT4_SYM_TO_F16_PTX: gl.constexpr = gl.constexpr(_int4_ptx("f16", INT4_SYM_PTX))
"""The same into fp16 (nibbles under fp16 1024, a subtract of 1032, f16x2 arithmetic)."""

INT4_ASYM_TO_BF16_PTX: gl.constexpr = gl.constexpr(_int4_ptx("bf16", INT4_ASYM_PTX))
"""Two bytes of asymmetric int4 ($2), their rows' bf16 scales ($3) and offsets ($4) -> the bf16
weights of their low nibbles ($0) and of their high nibbles ($1): each nibble goes into the
mantissa of bf16 128 and a bf16x2 subtract of 128 leaves ``q`` exactly; one bf16x2 FMA forms
``q s + offset`` exactly and rounds it once. ``formats.dequantize_int4`` rounds ``q s + offset``
to fp32, then to bf16: the same bits whenever that fp32 sum is exact, which it is when the
offset is a bf16-rounded ``-z s`` with ``z`` in 0..15 (RTN's, GPTQ's and AWQ's zero points):
``q s`` has at most 12 significant bits and the offset's magnitude is within 16 s of it."""
INT4_ASYM_TO_F16_PTX: gl.constexpr = gl.constexpr(_int4_ptx("f16", INT4_ASYM_PTX))
"""The same into fp16, for fp16 scales and offsets (a GPTQ or AWQ checkpoint saved in fp16, run
in fp16): ``q s`` has at most 15 significant bits, and the fp32 sum is exact for an fp16-rounded
``-z s`` offset."""


@gluon.jit
def _bytes_to_half(q, F16_PTX: gl.constexpr, BF16_PTX: gl.constexpr, DT: gl.constexpr):
    """Bytes (int8 or e4m3, as int8) -> ``DT`` (bf16 or fp16), two at a time (the pair a thread
    holds of wgmma's A operand: one 16-bit shared-memory load), by the PTX for ``DT``."""
    if DT == gl.float16:  # (compiled alone; one return: Triton types every return)
        w = gl.inline_asm_elementwise(F16_PTX, "=r,h", [q], dtype=gl.float16, is_pure=True, pack=2)
    else:
        w = gl.inline_asm_elementwise(
            BF16_PTX, "=r,h", [q], dtype=gl.bfloat16, is_pure=True, pack=2
        )
    return w


@gluon.jit
def _int4_sym_halves(b, s, DT: gl.constexpr):
    """Bytes ``b`` (uint8) and scales ``s`` (``DT``, broadcast) -> (low-nibble, high-nibble)
    ``DT`` weights of symmetric int4 (``INT4_SYM_TO_BF16_PTX`` / ``INT4_SYM_TO_F16_PTX``)."""
    if DT == gl.float16:  # (compiled alone; one return: Triton types every return)
        w = gl.inline_asm_elementwise(
            INT4_SYM_TO_F16_PTX, "=r,=r,h,r", [b, s], dtype=(gl.float16, gl.float16),
            is_pure=True, pack=2,
        )  # fmt: skip
    else:
        w = gl.inline_asm_elementwise(
            INT4_SYM_TO_BF16_PTX, "=r,=r,h,r", [b, s], dtype=(gl.bfloat16, gl.bfloat16),
            is_pure=True, pack=2,
        )  # fmt: skip
    return w


@gluon.jit
def _int4_asym_halves(b, s, o, DT: gl.constexpr):
    """Bytes ``b`` (uint8), scales ``s`` and offsets ``o`` (``DT``, broadcast) -> (low-nibble,
    high-nibble) ``DT`` weights of asymmetric int4 (``INT4_ASYM_TO_BF16_PTX`` /
    ``INT4_ASYM_TO_F16_PTX``)."""
    if DT == gl.float16:  # (compiled alone; one return: Triton types every return)
        w = gl.inline_asm_elementwise(
            INT4_ASYM_TO_F16_PTX, "=r,=r,h,r,r", [b, s, o], dtype=(gl.float16, gl.float16),
            is_pure=True, pack=2,
        )  # fmt: skip
    else:
        w = gl.inline_asm_elementwise(
            INT4_ASYM_TO_BF16_PTX, "=r,=r,h,r,r", [b, s, o], dtype=(gl.bfloat16, gl.bfloat16),
            is_pure=True, pack=2,
        )  # fmt: skip
    return w


@gluon.jit
def _int4_halves(b):
    """The two nibbles of byte ``b`` (low = even k) as fp32 ``v = 1 + q / 16`` (each nibble put
    into the mantissa of 1.0f; no int-to-float conversion): one FMA then makes
    ``v * 16 s + (offset - 16 s)`` = ``q s + offset``."""
    lo = ((b & 0xF).to(gl.uint32) << 19) | 0x3F800000
    hi = ((b & 0xF0).to(gl.uint32) << 15) | 0x3F800000
    return lo.to(gl.float32, bitcast=True), hi.to(gl.float32, bitcast=True)


FP8_TO_BF16_PTX: gl.constexpr = gl.constexpr(
    """{
    .reg .b32 u, m, g, c;
    cvt.u32.u16 u, $1;
    prmt.b32 u, u, 0, 0x4140;
    shl.b32 m, u, 4;
    and.b32 m, m, 0x07F007F0;
    shl.b32 g, u, 8;
    and.b32 g, g, 0x80008000;
    or.b32 m, m, g;
    mov.b32 c, 0x7B807B80;
    mul.rn.bf16x2 $0, m, c;
    }"""
)
"""Two e4m3 bytes (one 16-bit register, $1) -> two bf16 (one 32-bit register, $0), exact: each
byte's sign goes to bit 15 and its exponent and mantissa bits under bf16's (``(b & 0x7F) << 4``:
the e4m3 value times 2^-120 as a bf16, subnormals included), and a bf16x2 multiply by 2^120
restores the scale (a power of two: exact). NaN bytes (0x7F, 0xFF) do not occur in quantized
weights."""


FP8_TO_F16_PTX: gl.constexpr = gl.constexpr("cvt.rn.f16x2.e4m3x2 $0, $1;")
"""Two e4m3 bytes ($1) -> two fp16 ($0), the low byte into the low half: exact (every e4m3
value is an fp16), one conversion for the pair (sm_89 and later)."""


@gluon.jit
def _refill(x_desc, q_desc, x_smem, q_smem, ready, off_m, off_n, k, tile_first, k_tiles, ok,
            BLOCK_K: gl.constexpr, QK: gl.constexpr, STAGES: gl.constexpr,
            tile_bytes: gl.constexpr):  # fmt: skip
    """Tile ``k``'s MMAs have retired in this thread: once every warp is there, stage
    ``k % STAGES`` takes tile ``k + STAGES`` (if ``ok`` and there is one; ``k`` >= -1: the
    first trip's call for tile -1 is predicated off, its stage index kept in range)."""
    gl.thread_barrier()
    s = (k + STAGES) % STAGES
    kl = k + STAGES
    pred = ok & (kl < k_tiles)
    mbarrier.expect(ready.index(s), tile_bytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [off_m, (tile_first + kl) * BLOCK_K], ready.index(s),
                                    x_smem.index(s), pred=pred)  # fmt: skip
    tma.async_copy_global_to_shared(q_desc, [off_n, (tile_first + kl) * QK], ready.index(s),
                                    q_smem.index(s), pred=pred)  # fmt: skip


@gluon.jit(do_not_specialize=["M"])
def _wo_gemm_kernel(
    x_desc,  # TMA [M, K] bf16 / fp16, block [BLOCK_M, BLOCK_K]
    q_desc,  # TMA int8 [N, K] (block [BLOCK_N, BLOCK_K]) or uint8 [N, K // 2] (BLOCK_K // 2)
    s_ptr,  # int8: [N] row scales; int4: [N, K // GROUP]
    o_ptr,  # int4: [N, K // GROUP] offsets
    bias_ptr,  # [N]
    out_ptr,  # [M, N], x's dtype
    ws_ptr,  # fp32 [SPLIT_K, M, N] partial sums (SPLIT_K > 1)
    lock_ptr,  # int32 [tiles] arrival counters, zero between launches
    M,
    N,
    K,
    stride_s,
    stride_g,
    stride_om,
    KIND: gl.constexpr,
    GROUP: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    SPLIT_K: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    PIPE: gl.constexpr = False,
):
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(STAGES >= 2, "tile k + 1 is awaited while tile k is in flight")
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_M, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    QK: gl.constexpr = q_row_bytes(KIND, BLOCK_K)  # bytes a row
    DT: gl.constexpr = x_desc.dtype  # bf16 or fp16: the weight's widened dtype, the output's

    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k_tiles_all = K // BLOCK_K
    slice_id = gl.program_id(1)
    tile_first = (slice_id * k_tiles_all) // SPLIT_K
    k_tiles = ((slice_id + 1) * k_tiles_all) // SPLIT_K - tile_first

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_N, QK], q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    tile_bytes: gl.constexpr = BLOCK_M * BLOCK_K * 2 + BLOCK_N * QK
    for i in gl.static_range(STAGES):
        pred = i < k_tiles
        kk = tile_first + i
        mbarrier.expect(ready.index(i), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(
            x_desc, [off_m, kk * BLOCK_K], ready.index(i), x_smem.index(i), pred=pred
        )
        tma.async_copy_global_to_shared(
            q_desc, [off_n, kk * QK], ready.index(i), q_smem.index(i), pred=pred
        )

    rows_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))  # [BN]
    rows_n = gl.minimum(rows_n, N - 1).to(gl.int64)
    rows_b = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout_bytes(a_layout)))
    rows_b = gl.minimum(rows_b, N - 1).to(gl.int64)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
    span, base = _group_scales(
        s_ptr, o_ptr, rows_n, rows_b, tile_first, stride_s, stride_g, KIND, GROUP, BLOCK_K
    )
    mbarrier.wait(ready.index(0), 0)
    w = _widen(q_smem.index(0), span, base, a_layout, KIND, BLOCK_N, BLOCK_K, DT)
    if PIPE:  # two K tiles' MMAs in flight (module docstring): two tiles a trip, k_tiles even
        w1 = w  # (no MMA reads it before the first wait)
        for kk in range(0, k_tiles, 2):
            acc = warpgroup_mma(w, x_smem.index(kk % STAGES).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            # tile kk - 1's MMAs retire; w stays live (tile kk's MMAs read it)
            acc, w1, w = warpgroup_mma_wait(num_outstanding=1, deps=[acc, w1, w])
            _refill(x_desc, q_desc, x_smem, q_smem, ready, off_m, off_n, kk - 1, tile_first,
                    k_tiles, kk > 0, BLOCK_K, QK, STAGES, tile_bytes)  # fmt: skip
            span, base = _group_scales(s_ptr, o_ptr, rows_n, rows_b, tile_first + kk + 1,
                                       stride_s, stride_g, KIND, GROUP, BLOCK_K)  # fmt: skip
            mbarrier.wait(ready.index((kk + 1) % STAGES), ((kk + 1) // STAGES) & 1)
            w1 = _widen(q_smem.index((kk + 1) % STAGES), span, base, a_layout, KIND, BLOCK_N,
                        BLOCK_K, DT)  # fmt: skip
            acc = warpgroup_mma(w1, x_smem.index((kk + 1) % STAGES).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            acc, w, w1 = warpgroup_mma_wait(num_outstanding=1, deps=[acc, w, w1])  # tile kk
            _refill(x_desc, q_desc, x_smem, q_smem, ready, off_m, off_n, kk, tile_first,
                    k_tiles, True, BLOCK_K, QK, STAGES, tile_bytes)  # fmt: skip
            kn = kk + 2
            span, base = _group_scales(s_ptr, o_ptr, rows_n, rows_b,
                                       tile_first + gl.minimum(kn, k_tiles - 1), stride_s,
                                       stride_g, KIND, GROUP, BLOCK_K)  # fmt: skip
            mbarrier.wait(ready.index(kn % STAGES), (kn // STAGES) & 1, pred=kn < k_tiles)
            w = _widen(q_smem.index(kn % STAGES), span, base, a_layout, KIND, BLOCK_N, BLOCK_K, DT)
        acc, w1 = warpgroup_mma_wait(num_outstanding=0, deps=[acc, w1])
    else:
        for k in range(k_tiles):
            s = k % STAGES
            kn = k + 1  # widened while tile k's MMAs run (after the last tile: a stale stage)
            sn = kn % STAGES
            span, base = _group_scales(s_ptr, o_ptr, rows_n, rows_b,
                                       tile_first + gl.minimum(kn, k_tiles - 1), stride_s,
                                       stride_g, KIND, GROUP, BLOCK_K)  # fmt: skip
            mbarrier.wait(ready.index(sn), (kn // STAGES) & 1, pred=kn < k_tiles)
            acc = warpgroup_mma(w, x_smem.index(s).permute((1, 0)), acc, is_async=True)
            w_next = _widen(q_smem.index(sn), span, base, a_layout, KIND, BLOCK_N, BLOCK_K, DT)
            # every MMA of tile k retires before the loop goes on: no A register is reused early
            acc, w, w_next = warpgroup_mma_wait(num_outstanding=0, deps=[acc, w, w_next])
            gl.thread_barrier()  # every warpgroup is done with stage s
            kl = k + STAGES
            pred = kl < k_tiles
            mbarrier.expect(ready.index(s), tile_bytes, pred=pred)
            tma.async_copy_global_to_shared(
                x_desc, [off_m, (tile_first + kl) * BLOCK_K], ready.index(s), x_smem.index(s),
                pred=pred,
            )  # fmt: skip
            tma.async_copy_global_to_shared(
                q_desc, [off_n, (tile_first + kl) * QK], ready.index(s), q_smem.index(s), pred=pred
            )
            w = w_next
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    if SPLIT_K == 1 and HAS_BIAS:  # row scale and bias in the MMA layout (fewer live registers)
        rows_a = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        ok_a = rows_a < N
        if (KIND == 0) | (KIND == 3):  # row scales
            acc = acc * gl.load(s_ptr + rows_a, mask=ok_a, other=0.0).to(gl.float32)[:, None]
        acc = acc + gl.load(bias_ptr + rows_a, mask=ok_a, other=0.0).to(gl.float32)[:, None]
    out_layout: gl.constexpr = gl.BlockedLayout([2, 1], [32, 1], [1, NW], [0, 1])  # along N
    res = gl.convert_layout(acc, out_layout)  # [BN, BM]
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
    n_ok = offs_n < N
    mask = n_ok[:, None] & (offs_m[None, :] < M)
    if SPLIT_K == 1:
        if ((KIND == 0) | (KIND == 3)) and not HAS_BIAS:
            res = res * gl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
        out_ptrs = out_ptr + offs_m.to(gl.int64)[None, :] * stride_om + offs_n[:, None]
        gl.store(out_ptrs, res.to(DT), mask=mask)
    else:
        slice_size = M.to(gl.int64) * N
        offs_ws = offs_m[None, :] * N + offs_n[:, None]  # int32: SPLIT_K * M * N < 2^31
        gl.store(ws_ptr + slice_id * slice_size + offs_ws, res, mask=mask)
        gl.thread_barrier()  # every thread's partial sums are written
        arrived = gl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # sum the slices in order, a chunk of rows of x at a time
            CH: gl.constexpr = 64 if BLOCK_M > 64 else BLOCK_M
            for c in gl.static_range(BLOCK_M // CH):
                offs_c = off_m + c * CH + gl.arange(0, CH, layout=gl.SliceLayout(0, out_layout))
                mask_c = n_ok[:, None] & (offs_c[None, :] < M)
                offs_wc = offs_c[None, :] * N + offs_n[:, None]
                total = gl.zeros([BLOCK_N, CH], gl.float32, out_layout)
                for sl in range(SPLIT_K):  # .cg: from L2, never a stale L1 line
                    part = ws_ptr + sl * slice_size + offs_wc
                    total += gl.load(part, mask=mask_c, other=0.0, cache_modifier=".cg")
                if (KIND == 0) | (KIND == 3):  # the row scales
                    total = (
                        total
                        * gl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
                    )
                if HAS_BIAS:
                    bias = gl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)
                    total += bias[:, None]
                out_c = out_ptr + offs_c.to(gl.int64)[None, :] * stride_om + offs_n[:, None]
                gl.store(out_c, total.to(DT), mask=mask_c)
            gl.atomic_xchg(lock_ptr + pid, 0)


@gluon.jit
def _group_scales(s_ptr, o_ptr, rows_n, rows_b, k_tile, stride_s, stride_g, KIND: gl.constexpr,
                  GROUP: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
    """The per-row constants of a K tile's group ([BN] each; loaded a tile ahead of their use,
    their latency under the MMAs): int4 fp32 ``16 s`` and ``offset - 16 s``; symmetric int4 the
    scale (x's dtype, rows in the byte layout) twice; int4 with constants of x's dtype the scale
    and the offset (rows in the byte layout); int8 zeros (row scales multiply the
    accumulator)."""
    if KIND == 1:
        col = (k_tile * BLOCK_K) // GROUP
        sc = gl.load(s_ptr + rows_n * stride_s + col * stride_g).to(gl.float32)
        off = gl.load(o_ptr + rows_n * stride_s + col * stride_g).to(gl.float32)
        span = 16.0 * sc
        base = off - span
    elif (KIND == 2) | (KIND == 4):
        col = (k_tile * BLOCK_K) // GROUP
        span = gl.load(s_ptr + rows_b * stride_s + col * stride_g)
        base = span
        if KIND == 4:
            base = gl.load(o_ptr + rows_b * stride_s + col * stride_g)
    else:
        span = rows_n.to(gl.float32) * 0.0
        base = span
    return span, base


@gluon.jit
def _widen(
    q_tile,  # shared [BLOCK_N, QK] packed weight tile
    span,  # [BN] (see _group_scales)
    base,  # [BN]
    a_layout: gl.constexpr,
    KIND: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    DT: gl.constexpr,
):
    """The tile in ``DT`` (x's dtype: bf16 or fp16), in wgmma's A-operand register layout."""
    if KIND == 0:
        w = _bytes_to_half(q_tile.load(a_layout), INT8_TO_F16_PTX, INT8_TO_BF16_PTX, DT)
    elif KIND == 3:
        w = _bytes_to_half(q_tile.load(a_layout), FP8_TO_F16_PTX, FP8_TO_BF16_PTX, DT)
    elif KIND == 1:
        # bytes in the A layout of a [BN, BK / 2] tile: each thread's byte holds its k pair
        b = q_tile.load(a_layout_bytes(a_layout)).to(gl.uint32)
        lo, hi = _int4_halves(b)
        v = gl.convert_layout(gl.join(lo, hi).reshape(BLOCK_N, BLOCK_K), a_layout)  # same layout
        w = (v * span[:, None] + base[:, None]).to(DT)
    else:  # int4 widened in pairs of DT: symmetric, or with offsets of DT
        b = q_tile.load(a_layout_bytes(a_layout))
        sb, b = gl.broadcast(span[:, None], b)
        if KIND == 4:
            ob, b = gl.broadcast(base[:, None], b)
            lo, hi = _int4_asym_halves(b, sb, ob, DT)
        else:
            lo, hi = _int4_sym_halves(b, sb, DT)
        w = gl.convert_layout(gl.join(lo, hi).reshape(BLOCK_N, BLOCK_K), a_layout)
    return w


@gluon.constexpr_function
def q_row_bytes(kind, block_k):
    """Bytes a packed weight row takes in a ``block_k`` tile: half for the int4 kinds."""
    return block_k // 2 if kind in INT4_KINDS else block_k


@gluon.constexpr_function
def a_layout_bytes(a_layout):
    return gl.DotOperandLayout(operand_index=0, parent=a_layout.parent, k_width=1)


def supports(
    kind: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, cfg: WoConfig
) -> bool:
    """Whether ``wo_gemm`` takes this call with ``cfg``: a Hopper GPU and ``fits``."""
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        return False
    return fits(kind, x, qweight, scales, cfg)


def fits(
    kind: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, cfg: WoConfig
) -> bool:
    """The layout checks of ``supports`` (any device): bf16 or fp16 x with 16-byte aligned rows
    (TMA), K a multiple of BLOCK_K, int8 or fp8 (e4m3) with one scale per row, or int4 whose groups
    hold whole K tiles (shapes, strides and pointers only, no sync)."""
    if kind not in ("int8", "int4", "fp8") or x.dtype not in HALF_DTYPES or x.dim() != 2:
        return False
    if cfg.ws in (1, 2) and cfg.block_n != 128:  # two consumer warpgroups
        return False
    if cfg.ws == 2 and cfg.block_m not in (64, 128, 256):  # (kernels.wo_gemm_sk)
        return False
    k = x.shape[1]
    n = qweight.shape[0]
    if x.stride(1) != 1 or (x.stride(0) * 2) % 16 or x.data_ptr() % 16 or k % cfg.block_k:
        return False
    if cfg.ws == PIPELINED and (k // cfg.block_k) % (2 * cfg.split_k):  # whole pairs a slice
        return False
    if not qweight.is_contiguous() or qweight.data_ptr() % 16 or qweight.stride(0) % 16:
        return False
    if kind in ("int8", "fp8"):
        dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
        return qweight.dtype == dtype and qweight.shape[1] == k and scales.numel() == n
    groups = scales.shape[1] if scales.dim() == 2 else 0
    return (
        qweight.dtype == torch.uint8
        and qweight.shape[1] * 2 == k
        and groups > 0
        and k % groups == 0
        and (k // groups) % cfg.block_k == 0
    )


def kind_and_descriptors(
    caller: str,
    kind: str,
    x: torch.Tensor,  # [M, K] bf16 or fp16
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    cfg: WoConfig,
) -> tuple[int, object, object]:
    """The kernel's ``KIND`` code and the TMA descriptors of x and the packed weight (boxes
    ``[BLOCK_M, BLOCK_K]`` and ``[BLOCK_N, BLOCK_K]`` bytes, halved for int4); ``caller`` names
    the function in the error for symmetric int4 whose scales are not of x's dtype."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if kind == "int8":
        code = KIND_INT8
    elif kind == "fp8":  # e4m3 bytes, read as int8
        code = KIND_FP8
        qweight = qweight.view(torch.int8)
    elif offsets is None:  # symmetric int4: offset = -8 s (scales of x's dtype)
        if scales.dtype != x.dtype:
            raise ValueError(
                f"{caller}: symmetric int4 (no offsets) takes scales of x's dtype ({x.dtype}), "
                f"got {scales.dtype}"
            )
        code = KIND_INT4_SYM
    elif ASYM_HALF2 and scales.dtype == offsets.dtype == x.dtype:  # widened in pairs
        code = KIND_INT4_HALF2
    else:
        code = KIND_INT4
    int4 = code in INT4_KINDS
    qk = cfg.block_k // 2 if int4 else cfg.block_k
    x_type = HALF_DTYPES[x.dtype]
    x_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], x_type)
    q_dtype = gl.uint8 if int4 else gl.int8
    q_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, qk], q_dtype)
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k], x_layout)
    q_desc = TensorDescriptor.from_tensor(qweight, [cfg.block_n, qk], q_layout)
    return code, x_desc, q_desc


MAX_TILES = 1 << 16


def scale_args(
    code: int,
    k: int,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """The launch arguments every form of the kernel takes for a weight's constants: (scales,
    offsets, bias, stride_s, stride_g, GROUP). Absent offsets and bias stand in as ``scales``
    (never read); int4 scales and offsets share their strides (a row's, ``stride_s``, and a
    group's, ``stride_g``: 1 in the canonical layout, N when stored group-major, see
    ``formats.group_major``); int8 / fp8 row scales have strides 1 and no group."""
    int4 = code in INT4_KINDS
    if offsets is not None and offsets.stride() != scales.stride():
        scales, offsets = scales.contiguous(), offsets.contiguous()
    return (
        scales,
        offsets if offsets is not None else scales,
        bias if bias is not None else scales,
        scales.stride(0) if int4 else 1,
        scales.stride(1) if int4 else 1,
        k // scales.shape[1] if int4 else 0,
    )


def wo_gemm(
    kind: str,
    x: torch.Tensor,  # [M, K] bf16 or fp16, rows contiguous
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    cfg: WoConfig,
) -> torch.Tensor:  # [M, N], x's dtype
    """``x @ dequantize(W)^T (+ bias)`` (see the module doc); the caller checks ``supports``.
    int8 ``scales`` hold one value per row ([N] or [N, 1]); int4 ``scales`` / ``offsets`` are
    ``[N, K // group]``; int4 with ``offsets=None`` is symmetric (offset ``-8 s``, scales of
    x's dtype: widened in bf16x2 / f16x2 arithmetic, two instructions a weight)."""
    if cfg.ws == 2:
        from roofline.kernels.wo_gemm_sk import sk_gemm

        return sk_gemm(kind, x, qweight, scales, offsets, bias, cfg)
    if cfg.ws == 1:
        from roofline.kernels.wo_gemm_ws import wo_gemm_ws

        return wo_gemm_ws(kind, x, qweight, scales, offsets, bias, cfg)
    m, k = x.shape
    n = qweight.shape[0]
    code, x_desc, q_desc = kind_and_descriptors("wo_gemm", kind, x, qweight, scales, offsets, cfg)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split_k = max(1, min(cfg.split_k, k // cfg.block_k))  # no empty slice
    ws = locks = out
    if split_k > 1:
        if tiles > MAX_TILES or split_k * m * n >= 1 << 31:
            raise ValueError(f"wo_gemm: split-K of {m} x {n} ({tiles} tiles) is too large")
        ws = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        # (kernels of one stream run in turn; each leaves its counters at 0)
        locks = stream_counters(x.device, MAX_TILES, "wo_gemm")
    scales, offsets, bias_arg, stride_s, stride_g, group = scale_args(
        code, k, scales, offsets, bias
    )
    _wo_gemm_kernel[(tiles, split_k)](
        x_desc, q_desc, scales, offsets, bias_arg, out, ws, locks, m, n, k, stride_s, stride_g,
        out.stride(0), KIND=code, GROUP=group, HAS_BIAS=bias is not None, SPLIT_K=split_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages,
        GROUP_M=cfg.group_m, PIPE=cfg.ws == PIPELINED, num_warps=cfg.block_n // 16,
    )  # fmt: skip
    return out
