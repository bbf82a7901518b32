"""The register-level pieces of ``kernels.int4_gemv``: each layout's weight tile turned into a
16-bit MMA operand (int4 / int8 nibble planes by one ``lop3`` per word and nibble pair; fp8 e4m3
by byte permutes and one paired multiply; int8 bytes by two ``lop3`` and one paired FMA; the x
tile of canonical int4 words permuted), the prologues' x tiles (RMSNorm, SiLU-and-mul), one
tile's group-wise accumulation (``_tile``), and the epilogues (bias, residual, the gate | up
SiLU)."""

from __future__ import annotations

import triton
import triton.language as tl

from roofline.kernels.gemv import _first, _silu_mul


@triton.constexpr_function
def _e4m3_asm(bf16):
    """PTX: e4m3 bytes 0, 1 of ``$2`` -> the 16-bit pair ``$0``, bytes 2, 3 -> ``$1``. bf16: shift
    4, fields 0x07F0, times 2^120 (0x7B80); fp16: shift 1, fields 0x3F80, times 2^8 (0x5C00)."""
    sh, mask, scale, kind = (
        ("4", "0x07F007F0", "0x7B807B80", "bf16x2")
        if bf16
        else ("1", "0x3F803F80", "0x5C005C00", "f16x2")
    )
    return (
        "{ .reg .b32 a<2>, b<2>, c; mov.b32 c, " + scale + "; "
        "prmt.b32 a0, 0, $2, 0x5140; prmt.b32 a1, 0, $2, 0x7362; "
        "shr.b32 b0, a0, " + sh + "; shr.b32 b1, a1, " + sh + "; "
        "and.b32 b0, b0, " + mask + "; and.b32 b1, b1, " + mask + "; "
        "lop3.b32 b0, b0, 0x80008000, a0, 0xf8; lop3.b32 b1, b1, 0x80008000, a1, 0xf8; "
        "mul.rn." + kind + " $0, b0, c; mul.rn." + kind + " $1, b1, c; }"
    )


@triton.constexpr_function
def _int8_asm(bf16):
    """PTX: int8 bytes 0, 1 of ``$2`` -> the 16-bit pair ``$0``, bytes 2, 3 -> ``$1``, exactly.
    bf16 (7 mantissa bits): each byte to the bottom of a lane, ``128 + (q & 127)`` and ``128`` or
    ``256`` (the sign bit) by one lop3 each, their difference by one paired FMA. fp16: one lop3
    leaves ``1024 + (q + 128)`` (the sign bit flipped), one paired FMA subtracts 1152."""
    if bf16:
        lanes = (
            "lop3.b32 p0, a0, 0x007F007F, 0x43004300, 0xEA; "
            "lop3.b32 p1, a1, 0x007F007F, 0x43004300, 0xEA; "
            "lop3.b32 t0, a0, 0x00800080, 0x43004300, 0xEA; "
            "lop3.b32 t1, a1, 0x00800080, 0x43004300, 0xEA; "
            "mov.b32 c, 0xBF80BF80; "  # -1.0
            "fma.rn.bf16x2 $0, t0, c, p0; fma.rn.bf16x2 $1, t1, c, p1; }"
        )
    else:
        lanes = (
            "lop3.b32 p0, a0, 0x00FF00FF, 0x64806480, 0x6A; "  # mask ? (a ^ c) : c
            "lop3.b32 p1, a1, 0x00FF00FF, 0x64806480, 0x6A; "
            "mov.b32 c, 0x3C003C00; mov.b32 t0, 0xE480E480; "  # 1.0, -1152.0
            "fma.rn.f16x2 $0, p0, c, t0; fma.rn.f16x2 $1, p1, c, t0; }"
        )
    return (
        "{ .reg .b32 a<2>, p<2>, t<2>, c; "
        "prmt.b32 a0, $2, 0, 0x4140; prmt.b32 a1, $2, 0, 0x4342; " + lanes
    )


@triton.jit
def _halves(words, SH: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr, DTYPE: tl.constexpr):
    """Nibbles SH/4 (low half) and SH/4 + 4 (high half) of every word as 16-bit floats
    ``B + q``: two ``[rows, words]`` tensors."""
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
    return lo, hi


