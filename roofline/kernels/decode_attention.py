"""Paged decode attention: one query token per request, split-K over the context (flash-decoding).

Decode is memory-bound: the whole cost is reading each request's K/V pages once. The first
kernel runs one program per (request, kv_head, split); it loads the query rows of *all* query
heads that share that KV head (GQA group, padded to 16 rows so ``tl.dot`` can use tensor cores),
walks its slice of the context through the block table, and keeps an online softmax. With one
split it writes the final output directly; otherwise it writes a partial output normalised by
its own softmax sum plus the split's log-sum-exp (base 2), and a second small kernel merges the
splits. The number of splits grows until the grid covers the GPU (``choose_num_splits``).

The grid is fixed on the host (a CUDA graph fixes it at capture, for ``max_seq_len =
max_model_len``). With ``DEVICE_SPLIT`` each request's split length comes from its own context
on the device instead (``min(num_splits, cdiv(context, MIN_TOKENS_PER_SPLIT))`` splits of equal
length, a multiple of BLOCK_N; programs past them write an empty partial): otherwise a graph
captured for a 131,072-token ``max_model_len`` gives each split 2,048 tokens, so a short context
ran in one program per KV head (8B batch 1: 6.15 ms a step against 5.71 at 8,448, 5.69 with
``DEVICE_SPLIT``).

KV layout (see ``roofline/attention/metadata.py``): ``k_cache, v_cache: [num_pages, page_size,
num_kv_heads, head_dim]``; token ``t`` of request ``r`` lives in page ``block_table[r, t //
page_size]`` at row ``t % page_size``. Query head ``h`` reads KV head ``h // (num_heads //
num_kv_heads)`` (HF ``repeat_kv`` order).

Quantized pages (fp8 e4m3 / int8, ``roofline/quantization/kv_cache.py``) come with ``k_scale,
v_scale: [num_pages, page_size, num_kv_heads]`` fp32: K's per-token scale multiplies the score
columns after ``q @ k^T`` and V's the probability columns before ``p @ v``; the softmax sum uses
the unscaled probabilities. With ``KV_F16`` (16-bit q, the default) the tiles are widened to
fp16, which holds every e4m3 and int8 value exactly (one ``cvt`` per two fp8 values; int8 by
``I8_TO_F16_PTX``), in the layout they were loaded in (``_widen_f16``), and both products run in
fp16 with fp32 sums: q is rounded to fp16 (clamped to its range), and the probabilities, which
must stay in fp16's range, take V's scales divided by the largest of their tile (the largest
multiplies the product). Through fp32 to bf16 instead (``ROOFLINE_KV_F16=0``), Triton widened
single bytes in the MMA operand's layout: twice the instructions a key and 228 registers, so
the kernel read 1-byte pages at about the bf16 pages' key rate, half their bytes per second
(H100, batch 32 x 8,192: 445 us against 334 with ``KV_F16``; ``scripts/gpu_kvf16.py``). The
fp16 products are also closer to the reference over the same pages (max error 2.2e-3 of the
largest output against 4.3e-3).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret, num_sms
from roofline.kernels.gemv import _first
from roofline.kernels.pdl import pdl_enabled
from roofline.quantization.kv_cache import dequantize

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 128
MAX_NUM_SPLITS = 64
# Programs per SM to aim for when splitting (H200, B=1 x 128k: 2 -> 4 took 3.5 to 4.1 TB/s).
SPLIT_TARGET_WAVES = 4
DEVICE_SPLIT = os.environ.get("ROOFLINE_DECODE_DEVICE_SPLIT", "1") == "1"
"""Split lengths from each request's context on the device (module docstring). H100, 8B
(``scripts/gpu_splitdev.py``, 2026-11-24): batch 1 at ``max_model_len`` 131,072 6.15 -> 5.69 ms
a step (at a 4k context 7.35 -> 5.82), and no slower at 8,448 (5.71 -> 5.66; batch 8 6.70 ->
6.37)."""


def set_device_split(enabled: bool) -> None:
    """Turn the device-side split length on or off for launches from now on (benchmarks)."""
    global DEVICE_SPLIT
    DEVICE_SPLIT = enabled


def decode_attention_ref(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_pages, page_size, num_kv_heads] fp32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    """Plain-torch paged decode attention, one request at a time, in fp32 (a quantized cache
    is dequantized first)."""
    if k_scale is not None:
        k_cache, v_cache = (
            dequantize(k_cache, k_scale, q.dtype),
            dequantize(v_cache, v_scale, q.dtype),
        )
    num_reqs, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        num_blocks = (seq_len + page_size - 1) // page_size
        pages = block_table[i, :num_blocks].long()  # [num_blocks]
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # [S, Hk, D]
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # [S, Hk, D]
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)  # [S, H, D]
        scores = torch.einsum("hd,shd->hs", q[i].float(), k) * scale  # [H, S]
        probs = torch.softmax(scores, dim=-1)  # [H, S]
        out[i] = torch.einsum("hs,shd->hd", probs, v).to(q.dtype)  # [H, D]
    return out


KV_F16 = os.environ.get("ROOFLINE_KV_F16", "1") != "0"
"""1-byte pages (fp8 e4m3, int8) widened to fp16, not through fp32 to q's dtype (module
docstring); ``ROOFLINE_KV_F16=0``: the previous path."""
KV_ANCHOR = True
"""Widen 1-byte pages in the layout they were loaded in (``_widen_f16``; False for sweeps)."""
QUANT_CONFIG: tuple[int, int, int] | None = None
"""(BLOCK_N, num_warps, num_stages) of the split kernel over 1-byte pages widened to fp16
(sweeps); None: ``_pick_quant_config``'s."""


