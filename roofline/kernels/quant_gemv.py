"""Decode GEMV for quantized weights (M <= 16): ``out[M, N] = x[M, K] @ W^T`` with W in the
canonical int8 / int4 / fp8 layouts of ``roofline.quantization.formats``, built to stream the
weight bytes at copy bandwidth.

At batch 1 a quantized GEMV is bound by the ALU, not by HBM, unless widening a weight costs
about one instruction: an H100 SM must widen ~29 int4 (or ~15 int8) elements per clock to keep up
with HBM, and its type-conversion units retire 16 per clock. So the weight is read as int32
words and widened without conversion instructions, by the "magic number" trick: an integer
``u < 2^23`` OR-ed into the mantissa of fp32 ``2^23`` (``0x4B000000``) is the float
``2^23 + u``, and one fp32 subtraction leaves ``u`` exactly.

* int4: a word holds 8 nibbles, element ``8j + i`` of the row in bits ``4i .. 4i + 3`` of word
  j (the canonical byte layout read little-endian). Nibble i (i < 4) is taken in place,
  ``(w & (0xF << 4i)) | 0x4B000000`` (one LOP3), which is ``2^23 + q * 2^4i``; nibbles 4..7
  come from ``w >> 16`` the same way; one FMA, ``f * 2^-4i - 2^(23 - 4i)``, leaves q exactly.
  x is loaded per nibble position with stride 8: the dot over K does not care about the order
  of K. Per element: one logic op and two FMAs (widen, multiply-add).
* int8: the word XOR ``0x80808080`` turns each signed byte into ``q + 128``; bytes 0, 1 in place
  and 2, 3 from ``w >> 16``, same trick, ``q`` recovered by subtracting ``2^23 + 128 * 2^8i``.
* fp8: loaded as elements and widened by Triton's conversion (``FP8_VIA`` picks the route:
  straight to fp32, through fp16, through bf16; the sweep in ``scripts/gpu_quant.py`` chose).

Scales: where a row has one scale (fp8, per-channel int8) it multiplies the finished dot
product. Group scales and offsets are applied once per group: the group's integer dot product
``sum x q`` (fp32) times its scale, plus its offset times ``sum x`` over the group. No weight is
ever rounded to 16 bits, so the result differs from ``dequant_gemm_ref`` (which rounds the
dequantized weight to x's dtype) by that rounding only.

One row of x (``BLOCK_M == 1``) reduces on CUDA cores (an fp32 ``[BLOCK_N, words]`` tile of
products, summed over K once per group or once at the end); more rows use tensor cores
(``tl.dot`` of x against the widened weight rounded to bf16/fp16, exact for these small
integers) and need at least 16 words per group tile. Configs: ``TUNED_CONFIGS[(kind, N, K,
row_bucket(M))]`` (H100, from the sweep), else ``heuristic_config``. ``supports`` says whether a
weight can take this kernel at all (words must be 4-byte aligned); ``common.quantized_linear``
falls back to ``dequant_gemm`` where it cannot.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret, num_sms
from roofline.kernels.dequant_gemm import _scale_bias_store
from roofline.kernels.gemv import _silu_mul, m_bucket

MAX_ROWS = 256  # decode batches up to 16 rows; larger M (tensor cores, BLOCK_M rows a program)
MAGIC = 0x4B000000  # fp32 bits of 2^23: OR-ing u < 2^23 into the mantissa gives 2^23 + u
BIAS8 = -2139062144  # 0x80808080 as int32: XOR turns four signed bytes into q + 128
ELEMS_PER_WORD = {"int4": 8, "int8": 4, "fp8": 4}
_KINDS = {"int8": 0, "int4": 1, "fp8": 2}


class QuantGemvConfig(NamedTuple):
    block_n: int  # output columns (weight rows) per program, a power of two
    block_k: int  # K elements per loop step: a multiple of the group, or a divisor of it
    num_warps: int
    num_stages: int  # tiles in flight (cp.async pipelining of the K loop)
    unpack: int  # 0 Triton conversions; int4/int8 1: fp32 magic; int4 2: 16-bit pairs on tensor
    # cores at every M; fp8 1/2: widened through fp16/bf16
    block_m: int = 0  # rows of x per program; 0: M's power-of-two bucket (16 at most), 64 above
    x_split: int = 0  # int4/int8: 1 loads x contiguously and splits it into element positions


# (kind, N, K, row_bucket(M)) -> config, measured on an H100 by scripts/gpu_quant.py (Llama-3.1-8B).
# Llama-3.1-8B qkv / o / gate_up / down at one row, 2026-11-24 (int8 per channel, int4 g128, fp8):
# 59-85% / 24-46% / 68-97% of copy bandwidth; the generic kernel measured 58-75 / 10-25 / 56-75%.
TUNED_CONFIGS: dict[tuple[str, int, int, int], tuple[int, ...]] = {  # QuantGemvConfig fields
    ("int8", 6144, 4096, 1): (8, 512, 4, 4, 0, 0),
    ("int8", 4096, 4096, 1): (8, 512, 4, 4, 0, 0),
    ("int8", 28672, 4096, 1): (8, 512, 4, 4, 0, 0),
    ("int8", 4096, 14336, 1): (8, 512, 4, 4, 1, 0),
    ("int4", 6144, 4096, 1): (8, 512, 4, 4, 1, 0),
    ("int4", 4096, 4096, 1): (8, 512, 4, 4, 0, 0),
    ("int4", 28672, 4096, 1): (16, 512, 1, 4, 0, 0),
    ("int4", 4096, 14336, 1): (8, 512, 4, 4, 0, 0),
    ("fp8", 6144, 4096, 1): (8, 512, 4, 4, 1, 0),
    ("fp8", 4096, 4096, 1): (8, 512, 4, 4, 0, 0),
    ("fp8", 28672, 4096, 1): (8, 512, 4, 4, 1, 0),
    ("fp8", 4096, 14336, 1): (8, 512, 4, 4, 0, 0),
}


def row_bucket(m: int) -> int:
    """The TUNED_CONFIGS key for M rows: the next power of two (at most MAX_ROWS)."""
    return min(MAX_ROWS, triton.next_power_of_2(max(m, 1)))


def heuristic_config(kind: str, n: int, k: int, m: int, sms: int) -> QuantGemvConfig:
    """Decode (M <= 16): at least two programs per SM (BLOCK_N from 32 down to 4); 512
    elements per step (256 bytes of int4 per row), four stages; the magic unpack. One row of
    int4 (a 16-word tile per group of 128, loaded as 4-word vectors): as many warps as that tile
    fills (BLOCK_N / 8), so no thread holds a replicated copy; otherwise four warps. Larger M:
    64 x 64 output tiles, 128 elements per step, three stages."""
    if m > 16:
        return QuantGemvConfig(64, 128, 4, 3, 1 if kind != "fp8" else 0, 64)
    block_n = 32 if m > 1 else 16
    while block_n > 4 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    block_k = 512
    while block_k > 64 and k % block_k:
        block_k //= 2
    warps = max(1, min(4, block_n // 8)) if kind == "int4" and m == 1 else 4
    return QuantGemvConfig(block_n, block_k, warps, 4, 1 if kind != "fp8" else 0)


def pick_config(kind: str, m: int, n: int, k: int, device: torch.device) -> QuantGemvConfig:
    """The tuned config of M's bucket, else of the nearest measured bucket of the same kind
    (one row: CUDA cores; 2-16 rows: tensor cores; more: row blocks), else the heuristic's."""
    bucket = row_bucket(m)
    if m == 1:
        order = [1]
    elif m <= 16:  # tensor-core buckets only: this one, then the others nearest first
        order = [bucket] + sorted({2, 4, 8, 16} - {bucket}, key=lambda b: abs(b - bucket))
    else:
        order = [bucket] + [b for b in (256, 128, 64, 32) if b != bucket]
    for b in order:
        tuned = TUNED_CONFIGS.get((kind, n, k, b))
        if tuned is not None:
            return QuantGemvConfig(*tuned)
    return heuristic_config(kind, n, k, m, num_sms(device))