@triton.jit
def _pair(words, SH: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr, DTYPE: tl.constexpr):
    """Nibbles SH/4 and SH/4 + 4 of every word as two 16-bit floats ``B + q``, laid out as the
    ``[rows, 2 * words]`` operand (element ``2 w`` = low half of word w)."""
    lo, hi = _halves(words, SH, MAGIC, ASM, DTYPE)
    return tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))


@triton.jit
def _quads(e0, e1, e2, e3):
    """Four ``[rows, W]`` tensors holding elements ``4 w + i`` -> ``[rows, 4 W]`` in order."""
    tile = tl.join(tl.join(e0, e2), tl.join(e1, e3))  # [rows, W, pair, half]: 4 w + 2 p + h
    return tl.reshape(tile, (e0.shape[0], 4 * e0.shape[1]))


@triton.jit
def _canonical_int4(words, MAGIC: tl.constexpr, ASM: tl.constexpr, DTYPE: tl.constexpr):
    """Canonical int4 words (element ``8 w + n`` in nibble n of word w) -> the ``[rows, 8 W]``
    operand ``B + q`` in natural order: the lop3 of nibble pairs (n, n + 4), then the halves
    interleaved in registers (no repacked copy)."""
    e0, e4 = _halves(words, 0, MAGIC, ASM, DTYPE)
    e1, e5 = _halves(words, 4, MAGIC, ASM, DTYPE)
    e2, e6 = _halves(words, 8, MAGIC, ASM, DTYPE)
    e3, e7 = _halves(words, 12, MAGIC, ASM, DTYPE)
    even = tl.join(tl.join(e0, e4), tl.join(e2, e6))  # [rows, W, h, a]: 8 w + 4 h + 2 a
    odd = tl.join(tl.join(e1, e5), tl.join(e3, e7))  # + 1
    tile = tl.join(even, odd)  # [rows, W, h, a, b]: element 8 w + 4 h + 2 a + b
    return tl.reshape(tile, (words.shape[0], 8 * words.shape[1]))


@triton.jit
def _canon4_x(xt):
    """An x tile ``[128, C]`` in the K order of canonical int4 words read as repacked ones:
    ``_operand``'s column ``32 n + 2 w + h`` of canonical words is element ``8 w + 4 h + n``
    (word w, nibble ``4 h + n``), so x's row ``8 w + 4 h + n`` moves to row ``32 n + 2 w + h``
    (the dot over the tile is the same sum in another order)."""
    x4 = tl.reshape(xt, (16, 2, 4, xt.shape[1]))  # [w, h, n, C]
    return tl.reshape(tl.permute(x4, (2, 0, 1, 3)), (128, xt.shape[1]))  # [n, w, h, C]