def _pick_quant_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel over 1-byte pages widened to fp16
    (``KV_F16``, 16-bit q). H100, Llama-3.1-8B heads (``scripts/gpu_kvf16.py``): at batch 32 x
    8,192 (128, 4, 2) 333 us against 410-560 for 64-key tiles, 256-key tiles or 8 warps, and 445
    for the previous path (which keeps ``_pick_config``'s (64, 4, 3))."""
    return (128 if head_dim <= 128 else 64), 4, 2


def _pick_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N keys per iteration, num_warps, num_stages) of the split kernel.

    Measured on H200 (bf16, head_dim 128, batch 64 x 4096): 64/4/3 at 4.35 TB/s; 32 keys or 8
    warps were 10-25% slower.
    """
    return (64 if head_dim <= 128 else 32), 4, 3


def choose_num_splits(
    num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms_: int, block_n: int
) -> int:
    """Splits of the context per (request, kv_head) so the grid holds ~4 programs per SM.

    No split is shorter than ``MIN_TOKENS_PER_SPLIT`` tokens (a split's fixed cost, the query
    load and the partial write, must stay small against its K/V reads).
    """
    base = num_reqs * num_kv_heads
    if base >= 2 * num_sms_:
        return 1  # already two programs per SM: splitting only adds the merge
    wanted = triton.cdiv(SPLIT_TARGET_WAVES * num_sms_, base)
    useful = triton.cdiv(max_seq_len, max(MIN_TOKENS_PER_SPLIT, block_n))
    return max(1, min(wanted, useful, MAX_NUM_SPLITS))


I8_TO_F16_PTX: tl.constexpr = tl.constexpr(
    """{
    .reg .b32 c, u;
    xor.b32 u, $2, 0x80808080;
    prmt.b32 $0, u, 0x64646464, 0x4140;
    prmt.b32 $1, u, 0x64646464, 0x4342;
    mov.b32 c, 0x64806480;
    sub.rn.f16x2 $0, $0, c;
    sub.rn.f16x2 $1, $1, c;
    }"""
)
"""Four int8 (one 32-bit register, $2) -> four fp16 (two 32-bit registers, $0 and $1), exact:
the bytes' sign bits flipped (``q + 128``, one xor for four), each byte goes under the exponent
of fp16 1024 (one byte permute per pair), and an fp16x2 subtract of 1152 leaves ``q`` (``cvt``
from s8 costs an I2F a value)."""


@triton.jit
def _widen_f16(x, ANCHOR: tl.constexpr, I8_ASM: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] tile of 1-byte K or V -> fp16 (``I8_ASM``: int8 through
    ``I8_TO_F16_PTX``). ``ANCHOR``: in the layout it was loaded in, so that the conversion to
    the MMA operand's layout moves 16-bit values (ldmatrix) instead of single bytes: a reduction
    over an axis of one element (the identity) stops the compiler's layout propagation, which
    would otherwise convert the bytes first."""
    if I8_ASM:
        y = tl.inline_asm_elementwise(
            I8_TO_F16_PTX, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4
        )
    else:
        y = x.to(tl.float16)
    if ANCHOR:
        y = tl.reduce(tl.reshape(y, (y.shape[0], 1, y.shape[1])), 1, _first)
    return y