@triton.jit
def _widen(src, SH: tl.constexpr, KIND: tl.constexpr, UNPACK: tl.constexpr):
    """The integer q held at bits ``SH ..`` of each int32 in src, as fp32 (the magic unpack: one
    logic op and one FMA; or Triton's conversions)."""
    if KIND == 1:
        if UNPACK == 1:  # (2^23 + q 2^SH) 2^-SH - 2^(23 - SH): one exact FMA
            f = ((src & (15 << SH)) | 0x4B000000).to(tl.float32, bitcast=True)
            w = f * (1.0 / (1 << SH)) - 8388608.0 / (1 << SH)
        else:
            w = ((src >> SH) & 15).to(tl.float32)
    else:  # int8; src already XOR-ed to q + 128 with the magic unpack
        if UNPACK == 1:
            f = ((src & (255 << SH)) | 0x4B000000).to(tl.float32, bitcast=True)
            w = f * (1.0 / (1 << SH)) - (8388608.0 / (1 << SH) + 128.0)
        else:
            w = ((src << (24 - SH)) >> 24).to(tl.float32)
    return w


@triton.jit
def _load_x(x_ptrs, K, SILU_MUL: tl.constexpr, LIBDEVICE: tl.constexpr, USE_DOT: tl.constexpr):
    if SILU_MUL:
        x = _silu_mul(tl.load(x_ptrs), tl.load(x_ptrs + K), LIBDEVICE, USE_DOT)
    else:
        x = tl.load(x_ptrs)
    return x