@triton.jit
def _canonical_int8(words, MAGIC: tl.constexpr, MAGIC_HI: tl.constexpr, ASM: tl.constexpr,
                    DTYPE: tl.constexpr):  # fmt: skip
    """Canonical int8 words (element ``4 w + b`` in byte b) -> the low and high nibble planes of
    ``u = q + 128`` as two ``[rows, 4 W]`` operands in natural order (``B + lo``,
    ``16 (B' + hi)``): nibble pairs (0, 4) and (2, 6) are bytes (0, 2), (1, 3)."""
    u = words ^ -2139062144  # 0x80808080: each byte q + 128
    l0, l2 = _halves(u, 0, MAGIC, ASM, DTYPE)  # low nibbles of bytes 0 and 2
    h0, h2 = _halves(u, 4, MAGIC_HI, ASM, DTYPE)
    l1, l3 = _halves(u, 8, MAGIC, ASM, DTYPE)
    h1, h3 = _halves(u, 12, MAGIC_HI, ASM, DTYPE)
    return _quads(l0, l1, l2, l3), _quads(h0, h1, h2, h3)


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
def _fp8_operand(words, DTYPE: tl.constexpr, ASM: tl.constexpr, INT8: tl.constexpr):
    """A row tile of e4m3 (INT8: int8) bytes read as ``[rows, 32]`` int32 words (element
    ``4 w + b`` in byte b of word w) -> the ``[rows, 128]`` operand in x's dtype, exactly.
    Compiled, e4m3: each byte moves to the top of a 16-bit lane, its exponent and mantissa shift
    into the 16-bit type's fields (sign kept) and one paired multiply rebiases the exponent (bf16
    by 2^120, fp16 by 2^8; subnormals and zeros included), about 2.5 instructions an element, no
    conversion unit; int8 (``_int8_asm``): about 2 an element (bf16), 1.5 (fp16)."""
    if ASM:
        pairs = tl.inline_asm_elementwise(
            _int8_asm(DTYPE == tl.bfloat16) if INT8 else _e4m3_asm(DTYPE == tl.bfloat16),
            "=r,=r,r", [words], dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
        e0 = pairs[0].to(tl.int16).to(DTYPE, bitcast=True)  # elements 4w, 4w + 1
        e1 = (pairs[0] >> 16).to(tl.int16).to(DTYPE, bitcast=True)
        e2 = pairs[1].to(tl.int16).to(DTYPE, bitcast=True)  # elements 4w + 2, 4w + 3
        e3 = (pairs[1] >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    elif INT8:  # the interpreter: each byte sign-extended
        e0 = _int8_value(words).to(DTYPE)
        e1 = _int8_value(words >> 8).to(DTYPE)
        e2 = _int8_value(words >> 16).to(DTYPE)
        e3 = _int8_value(words >> 24).to(DTYPE)
    else:  # the interpreter: decode each byte arithmetically (exact in fp32)
        e0 = _e4m3_value(words).to(DTYPE)
        e1 = _e4m3_value(words >> 8).to(DTYPE)
        e2 = _e4m3_value(words >> 16).to(DTYPE)
        e3 = _e4m3_value(words >> 24).to(DTYPE)
    tile = tl.join(tl.join(e0, e2), tl.join(e1, e3))  # [rows, 32, pair, half]: 4 w + 2 p + h
    return tl.reshape(tile, (words.shape[0], 4 * words.shape[1]))


@triton.jit
def _int8_value(byte):
    """The int8 value of the low byte of each int32 as fp32."""
    b = byte & 0xFF
    return (b - ((b & 0x80) << 1)).to(tl.float32)


@triton.jit
def _e4m3_value(byte):
    """The e4m3 value of the low byte of each int32 as fp32 (finite values)."""
    e = (byte >> 3) & 0xF
    m = (byte & 0x7).to(tl.float32)
    mag = tl.where(
        e == 0, m * 0.125 * 0.015625, (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32))
    )
    return tl.where((byte & 0x80) != 0, -mag, mag)


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
def _scale_pair(ptrs, SCALES: tl.constexpr):
    """The (scale, offset) pairs at ``ptrs`` as fp32: one 32-bit load for 16-bit pairs
    (SCALES 1); SCALES 2: the scale alone, offset ``-8 s`` (symmetric int4)."""
    if SCALES == 2:
        s = tl.load(ptrs).to(tl.float32)
        o = -8.0 * s
    elif SCALES == 1:
        v = tl.load(ptrs.to(tl.pointer_type(tl.int32)))  # [BN]: scale low, offset high
        S_DTYPE: tl.constexpr = ptrs.dtype.element_ty
        s = v.to(tl.int16).to(S_DTYPE, bitcast=True).to(tl.float32)
        o = (v >> 16).to(tl.int16).to(S_DTYPE, bitcast=True).to(tl.float32)
    else:
        s = tl.load(ptrs).to(tl.float32)
        o = tl.load(ptrs + 1).to(tl.float32)
    return s, o


@triton.jit
def _tile(acc, words, words_hi, kt, x_ptrs, nw_ptrs, so_ptrs, k_row, rstd, ones, K,
          BITS: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, GK: tl.constexpr,
          PAIRS: tl.constexpr, BASE: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr,
          ASM: tl.constexpr, SCALES: tl.constexpr, CANON: tl.constexpr,
          INT8: tl.constexpr, XPERM: tl.constexpr):  # fmt: skip
    """``acc`` plus one 128-element tile at ``kt`` of every K-slice: its weight ``words`` (int8:
    and ``words_hi``; FP8: e4m3 bytes, or int8 bytes with INT8; CANON: the canonical int4 /
    int8 bytes) against the matching x tile, group by group."""
    DTYPE: tl.constexpr = ones.dtype
    # low nibbles: B + q (bf16 128, fp16 1024); int8's high nibbles: 16 (B' + q), B' = 128 / 1024
    MAGIC: tl.constexpr = 0x64006400 if DTYPE == tl.float16 else 0x43004300
    MAGIC_HI: tl.constexpr = 0x74007400 if DTYPE == tl.float16 else 0x45004500
    for j in tl.static_range(128 // GK):
        kg = kt + GK * j
        if SILU_MUL:
            xt = _silu_mul(tl.load(x_ptrs + kg), tl.load(x_ptrs + kg + K), ASM, True)
            xt1 = xt
        elif NORM:
            xt = _norm_tile(tl.load(x_ptrs + kg), tl.load(nw_ptrs + kg), rstd, ASM)
            xt1 = xt
        elif FP8:  # no offsets: no sum of x
            xt = tl.load(x_ptrs + kg)
            xt1 = xt
        else:  # two loads of the same tile (one per dot's operand layout): both are pipelined
            # by cp.async, where one tile feeding both dots would not be
            xt = tl.load(x_ptrs + kg)  # [GK, C]
            xt1 = tl.load(x_ptrs + kg, eviction_policy="evict_last")
        if FP8:  # [BN, 32] words of e4m3 / int8 bytes: sum q x; the row's scale comes at the end
            acc = tl.dot(_fp8_operand(words, DTYPE, ASM, INT8), xt, acc)
        else:
            if CANON and BITS == 4 and XPERM:  # canonical words, x permuted (GK == 128)
                a = _operand(words, 4, 0, MAGIC, ASM, DTYPE)  # column 32 n + 2 w + h
                d = tl.dot(a, _canon4_x(xt))
            elif CANON and BITS == 4:  # canonical words (GK == 128)
                d = tl.dot(_canonical_int4(words, MAGIC, ASM, DTYPE), xt)
            elif CANON:
                a, a_hi = _canonical_int8(words, MAGIC, MAGIC_HI, ASM, DTYPE)
                d = tl.dot(a_hi, xt, tl.dot(a, xt))
            else:
                a = _operand(words, PAIRS, PAIRS * j, MAGIC, ASM, DTYPE)  # [BN, GK]
                d = tl.dot(a, xt)  # [BN, C]: sum (BASE + q) x over the group (or tile)
                if BITS == 8:
                    a_hi = _operand(words_hi, PAIRS, PAIRS * j, MAGIC_HI, ASM, DTYPE)
                    d = tl.dot(a_hi, xt, d)
            xs = tl.dot(ones, xt1)  # [BN, C]: sum x, in the same layout
            STEP: tl.constexpr = 1 if SCALES == 2 else 2  # a group's entries per row
            if GROUP <= 128:
                s, o = _scale_pair(so_ptrs + STEP * (kg // GROUP), SCALES)  # [BN] fp32 each
            else:  # a slice may start inside a group; a 128-tile never straddles one
                s, o = _scale_pair(so_ptrs + STEP * ((k_row + kg) // GROUP), SCALES)
            acc += d * s[:, None] + xs * (o - BASE * s)[:, None]
    return acc


@triton.jit
def _gate_up_rows(i, pid, N, HALF: tl.constexpr):
    """Weight rows of slots ``i`` (< 2 HALF) of program ``pid`` over a gate | up weight of N
    rows: gate rows ``pid * HALF ..`` then the same up rows (``N // 2`` further)."""
    n_half = N // 2
    return ((i // HALF) * n_half + tl.minimum(pid * HALF + i % HALF, n_half - 1)).to(tl.int64)


@triton.jit
def _epilogue(res, bias_ptr, out_ptr, residual_ptr, offs_n, real_n, pid, offs_m, M, N, stride_om,
              stride_rm, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, SILU_OUT: tl.constexpr,
              ROWS: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """``_finish``, or with SILU_OUT: the bias, gate and up rounded as the GEMV's output, then
    ``silu(gate) * up`` as ``silu_and_mul`` rounds it, stored as ``[M, N // 2]``."""
    if SILU_OUT:
        HALF: tl.constexpr = ROWS // 2
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            res += tl.load(bias_ptr + real_n).to(tl.float32)[:, None]
        res = res.to(dtype)
        gate, up = tl.split(tl.permute(tl.reshape(res, (2, HALF, res.shape[1])), (1, 2, 0)))
        act = _silu_mul(gate, up, ASM, False)  # [HALF, BM]
        offs_a = pid * HALF + tl.arange(0, HALF)
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_a[:, None]
        tl.store(out_ptrs, act, mask=(offs_m[None, :] < M) & (offs_a[:, None] < N // 2))
    else:
        _finish(res, bias_ptr, out_ptr, residual_ptr, offs_n, offs_m, M, N, stride_om, stride_rm,
                HAS_BIAS, RESIDUAL)  # fmt: skip


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