@triton.jit
def _q_f16(q):
    """q for fp16 products with 1-byte pages: rounded to fp16, clamped to its range."""
    return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _dequant_rows(x, scale_ptrs, n_mask, dtype: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] tile of 1-byte K or V rows dequantized in the layout it was loaded
    in: ``value x scale`` rounded to ``dtype``, what ``kv_cache.dequantize`` (and so every
    reference) computes; one scale loaded per row."""
    s = tl.load(scale_ptrs, mask=n_mask, other=0.0)  # [BLOCK_N]
    return (x.to(tl.float32) * s[:, None]).to(dtype)


def widening(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> tuple:
    """(``KV_F16``, ``KV_I8_ASM``) of a launch over these pages: fp16 widening for 1-byte pages
    under 16-bit queries (``KV_F16`` on), int8 through ``I8_TO_F16_PTX`` on the GPU."""
    f16 = k_scale is not None and KV_F16 and q.dtype != torch.float32
    return f16, f16 and k_cache.dtype == torch.int8 and not is_interpret()


@triton.jit
def _pv_f16(p, v, v_scale_ptrs, n_mask, ANCHOR: tl.constexpr, I8_ASM: tl.constexpr,
            PRECISION: tl.constexpr):  # fmt: skip
    """``p @ (v x scale)`` for a [BLOCK_N, BLOCK_D] tile of 1-byte V rows widened to fp16: the
    rows' scales over the tile's largest go on the probabilities (so they stay in [0, 1], in
    fp16's range), the largest on the product."""
    v_s = tl.load(v_scale_ptrs, mask=n_mask, other=0.0)  # [BLOCK_N]
    v_top = tl.max(v_s, axis=0)
    v_top = tl.where(v_top > 0.0, v_top, 1.0)
    p = p * (v_s / v_top)[None, :]
    v = _widen_f16(v, ANCHOR, I8_ASM)
    return tl.dot(p.to(tl.float16), v, input_precision=PRECISION) * v_top


# Eager decode steps (batches beyond the captured graphs) change these every step: not
# specialized, so they never compile the kernel again in the middle of serving.
@triton.jit(do_not_specialize=["stride_bt", "split_len", "num_splits", "num_slots", "merge_count"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
    ctx_start_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2e,
    stride_sp,
    stride_ss,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    split_len,
    num_splits,
    num_slots,
    merge_count,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    HAS_START: tl.constexpr,
    MERGE_PREFIX: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent: wait, then trigger
    KV_F16: tl.constexpr = False,  # 1-byte pages: fp16 MMAs (``KV_F16``)
    KV_ANCHOR: tl.constexpr = False,  # widened in the load layout (``_widen_f16``)
    KV_I8_ASM: tl.constexpr = False,  # int8 pages widened by ``I8_TO_F16_PTX``
    DEVICE_SPLIT: tl.constexpr = False,  # split_len from this request's context (docstring)
    MIN_SPLIT: tl.constexpr = 128,  # shortest split under DEVICE_SPLIT (tokens)
):
    if PDL:  # q and the step's K/V row come from the previous kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_start = 0
    if HAS_START:  # cascade: this row's context starts after the shared prefix
        ctx_start = tl.load(ctx_start_ptr + req).to(tl.int32)
    if DEVICE_SPLIT:  # as many equal splits as this context needs, at most the grid's
        ctx_len = tl.maximum(seq_len - ctx_start, 0)
        used = tl.maximum(tl.minimum(tl.cdiv(ctx_len, MIN_SPLIT), num_splits), 1)
        split_len = tl.cdiv(tl.cdiv(ctx_len, used), BLOCK_N) * BLOCK_N
    start = ctx_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H] rows = query heads of this group
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h  # [BLOCK_H]
    q_ptrs = q_ptr + req.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    q_mma = q
    if KV_QUANT and KV_F16:  # fp16 products with 1-byte pages
        q_mma = _q_f16(q)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    k_scale_head = k_scale_ptr + kv_head  # scales: head stride 1
    v_scale_head = v_scale_ptr + kv_head
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        n_mask = offs_n < end
        pages = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = offs_n % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_off = pages * stride_kp + rows * stride_ks  # [BLOCK_N] int64
        k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT:  # 1-byte K in registers -> q's dtype; its scale goes on the scores
            s_off = pages * stride_sp + rows * stride_ss  # [BLOCK_N]
            if KV_F16:  # e4m3 / int8 -> fp16 is exact and one conversion (module docstring)
                k = _widen_f16(k, KV_ANCHOR, KV_I8_ASM)
            else:
                k = k.to(tl.float32).to(q.dtype)
        s = tl.dot(q_mma, tl.trans(k), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
        if KV_QUANT:
            s = s * tl.load(k_scale_head + s_off, mask=n_mask, other=0.0)[None, :]
        s = s * scale_log2e
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = pages * stride_vp + rows * stride_vs
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT and KV_F16:
            pv = _pv_f16(p, v, v_scale_head + s_off, n_mask, KV_ANCHOR, KV_I8_ASM, PRECISION)
            acc = acc * alpha[:, None] + pv
        else:
            if KV_QUANT:  # V's scale goes on the probabilities
                p = p * tl.load(v_scale_head + s_off, mask=n_mask, other=0.0)[None, :]
                v = v.to(tl.float32).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [BLOCK_H, BLOCK_D]
    o_mask = h_mask[:, None] & d_mask[None, :]
    if MERGE_PREFIX:  # cascade, one suffix split: merge the prefix's partials (slots
        # 0 .. merge_count - 1) with this result by log-sum-exp, then store the output. One
        # pass (running max): each slot's lse and output are loaded together, one round trip.
        row0 = (req.to(tl.int64) * NUM_HEADS + heads) * num_slots  # [BLOCK_H]
        m = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # [BLOCK_H]
        den = tl.where(m == float("-inf"), 0.0, 1.0)  # weights relative to 2^m
        num = o * den[:, None]  # [BLOCK_H, BLOCK_D]
        for j in range(merge_count):
            lse_j = tl.load(part_lse_ptr + row0 + j, mask=h_mask, other=float("-inf"))
            o_j = tl.load(
                part_out_ptr + (row0 + j)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=o_mask,
                other=0.0,
            )  # [BLOCK_H, BLOCK_D]
            m_new = tl.maximum(m, lse_j)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)  # rescales what was summed so far (0 when it was empty)
            w_j = tl.exp2(lse_j - m_safe)
            num = num * alpha[:, None] + o_j * w_j[:, None]
            den = den * alpha + w_j
            m = m_new
        o = num / tl.where(den > 0.0, den, 1.0)[:, None]
    if SINGLE_SPLIT:
        o_ptrs = out_ptr + req.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        tl.store(o_ptrs + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # part_out: [num_reqs, num_heads, num_slots, HEAD_DIM]; part_lse: [num_reqs, num_heads,
        # num_slots] (num_slots = num_splits, or more when a cascade adds its prefix splits).
        # An empty split leaves lse = -inf so the merge gives it weight 0.
        row = (req.to(tl.int64) * NUM_HEADS + heads) * num_slots + split  # [BLOCK_H]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=o_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # the partials come from the split kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row0 = (req.to(tl.int64) * NUM_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + row0 + offs_s, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [BLOCK_S]
    o_ptrs = part_out_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(o_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    denom = tl.sum(w, axis=0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    merged = tl.sum(o * w[:, None], axis=0) / denom  # [BLOCK_D]
    dst = out_ptr + req.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, every entry >= 1
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [num_reqs, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # [num_pages, page_size, num_kv_heads] fp32 (quantized)
    v_scale: torch.Tensor | None = None,
    ctx_start: torch.Tensor | None = None,  # [num_reqs] int32: first context position to attend
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    merge_prefix: bool = False,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    """Attend one query token per request over its paged K/V; returns ``out``.

    ``max_seq_len`` (a host int, to avoid a device sync) sizes the split; pass ``num_splits`` to
    fix the grid instead (e.g. under CUDA-graph capture, where it must not depend on the step).

    Cascade attention (``kernels/cascade_attention.py``) passes ``ctx_start`` (row ``r`` attends
    positions ``ctx_start[r] .. seq_lens[r] - 1`` only) and ``partials = (part_out, part_lse)``,
    ``[num_reqs, num_heads, num_slots(, head_dim)]`` fp32: the splits then write their partials
    to slots ``0 .. num_splits - 1`` and nothing is merged (the caller merges all the slots).
    With ``merge_prefix`` (one split only) the partials hold the prefix's slots instead: the
    kernel merges them with its own result and writes ``out`` (no merge kernel, no partial).
    ``config``: (BLOCK_N, num_warps, num_stages) instead of ``_pick_config``'s (sweeps).
    """
    check_device(q, k_cache, v_cache)
    num_reqs, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and v_cache.shape == k_cache.shape
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_table.shape[0] >= num_reqs and seq_lens.shape[0] >= num_reqs
    if out is None:
        out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_h = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    quant = k_scale is not None
    f16, i8_asm = widening(q, k_cache, k_scale)
    if config is None:
        if f16:
            config = QUANT_CONFIG or _pick_quant_config(head_dim)
        else:
            config = _pick_config(head_dim)
    block_n, num_warps, num_stages = config
    if max_seq_len is None:
        max_seq_len = int(seq_lens[:num_reqs].max().item())
    if num_splits is None:
        num_splits = choose_num_splits(
            num_reqs, num_kv_heads, max_seq_len, num_sms(q.device), block_n
        )
    split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    single = num_splits == 1 and (partials is None or merge_prefix)
    assert not merge_prefix or (num_splits == 1 and partials is not None)
    if partials is not None:
        part_out, part_lse = partials
        assert part_out.shape[2] >= num_splits and part_lse.shape == part_out.shape[:3]
    elif single:
        part_out = part_lse = out  # unused by the kernel
    else:
        part_out = torch.empty(
            num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            num_reqs, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    k_s, v_s, stride_sp, stride_ss = scale_args(k_cache, v_cache, k_scale, v_scale)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        k_s,
        v_s,
        block_table,
        seq_lens,
        seq_lens if ctx_start is None else ctx_start,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        stride_sp,
        stride_ss,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        split_len,
        num_splits,
        part_lse.shape[2] if partials is not None or not single else 1,
        part_lse.shape[2] if merge_prefix else 0,
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SINGLE_SPLIT=single,
        PRECISION=precision,
        KV_QUANT=quant,
        KV_F16=f16,
        KV_ANCHOR=f16 and KV_ANCHOR,
        KV_I8_ASM=i8_asm,
        HAS_START=ctx_start is not None,
        MERGE_PREFIX=merge_prefix,
        DEVICE_SPLIT=DEVICE_SPLIT and not single,
        MIN_SPLIT=max(MIN_TOKENS_PER_SPLIT, block_n),
        num_warps=num_warps,
        num_stages=num_stages,
        **_pdl_meta(),
    )
    if not single and partials is None:
        merge_partials(part_out, part_lse, out)
    return out


def merge_partials(
    part_out: torch.Tensor,  # [num_reqs, num_heads, num_slots, head_dim] fp32
    part_lse: torch.Tensor,  # [num_reqs, num_heads, num_slots] fp32, base 2 (-inf: empty)
    out: torch.Tensor,  # [num_reqs, num_heads, head_dim]
) -> torch.Tensor:
    """Merge normalised partial outputs by their log-sum-exp (base 2) into ``out``."""
    num_reqs, num_heads, num_slots, head_dim = part_out.shape
    _decode_merge_kernel[(num_reqs, num_heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_slots,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(num_slots)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=4,
        **_pdl_meta(),
    )
    return out


PDL_ATTENTION = os.environ.get("ROOFLINE_PDL_ATTENTION", "1") != "0"
"""The split and merge kernels launch as programmatic dependents (``kernels.pdl``): each waits
for its predecessor first, then lets the next kernel launch, so launches overlap and the next
layer's GEMV prefetches its weights while the merge runs."""


def _pdl_meta() -> dict:
    if PDL_ATTENTION and not is_interpret() and pdl_enabled():
        return {"PDL": True, "launch_pdl": True}
    return {}


def scale_args(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(k_scale, v_scale, page stride, row stride) for the attention kernels; the caches stand
    in for the scale pointers of a 16/32-bit cache (never read: ``KV_QUANT`` is False)."""
    if k_scale is None:
        assert v_scale is None and k_cache.dtype.itemsize > 1, "a 1-byte cache needs its scales"
        return k_cache, v_cache, 0, 0
    assert v_scale is not None and k_scale.shape == k_cache.shape[:3]
    assert k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
    assert k_scale.dtype == torch.float32 and v_cache.dtype == k_cache.dtype
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1)


def decode_attention_bytes(
    num_reqs: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> int:
    """Bytes a decode step must move at least: all K and V once, plus q in and out out."""
    kv = 2 * num_reqs * seq_len * num_kv_heads * head_dim * itemsize
    return kv + 2 * num_reqs * num_heads * head_dim * itemsize


__all__ = [
    "choose_num_splits",
    "decode_attention",
    "decode_attention_bytes",
    "decode_attention_ref",
    "merge_partials",
]