@triton.jit
def _int4_pairs(
    words,
    x_ptrs,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SILU_MUL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """int4 ``UNPACK == 2``: two nibbles widened per 32-bit op. ``((w >> 4i) & 0x000F000F) |
    0x43004300`` holds bf16 ``128 + q`` for nibbles i (low half) and i + 4 (high half) (fp16:
    ``0x64006400``, ``1024 + q``); each half feeds a tensor-core dot against x's elements of
    that nibble position, and ``128 * sum x`` (1024) comes off the group's dot product."""
    X_DTYPE: tl.constexpr = x_ptrs.dtype.element_ty
    MAGIC16: tl.constexpr = 0x64006400 if X_DTYPE == tl.float16 else 0x43004300
    BASE: tl.constexpr = 1024.0 if X_DTYPE == tl.float16 else 128.0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for i in tl.static_range(4):
        x_lo = _load_x(x_ptrs + i, K, SILU_MUL, LIBDEVICE, True)  # [BM, SW]
        x_hi = _load_x(x_ptrs + i + 4, K, SILU_MUL, LIBDEVICE, True)
        v = ((words >> (4 * i)) & 0x000F000F) | MAGIC16  # [BN, SW]: two 16-bit floats
        lo = v.to(tl.int16).to(X_DTYPE, bitcast=True)  # [BN, SW]
        hi = (v >> 16).to(tl.int16).to(X_DTYPE, bitcast=True)
        acc = tl.dot(x_lo, tl.trans(lo), acc)
        acc = tl.dot(x_hi, tl.trans(hi), acc)
        xsum += tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
    return acc - BASE * xsum[:, None], xsum


@triton.jit
def _sub_tile(
    q_ptrs,  # [BN, SW] int32 words (or [BN, SUB_K] fp8 elements)
    x_ptrs,  # [BM, SW] x pointers of element 0 of each word (stride EPW)
    xc_ptrs,  # [BM, SW * EPW] x pointers of the sub-tile, contiguous
    K,
    X_SPLIT: tl.constexpr,
    KIND: tl.constexpr,
    UNPACK: tl.constexpr,
    EPW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SW: tl.constexpr,
    USE_DOT: tl.constexpr,
    SILU_MUL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """Unscaled partial dot products of one sub-tile: ``[BM, BN]`` (tensor cores) or the
    ``[BN, SW]`` fp32 products for one row; and ``sum x`` over the sub-tile (int4): ``[BM]``,
    or per word position ``[1, SW]`` for one row.
    (Static branches only, no early returns: Triton would still compile the code after one.)"""
    if KIND == 2:
        acc, xsum = _fp8_tile(
            q_ptrs, x_ptrs, K, UNPACK, BLOCK_M, BLOCK_N, SW, USE_DOT, SILU_MUL, LIBDEVICE
        )
    elif KIND == 1 and UNPACK == 2:  # 16-bit pairs for tensor cores (see _int4_pairs)
        words = tl.load(q_ptrs, eviction_policy="evict_first")  # [BN, SW] int32
        acc, xsum = _int4_pairs(words, x_ptrs, K, BLOCK_M, BLOCK_N, SILU_MUL, LIBDEVICE)
    else:
        acc, xsum = _word_tile(
            q_ptrs, x_ptrs, xc_ptrs, K, X_SPLIT, KIND, UNPACK, EPW, BLOCK_M, BLOCK_N, SW,
            USE_DOT, SILU_MUL, LIBDEVICE,
        )  # fmt: skip
    return acc, xsum


@triton.jit
def _fp8_tile(
    q_ptrs,
    x_ptrs,
    K,
    UNPACK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SW: tl.constexpr,
    USE_DOT: tl.constexpr,
    SILU_MUL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, SW), dtype=tl.float32)
    xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    w = tl.load(q_ptrs, eviction_policy="evict_first")  # [BN, SW] fp8
    x = _load_x(x_ptrs, K, SILU_MUL, LIBDEVICE, USE_DOT)  # [BM, SW]
    if UNPACK == 1:
        w = w.to(tl.float16)
    elif UNPACK == 2:
        w = w.to(tl.bfloat16)
    if USE_DOT:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    else:
        acc += w.to(tl.float32) * x.to(tl.float32)
    return acc, xsum


@triton.jit
def _word_step(
    acc,
    xsum,
    words,
    high,
    x,
    POS: tl.constexpr,
    KIND: tl.constexpr,
    UNPACK: tl.constexpr,
    EPW: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """Element position POS of every word against x's elements of that position ([BM, SW])."""
    HALF: tl.constexpr = EPW // 2  # magic: positions HALF.. come from the high half
    sh = (POS - (POS // HALF) * HALF * UNPACK) * (32 // EPW)  # a constexpr
    if UNPACK == 1 and POS >= HALF:
        w = _widen(high, sh, KIND, UNPACK)  # [BN, SW] fp32
    else:
        w = _widen(words, sh, KIND, UNPACK)
    xf = x.to(tl.float32)
    if KIND == 1:
        if USE_DOT:
            xsum += tl.sum(xf, axis=1)
        else:
            xsum += xf
    if USE_DOT:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    else:
        acc += w * xf
    return acc, xsum


@triton.jit
def _word_tile(
    q_ptrs,
    x_ptrs,  # [BM, SW] x of element 0 of each word (stride EPW)
    xc_ptrs,  # [BM, SW * EPW] contiguous x of the sub-tile
    K,
    X_SPLIT: tl.constexpr,
    KIND: tl.constexpr,
    UNPACK: tl.constexpr,
    EPW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SW: tl.constexpr,
    USE_DOT: tl.constexpr,
    SILU_MUL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """int4 / int8 words widened in fp32 (the magic unpack or Triton's conversions). x is
    loaded once, contiguously (vector loads), and split in registers into its EPW element
    positions (``tl.split`` of a [BM, SW, 2, 2(, 2)] view), each [BM, SW]."""
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    else:  # one row: products and x sums stay per word position (no reduction per group)
        acc = tl.zeros((BLOCK_N, SW), dtype=tl.float32)
        xsum = tl.zeros((1, SW), dtype=tl.float32)
    words = tl.load(q_ptrs, eviction_policy="evict_first")  # [BN, SW] int32
    if KIND == 0 and UNPACK == 1:
        words = words ^ -2139062144  # BIAS8: each byte becomes q + 128
    high = words >> 16
    if not X_SPLIT:  # each position's x loaded on its own, stride EPW
        for i in tl.static_range(EPW):
            x = _load_x(x_ptrs + i, K, SILU_MUL, LIBDEVICE, USE_DOT)  # [BM, SW]
            acc, xsum = _word_step(acc, xsum, words, high, x, i, KIND, UNPACK, EPW, USE_DOT)
    elif EPW == 8:
        xt = _load_x(
            xc_ptrs, K, SILU_MUL, LIBDEVICE, USE_DOT
        )  # [BM, SW * EPW]  # element i = 4a + 2b + c of a word: split c, then b, then a
        xe, xo = tl.split(tl.reshape(xt, (BLOCK_M, SW, 2, 2, 2)))
        xe0, xe1 = tl.split(xe)
        xo0, xo1 = tl.split(xo)
        p0, p4 = tl.split(xe0)
        p2, p6 = tl.split(xe1)
        p1, p5 = tl.split(xo0)
        p3, p7 = tl.split(xo1)
        acc, xsum = _word_step(acc, xsum, words, high, p0, 0, KIND, UNPACK, EPW, USE_DOT)
        acc, xsum = _word_step(acc, xsum, words, high, p1, 1, KIND, UNPACK, EPW, USE_DOT)
        acc, xsum = _word_step(acc, xsum, words, high, p2, 2, KIND, UNPACK, EPW, USE_DOT)
        acc, xsum = _word_step(acc, xsum, words, high, p3, 3, KIND, UNPACK, EPW, USE_DOT)
        acc, xsum = _word_step(acc, xsum, words, high, p4, 4, KIND, UNPACK, EPW, USE_DOT)
        acc, xsum = _word_step(acc, xsum, words, high, p5, 5, KIND, UNPACK, EPW, USE_DOT)
        acc, xsum = _word_step(acc, xsum, words, high, p6, 6, KIND, UNPACK, EPW, USE_DOT)
        acc, xsum = _word_step(acc, xsum, words, high, p7, 7, KIND, UNPACK, EPW, USE_DOT)
    else:  # element i = 2b + c
        xt = _load_x(xc_ptrs, K, SILU_MUL, LIBDEVICE, USE_DOT)  # [BM, SW * EPW]
        xe, xo = tl.split(tl.reshape(xt, (BLOCK_M, SW, 2, 2)))
        p0, p2 = tl.split(xe)
        p1, p3 = tl.split(xo)
        acc, xsum = _word_step(acc, xsum, words, high, p0, 0, KIND, UNPACK, EPW, USE_DOT)
        acc, xsum = _word_step(acc, xsum, words, high, p1, 1, KIND, UNPACK, EPW, USE_DOT)
        acc, xsum = _word_step(acc, xsum, words, high, p2, 2, KIND, UNPACK, EPW, USE_DOT)
        acc, xsum = _word_step(acc, xsum, words, high, p3, 3, KIND, UNPACK, EPW, USE_DOT)
    return acc, xsum


@triton.jit(do_not_specialize=["M"])
def _quant_gemv_kernel(
    x_ptr,  # [M, K] ([M, 2K] gate | up with SILU_MUL), rows contiguous
    q_ptr,  # int32 words [N, K // EPW] (int4, int8) or fp8 [N, K]
    s_ptr,  # [N, K // GROUP] (ROW_SCALE: [N], or [1] if SCALAR_SCALE)
    o_ptr,  # [N, K // GROUP] (int4 only)
    bias_ptr,
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_qn,  # in words (fp8: elements)
    stride_s,
    stride_om,
    KIND: tl.constexpr,
    UNPACK: tl.constexpr,
    X_SPLIT: tl.constexpr,  # x loaded contiguously and split into positions in registers
    EPW: tl.constexpr,  # elements per word (fp8: 1, elements are loaded as they are)
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
    SUB_K: tl.constexpr = BLOCK_K if (ROW_SCALE or BLOCK_K <= GROUP) else GROUP
    NSUB: tl.constexpr = BLOCK_K // SUB_K
    SW: tl.constexpr = SUB_K // EPW  # words (fp8: elements) per row per sub-tile
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: padding re-reads row N - 1
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    offs_w = tl.arange(0, SW)
    q_base = q_ptr + rows_n[:, None] * stride_qn + offs_w[None, :]  # [BN, SW]
    x_rows = x_ptr + rows_m[:, None] * stride_xm  # [BM, 1]
    x_base = x_rows + offs_w[None, :] * EPW  # [BM, SW]: element 0 of each word
    xc_base = x_rows + tl.arange(0, SW * EPW)[None, :]  # [BM, SUB_K]: the sub-tile
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:  # one row: [BN, SW] products, reduced over K once after the loop
        acc = tl.zeros((BLOCK_N, SW), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        for j in tl.static_range(NSUB):
            k = k0 + j * SUB_K
            part, xsum = _sub_tile(
                q_base + k // EPW, x_base + k, xc_base + k, K, X_SPLIT, KIND, UNPACK, EPW,
                BLOCK_M, BLOCK_N, SW, USE_DOT, SILU_MUL, LIBDEVICE,
            )  # fmt: skip
            if ROW_SCALE:
                acc += part
            else:
                col = k // GROUP
                s = tl.load(s_ptr + rows_n * stride_s + col).to(tl.float32)  # [BN]
                if KIND == 1:
                    o = tl.load(o_ptr + rows_n * stride_s + col).to(tl.float32)  # [BN]
                if USE_DOT:  # part [BM, BN], xsum [BM]
                    acc += part * s[None, :]
                    if KIND == 1:
                        acc += xsum[:, None] * o[None, :]
                else:  # part [BN, SW], xsum [1, SW]: scaled per word position
                    acc += part * s[:, None]
                    if KIND == 1:
                        acc += o[:, None] * xsum
    if USE_DOT:
        result = acc
    else:
        result = tl.sum(acc, axis=1)[None, :]  # [1, BN]
    _scale_bias_store(
        result, s_ptr, bias_ptr, out_ptr, rows_n, offs_m, offs_n, M, N, stride_om,
        ROW_SCALE, SCALAR_SCALE, HAS_BIAS,
    )  # fmt: skip


class _Layout(NamedTuple):
    group: int
    row_scale: bool
    scalar_scale: bool
    stride_s: int


def _layout(kind: str, scales: torch.Tensor, k: int) -> _Layout:
    if kind == "fp8" or scales.dim() == 1:  # group 0: unused (one compiled kernel for all K)
        return _Layout(0, True, scales.numel() == 1, 1)
    num_groups = scales.shape[1]
    if k % num_groups:
        raise ValueError(f"quant_gemv: {num_groups} scale groups do not divide K = {k}")
    if kind == "int8" and num_groups == 1:
        return _Layout(0, True, False, scales.stride(0))
    return _Layout(k // num_groups, False, False, scales.stride(0))


def _words(kind: str, qweight: torch.Tensor) -> torch.Tensor | None:
    """The weight as the kernel reads it: int32 words (int4, int8) or fp8 elements; None when
    the rows are not 4-byte aligned."""
    if kind == "fp8":
        return qweight if qweight.stride(1) == 1 else None
    if qweight.stride(1) != 1 or qweight.shape[1] % 4 or qweight.stride(0) % 4:
        return None
    if qweight.storage_offset() % 4 or qweight.data_ptr() % 4:
        return None
    return qweight.view(torch.int32)


def _resolve(
    kind: str, m: int, k: int, lay: _Layout, cfg: QuantGemvConfig, x_dtype: torch.dtype
) -> tuple[int, bool] | None:
    """(BLOCK_K, use_dot) for this config, or None if it cannot run: BLOCK_K is halved until
    it divides K and is a multiple or divisor of the group; tensor cores need 16 words a
    sub-tile (fp8: 16 elements)."""
    epw = 1 if kind == "fp8" else ELEMS_PER_WORD[kind]
    bk = cfg.block_k
    while bk > epw * 4 and (k % bk or (not lay.row_scale and lay.group % bk and bk % lay.group)):
        bk //= 2
    if k % bk or (not lay.row_scale and lay.group % bk and bk % lay.group) or bk < 4 * epw:
        return None
    pairs = kind == "int4" and cfg.unpack == 2  # tensor cores at every M (16-bit pairs)
    if pairs and x_dtype not in (torch.bfloat16, torch.float16):
        return None
    use_dot = (m > 1 or pairs) and x_dtype != torch.float32
    sub_k = bk if (lay.row_scale or bk <= lay.group) else lay.group
    if use_dot and sub_k // epw < 16:
        return None
    if m > 1 and not use_dot:
        return None  # fp32 x with several rows: the generic kernel's CUDA-core path
    return bk, use_dot


def supports(
    kind: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, silu_mul: bool = False
) -> bool:
    """Whether ``quant_gemv`` can run this GEMM with its picked config."""
    m = x.shape[0]
    k = qweight.shape[1] * (2 if kind == "int4" else 1)
    if not 1 <= m <= MAX_ROWS or _words(kind, qweight) is None or x.stride(1) != 1:
        return False
    if x.shape[1] != (2 * k if silu_mul else k):
        return False
    try:
        lay = _layout(kind, scales, k)
    except ValueError:
        return False
    cfg = pick_config(kind, m, qweight.shape[0], k, x.device)
    return _resolve(kind, m, k, lay, cfg, x.dtype) is not None


def quant_gemv(
    kind: str,
    x: torch.Tensor,  # [M, K] ([M, 2K] with silu_mul), M <= 16, rows contiguous
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    config: QuantGemvConfig | None = None,
    warmup: bool = False,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ dequantize(W)^T (+ bias)`` in one launch (see the module doc). ``config``
    overrides the picked one (sweeps); a config or weight the kernel cannot take raises
    ValueError (``supports`` checks first). ``warmup`` compiles without launching."""
    check_device(x, qweight)
    m, n = x.shape[0], qweight.shape[0]
    k = qweight.shape[1] * (2 if kind == "int4" else 1)
    if x.shape[1] != (2 * k if silu_mul else k) or x.stride(1) != 1:
        raise ValueError(f"quant_gemv: x {tuple(x.shape)} does not match weight [{n}, {k}]")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"quant_gemv: M = {m} rows; it takes 1 to {MAX_ROWS}")
    if kind == "int4" and offsets is None:
        raise ValueError("quant_gemv: int4 needs offsets")
    words = _words(kind, qweight)
    if words is None:
        raise ValueError(f"quant_gemv: {kind} weight rows are not 4-byte aligned")
    lay = _layout(kind, scales, k)
    cfg = config or pick_config(kind, m, n, k, x.device)
    resolved = _resolve(kind, m, k, lay, cfg, x.dtype)
    if resolved is None:
        raise ValueError(f"quant_gemv: config {tuple(cfg)} cannot run {kind} [{n}, {k}], M={m}")
    bk, use_dot = resolved
    epw = 1 if kind == "fp8" else ELEMS_PER_WORD[kind]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = cfg.block_m or (m_bucket(m) if m <= 16 else 64)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))
    launch = _quant_gemv_kernel.warmup if warmup else _quant_gemv_kernel[grid]
    extra = {"grid": grid} if warmup else {}
    launch(
        x, words, scales, offsets if offsets is not None else scales,
        bias if bias is not None else scales, out, m, n, k,
        x.stride(0), words.stride(0), lay.stride_s, out.stride(0),
        KIND=_KINDS[kind], UNPACK=cfg.unpack, X_SPLIT=cfg.x_split, EPW=epw, GROUP=lay.group,
        ROW_SCALE=lay.row_scale, SCALAR_SCALE=lay.scalar_scale, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, NUM_STAGES=cfg.num_stages,
        USE_DOT=use_dot, SILU_MUL=silu_mul, LIBDEVICE=silu_mul and not is_interpret(),
        num_warps=cfg.num_warps, **extra,
    )  # fmt: skip
    return out
