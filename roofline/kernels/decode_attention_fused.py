"""Decode attention with its prologue and epilogue in one kernel: Qwen3's per-head q/k RMSNorm,
RoPE, the K/V store and the split merge, launched once per layer instead of three times.

At batch 1 a decode layer's attention is three tiny launches (``rotary_kv_store``, the split-K
``decode_attention`` kernel, its merge), each costing more in launch and ramp-up than in
memory traffic. Here program ``(req, kv_head, split)``:

1. picks its split on the device: ``num_splits = min(max_splits, cdiv(seq_len, SPLIT_TOKENS))``
   and splits of equal length (a multiple of BLOCK_N), so a short context runs in one program
   per KV head and never needs a merge, whatever ``max_splits`` the CUDA graph was captured with;
   programs past ``num_splits`` exit at once;
2. as a programmatic dependent (PDL), prefetches its cached K/V rows into L2, lets the next kernel
   launch, and only then waits for the QKV GEMM (the cached K/V were written by earlier steps);
3. normalises (``QK_NORM``) and rotates the q heads of its GQA group from the QKV output, and the
   step's k of its KV head, with ``rotary_kv_store``'s roundings; the program whose split holds
   the new token stores its rotated k and its v into the cache (slot < 0: padding, no store);
4. attends over its cached tokens (``tl.dot`` on GQA-grouped q rows, online softmax) and adds the
   new token from registers, so no program reads a cache row written in this launch;
5. with one split writes the output; otherwise writes a partial output and its log-sum-exp (base
   2), and the last split of the (req, kv_head) to finish (an atomic counter, reset by it)
   merges them and writes the output: no merge launch.

16/32-bit caches only (a quantized cache takes ``rotary_kv_store`` + ``decode_attention``), full
rotary (``rotary_dim == head_dim``). ``fused_decode_attention_ref`` is the unfused sequence in
plain torch. ``ROOFLINE_FUSED_ATTENTION=0`` (or ``set_enabled(False)``) turns the path off in the
Triton backend; ``ROOFLINE_DECODE_SPLIT_TOKENS`` sets the shortest split (default 64).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret, num_sms
from roofline.kernels.decode_attention import (
    LOG2E,
    MAX_NUM_SPLITS,
    choose_num_splits,
    decode_attention_ref,
)
from roofline.kernels.kv_store import store_kv_ref
from roofline.kernels.last_program import counters
from roofline.kernels.pdl import pdl_enabled, prefetch_l2
from roofline.kernels.rmsnorm import rms_norm_ref
from roofline.kernels.rotary import _round, rotary_ref

_ENABLED = os.environ.get("ROOFLINE_FUSED_ATTENTION", "1") != "0"
SPLIT_TOKENS = int(os.environ.get("ROOFLINE_DECODE_SPLIT_TOKENS", "64"))
"""Fewest context tokens per split chosen on the device (a power of two >= BLOCK_N). One block
per program at short contexts: its K/V load before the wait, off the critical path (H100,
Qwen3-0.6B shape, batch 1, one layer in a graph: 128 -> 8.8 us, 256 -> 11.3, 512 -> 15.2 us at
a 512-token context with the K/V loaded after the wait; the old three launches 9.7 us)."""
BLOCK_N = 64  # keys per iteration (head_dim <= 128; 32 beyond), as kernels.decode_attention
MAX_ROWS = 4
"""Most decode rows the fused kernel takes: it is built for latency-bound small batches. At
large batches it measured far slower than the split-K kernel plus its merge (H100, 8B: batch
128 70.6% vs 75.4% of roofline; the default preset's 251-row steps 24.2 vs 17.6 ms)."""
NUM_WARPS = 4  # per program (scripts/gpu_qwen06.py sweeps it in the engine)
WIDE_GROUP_WARPS: dict[int, int] = {8: 8}
"""Warps per program by GQA group size, where it differs from NUM_WARPS. sm_90 ptxas at
Qwen3-30B-A3B's group of 8 query heads per KV head (q/k norm): 255 registers and 220 bytes of
spill stores a thread at 4 warps, 231 registers and none at 8. H100, 48 layers at batch 1: with
the per-head merge, 4.17 ms a step at 4 warps, 3.93 at 8 (3.84 with ``MERGE_TILE_FIT``),
against 3.45 for the three unfused kernels (``scripts/gpu_moe4.py``); with
``MERGE_BY_SPLIT_GROUPS`` 3.098 ms at 4 warps, 3.083 at 8, against 3.381 unfused
(``scripts/gpu_moe5.py``)."""
MERGE_BY_SPLIT_GROUPS: set[int] = {2, 8}
"""GQA group sizes whose last split merges all the group's heads at once (``_merge_by_split``:
4 partials a round trip, elementwise) instead of one ``[BLOCK_S, BLOCK_D]`` reduction per head
(``_merge_splits``), the part of the kernel that grows with the group. sm_90 SASS at 32/4/128:
3,160 instructions and 50 barriers against 6,088 and 136. H100, Qwen3-30B-A3B batch 1 (48
layers): this kernel 3.083 ms a step against 3.381 for the unfused three (``WIDE_GROUP_WARPS``).
Qwen3-0.6B's group of 2 (16/8/128), same run: batch 1 1,302.8 -> 1,474.4 tok/s. Other groups
keep the per-head merge (not measured)."""
MERGE_TILE_FIT = False
"""The merge's tile of partials: False ``MAX_NUM_SPLITS`` rows (as measured so far), True the
grid's ``max_splits`` rounded up to a power of two (fewer registers; H100, Qwen3-30B-A3B at 8
warps with the per-head merge: 3.93 -> 3.84 ms a step, see WIDE_GROUP_WARPS; not measured at
other shapes). The groups of ``MERGE_BY_SPLIT_GROUPS`` have no such tile."""


def set_enabled(enabled: bool) -> None:
    """Turn the fused decode attention on or off for forwards from now on (benchmarks compare)."""
    global _ENABLED
    _ENABLED = enabled


def set_split_tokens(tokens: int) -> None:
    """The fewest tokens per split (sweeps; recapture CUDA graphs after changing it)."""
    global SPLIT_TOKENS
    if tokens < 1 or tokens & (tokens - 1):
        raise ValueError(f"split tokens must be a power of two, got {tokens}")
    SPLIT_TOKENS = tokens


UNFUSED_FASTER: set[tuple[int, int, int]] = {(32, 8, 128)}
"""(query heads, KV heads, head_dim) whose decode steps keep ``rotary_kv_store`` +
``decode_attention`` + its merge, measured faster: H100, Llama-3.1-8B's attention after the int4
qkv GEMV at one row, 32 layers in a CUDA graph with PDL, 160-token context: +7.5 us a layer for
the three kernels (``rotary_kv_store`` hidden under the GEMV's tail: +0.01 us) vs +11.4 us for
this kernel (13 us of its own with PDL off); second run, with the split and merge kernels as
PDL dependents: +6.8 / +7.2 us vs +11.3 / +11.8 at 160 / 1000 tokens, 8B batch-1 decode bf16
179.0 vs 172.3 tok/s (``scripts/gpu_gemv8.py``). Qwen3-30B-A3B's 32/4 heads (q/k norm) left
the set with ``MERGE_BY_SPLIT_GROUPS`` and ``WIDE_GROUP_WARPS``: 3.083 vs 3.381 ms a batch-1
step (48 layers, H100, ``scripts/gpu_moe5.py``; with the per-head merge at 4 warps it had taken
28.9 us of its own a layer, ``scripts/gpu_moe3.py``)."""


def applies(
    q: torch.Tensor, k_cache: torch.Tensor, cos_sin_cache: torch.Tensor, quantized: bool
) -> bool:
    """Whether a decode-only step with fused RoPE can run this kernel (shapes only, no sync)."""
    head_dim = q.shape[-1]
    return (
        _ENABLED
        and q.shape[0] <= MAX_ROWS
        and not quantized
        and k_cache.dtype == q.dtype
        and cos_sin_cache.shape[1] == head_dim
        and head_dim % 2 == 0
        and (q.is_cuda or is_interpret())
        and (q.shape[1], k_cache.shape[2], head_dim) not in UNFUSED_FASTER
    )


def fused_decode_attention_ref(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k: torch.Tensor,  # [num_reqs, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_reqs, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_reqs]
    cos_sin_cache: torch.Tensor,  # [max_pos, head_dim]
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_reqs] int64 (< 0: no store)
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, the new token included
    scale: float,
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    """The unfused sequence: q/k norm (HF's ``Qwen3RMSNorm``), RoPE, K/V store, attention."""
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        q, k = rms_norm_ref(q, q_w, eps), rms_norm_ref(k, k_w, eps)
    q, k = rotary_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping.long())
    return decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, scale)


@triton.jit
def _norm_rope(x1, x2, w1, w2, cos, sin, eps, inv_head_dim, dtype: tl.constexpr,
               QK_NORM: tl.constexpr):  # fmt: skip
    """RMSNorm over each head (row) of the halves ``x1 | x2`` (fp32 ``[ROWS, BLOCK_R]``) with the
    weight halves ``w1 | w2`` (fp32 ``[1, BLOCK_R]``, loaded before the PDL wait) when QK_NORM,
    then rotate-half RoPE (``cos, sin: [1, BLOCK_R]``, rounded to dtype); the roundings of
    ``rotary_kv_store``. Returns the halves in dtype."""
    if QK_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [ROWS]
        rstd = tl.rsqrt(ss * inv_head_dim + eps)[:, None]  # [ROWS, 1]
        x1 = _round(_round(x1 * rstd, dtype) * w1, dtype)
        x2 = _round(_round(x2 * rstd, dtype) * w2, dtype)
    o1 = _round(x1 * cos, dtype) - _round(x2 * sin, dtype)
    o2 = _round(x2 * cos, dtype) + _round(x1 * sin, dtype)
    return o1.to(dtype), o2.to(dtype)


@triton.jit
def _attend_block(q1, q2, k1, k2, v, n_mask, m_i, l_i, acc, scale_log2e, PRECISION: tl.constexpr):
    """One block of cached keys into the online softmax: q halves [BLOCK_H, BLOCK_R], k halves
    [BLOCK_N, BLOCK_R], v [BLOCK_N, BLOCK_D], ``n_mask`` the valid keys (possibly none)."""
    s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
    s = tl.dot(q2, tl.trans(k2), s, input_precision=PRECISION)
    s = tl.where(n_mask[None, :], s * scale_log2e, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an empty block changes nothing
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])  # [BLOCK_H, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, req, kv_head, num_splits, max_splits,
                  stride_ot, stride_oh, offs_d, d_mask, NUM_HEADS: tl.constexpr,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """Merge the ``num_splits`` partials of each query head of the group by log-sum-exp and store
    the output: one [BLOCK_S, BLOCK_D] load per head (``.cg``: other SMs wrote them)."""
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        row0 = (req.to(tl.int64) * NUM_HEADS + head) * max_splits
        lse = tl.load(part_lse_ptr + row0 + offs_s, mask=s_mask, other=float("-inf"),
                      cache_modifier=".cg")  # fmt: skip
        o = tl.load(part_out_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0,
                    cache_modifier=".cg")  # fmt: skip
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)  # [BLOCK_S]
        den = tl.sum(w, axis=0)
        merged = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)  # [BLOCK_D]
        dst = out_ptr + req.to(tl.int64) * stride_ot + head * stride_oh + offs_d
        tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _merge_by_split(part_out_ptr, part_lse_ptr, out_ptr, req, heads, h_mask, num_splits,
                    max_splits, stride_ot, stride_oh, offs_d, d_mask, NUM_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                    UNROLL: tl.constexpr):  # fmt: skip
    """``_merge_splits`` for all the query ``heads [BLOCK_H]`` at once: their ``[BLOCK_H,
    BLOCK_D]`` partials (``.cg``) loaded ``UNROLL`` splits at a time (one round trip for up to
    UNROLL splits) and folded in by a running log-sum-exp, elementwise (no reduction across
    warps). The same weights (2^(lse_j - max)), summed in split order."""
    row0 = (req.to(tl.int64) * NUM_HEADS + heads) * max_splits  # [BLOCK_H]
    o_mask = h_mask[:, None] & d_mask[None, :]
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max
    num = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j0 in range(0, num_splits, UNROLL):
        for jj in tl.static_range(UNROLL):
            j = j0 + jj
            ok = j < num_splits
            lse_j = tl.load(part_lse_ptr + row0 + j, mask=h_mask & ok, other=float("-inf"),
                            cache_modifier=".cg")  # fmt: skip
            o_j = tl.load(part_out_ptr + (row0 + j)[:, None] * HEAD_DIM + offs_d[None, :],
                          mask=o_mask & ok, other=0.0, cache_modifier=".cg")  # fmt: skip
            m_new = tl.maximum(m, lse_j)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)  # 0 while nothing was summed
            w_j = tl.exp2(lse_j - m_safe)  # 0 for an empty split or one past num_splits
            num = num * alpha[:, None] + o_j * w_j[:, None]
            den = den * alpha + w_j
            m = m_new
    merged = num / tl.where(den > 0.0, den, 1.0)[:, None]
    dst = out_ptr + req.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["stride_bt", "max_splits"])
def _fused_decode_attention_kernel(
    q_ptr,  # [T, NUM_HEADS, HEAD_DIM] (rows stride_qt apart: a view of the QKV output)
    k_ptr,  # [T, NUM_KV_HEADS, HEAD_DIM]
    v_ptr,  # [T, NUM_KV_HEADS, HEAD_DIM]
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_pos, HEAD_DIM]: cos half, then sin half
    q_norm_ptr,  # [HEAD_DIM] (read only if QK_NORM)
    k_norm_ptr,
    k_cache_ptr,  # [num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_cache_ptr,
    slot_mapping_ptr,  # [T]
    block_table_ptr,  # [T, max_num_blocks]
    seq_lens_ptr,  # [T], the new token included
    out_ptr,  # [T, NUM_HEADS, HEAD_DIM]
    part_out_ptr,  # [T, NUM_HEADS, max_splits, HEAD_DIM] fp32
    part_lse_ptr,  # [T, NUM_HEADS, max_splits] fp32
    counter_ptr,  # [T * NUM_KV_HEADS] int32, zero between launches
    scale_log2e,
    norm_eps,
    inv_head_dim,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos_sin,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    max_splits,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # MAX_NUM_SPLITS: the merge's tile of partials
    QK_NORM: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent: prefetch, trigger, wait
    LINES: tl.constexpr,  # 128-byte lines per cached head row (L2 prefetch)
    LINE_ELEMS: tl.constexpr,
    MERGE_BY_SPLIT: tl.constexpr = False,  # _merge_by_split (else _merge_splits)
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    num_splits = tl.minimum(tl.cdiv(seq_len, SPLIT_TOKENS), max_splits)
    if split < num_splits:
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        ctx_end = tl.minimum(end, seq_len - 1)  # cached tokens [start, ctx_end); the new one last
        owner = (start < seq_len) & (end == seq_len)  # this split holds the new token
        bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
        k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_ch
        v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_ch
        dtype = q_ptr.dtype.element_ty
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < HALF
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        # Before the wait: everything that predates the step. The first block's cached K/V go to
        # registers, the rest of the split to L2; the position's cos/sin, the slot, the q/k norm
        # weights.
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        first_mask = offs_n < ctx_end
        pages = tl.load(bt_row + offs_n // PAGE_SIZE, mask=first_mask, other=0).to(tl.int64)
        off = pages * stride_cp + (offs_n % PAGE_SIZE) * stride_cs  # [BLOCK_N]
        kc_mask = first_mask[:, None] & r_mask[None, :]
        kc1 = tl.load(k_head + off[:, None] + offs_r[None, :], mask=kc_mask, other=0.0)
        kc2 = tl.load(k_head + off[:, None] + HALF + offs_r[None, :], mask=kc_mask, other=0.0)
        vc = tl.load(v_head + off[:, None] + offs_d[None, :],
                     mask=first_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
        pos = tl.load(positions_ptr + req).to(tl.int64)
        cs_row = cos_sin_ptr + pos * stride_cos_sin
        cos = _round(tl.load(cs_row + offs_r, mask=r_mask, other=0.0).to(tl.float32), dtype)
        sin = _round(tl.load(cs_row + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32), dtype)
        cos, sin = cos[None, :], sin[None, :]  # [1, BLOCK_R]
        slot = tl.load(slot_mapping_ptr + req).to(tl.int64)
        if QK_NORM:  # the q/k norm weights: [1, BLOCK_R] halves
            qw1 = tl.load(q_norm_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
            qw2 = tl.load(q_norm_ptr + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32)
            kw1 = tl.load(k_norm_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
            kw2 = tl.load(k_norm_ptr + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32)
            qw2, kw2 = qw2[None, :], kw2[None, :]
        else:  # unread
            qw1, qw2, kw1, kw2 = cos, cos, cos, cos
        if PDL:
            offs_l = tl.minimum(tl.arange(0, LINES) * LINE_ELEMS, HEAD_DIM - 1)  # [LINES]
            for n0 in range(start + BLOCK_N, ctx_end, BLOCK_N):
                offs_p = n0 + tl.arange(0, BLOCK_N)
                p_ok = offs_p < ctx_end
                pg = tl.load(bt_row + offs_p // PAGE_SIZE, mask=p_ok, other=0).to(tl.int64)
                p_off = pg * stride_cp + (offs_p % PAGE_SIZE) * stride_cs  # [BLOCK_N]
                prefetch_l2(k_head + p_off[:, None] + offs_l[None, :])  # [BLOCK_N, LINES]
                prefetch_l2(v_head + p_off[:, None] + offs_l[None, :])
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()  # q, k, v: the QKV GEMM's output

        # q rows: the GROUP query heads of this KV head, as halves [BLOCK_H, BLOCK_R]
        offs_h = tl.arange(0, BLOCK_H)
        h_mask = offs_h < GROUP
        heads = kv_head * GROUP + offs_h  # [BLOCK_H]
        qr_mask = h_mask[:, None] & r_mask[None, :]
        q_src = q_ptr + req.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_r[None, :]
        q1 = tl.load(q_src, mask=qr_mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_src + HALF, mask=qr_mask, other=0.0).to(tl.float32)
        # the step's k of this KV head ([1, BLOCK_R] halves) and v ([1, BLOCK_D])
        kr_mask = r_mask[None, :]
        k_src = k_ptr + req.to(tl.int64) * stride_kt + kv_head * stride_kh + offs_r[None, :]
        k1 = tl.load(k_src, mask=kr_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_src + HALF, mask=kr_mask, other=0.0).to(tl.float32)
        v_src = v_ptr + req.to(tl.int64) * stride_vt + kv_head * stride_vh + offs_d[None, :]
        v_new = tl.load(v_src, mask=d_mask[None, :], other=0.0)  # [1, BLOCK_D]
        q1, q2 = _norm_rope(q1, q2, qw1, qw2, cos, sin, norm_eps, inv_head_dim, dtype, QK_NORM)
        k1, k2 = _norm_rope(k1, k2, kw1, kw2, cos, sin, norm_eps, inv_head_dim, dtype, QK_NORM)
        if owner & (slot >= 0):
            c_off = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs
            c_dtype = k_cache_ptr.dtype.element_ty
            tl.store(k_head + c_off + offs_r[None, :], k1.to(c_dtype), mask=kr_mask)
            tl.store(k_head + c_off + HALF + offs_r[None, :], k2.to(c_dtype), mask=kr_mask)
            tl.store(v_head + c_off + offs_d[None, :], v_new.to(c_dtype), mask=d_mask[None, :])

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        m_i, l_i, acc = _attend_block(q1, q2, kc1, kc2, vc, first_mask, m_i, l_i, acc,
                                      scale_log2e, PRECISION)  # fmt: skip
        for n0 in range(start + BLOCK_N, ctx_end, BLOCK_N):  # longer splits: from L2
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < ctx_end
            pages = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            off = pages * stride_cp + (offs_n % PAGE_SIZE) * stride_cs  # [BLOCK_N]
            kc_mask = n_mask[:, None] & r_mask[None, :]
            kc1 = tl.load(k_head + off[:, None] + offs_r[None, :], mask=kc_mask, other=0.0)
            kc2 = tl.load(k_head + off[:, None] + HALF + offs_r[None, :], mask=kc_mask, other=0.0)
            vc = tl.load(v_head + off[:, None] + offs_d[None, :],
                         mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
            m_i, l_i, acc = _attend_block(q1, q2, kc1, kc2, vc, n_mask, m_i, l_i, acc,
                                          scale_log2e, PRECISION)  # fmt: skip
        # the new token, from registers (its owner only)
        s_new = tl.sum(q1.to(tl.float32) * k1.to(tl.float32), axis=1)
        s_new = (s_new + tl.sum(q2.to(tl.float32) * k2.to(tl.float32), axis=1)) * scale_log2e
        s_new = tl.where(owner, s_new, float("-inf"))  # [BLOCK_H]
        m_new = tl.maximum(m_i, s_new)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p_new = tl.exp2(s_new - m_safe)  # [BLOCK_H]
        l_i = l_i * alpha + p_new
        p_new = p_new.to(dtype).to(tl.float32)  # rounded as a block's p before its dot
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)
        m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]  # [BLOCK_H, BLOCK_D]
        o_mask = h_mask[:, None] & d_mask[None, :]
        if num_splits == 1:
            o_ptrs = out_ptr + req.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
            tl.store(o_ptrs + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            row0 = (req.to(tl.int64) * NUM_HEADS + heads) * max_splits  # [BLOCK_H]
            tl.store(part_out_ptr + (row0 + split)[:, None] * HEAD_DIM + offs_d[None, :], o,
                     mask=o_mask)  # fmt: skip
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(part_lse_ptr + row0 + split, lse, mask=h_mask)
            tl.debug_barrier()  # the CTA's partials before its release (last_program.py)
            counter = counter_ptr + req * NUM_KV_HEADS + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:  # the last split of (req, kv_head): merge them all
                if MERGE_BY_SPLIT:
                    _merge_by_split(part_out_ptr, part_lse_ptr, out_ptr, req, heads, h_mask,
                                    num_splits, max_splits, stride_ot, stride_oh, offs_d, d_mask,
                                    NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, 4)  # fmt: skip
                else:
                    _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, req, kv_head, num_splits,
                                  max_splits, stride_ot, stride_oh, offs_d, d_mask, NUM_HEADS,
                                  GROUP, HEAD_DIM, BLOCK_S)  # fmt: skip
                tl.store(counter, 0)  # ready for the next launch


def fused_decode_attention(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim] (a view of the QKV output)
    k: torch.Tensor,  # [num_reqs, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_reqs, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_reqs] int32/int64
    cos_sin_cache: torch.Tensor,  # [max_pos, head_dim]: cos half, then sin half
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,  # (q_w, k_w [head_dim], eps)
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_reqs] int64; < 0 = no store (padding rows)
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, each >= 1 (the new token included)
    scale: float,
    max_seq_len: int,
    max_splits: int | None = None,
    out: torch.Tensor | None = None,  # [num_reqs, num_heads, head_dim]
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    """One query token per request: q/k norm (with ``qk_norm``), RoPE, K/V store and attention
    over the request's paged context, in one launch; q, k and v are left as they were.

    ``max_seq_len`` (a host int) bounds the splits of the grid (``choose_num_splits``) unless
    ``max_splits`` fixes them; the device then uses as many as the true context needs."""
    check_device(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    num_reqs, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and v_cache.shape == k_cache.shape
    assert k.shape == v.shape == (num_reqs, num_kv_heads, head_dim)
    assert num_heads % num_kv_heads == 0 and cos_sin_cache.shape[1] == head_dim
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.dtype == q.dtype
    if out is None:
        out = torch.empty(num_reqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_n = BLOCK_N if head_dim <= 128 else 32
    if max_splits is None:
        max_splits = choose_num_splits(
            num_reqs, num_kv_heads, max(max_seq_len, 1), num_sms(q.device), block_n
        )
    assert 1 <= max_splits <= MAX_NUM_SPLITS, "the merge reads at most MAX_NUM_SPLITS partials"
    if max_splits > 1:
        part_out = torch.empty(num_reqs, num_heads, max_splits, head_dim, dtype=torch.float32,
                               device=q.device)  # fmt: skip
        part_lse = torch.empty(num_reqs, num_heads, max_splits, dtype=torch.float32,
                               device=q.device)  # fmt: skip
    else:
        part_out = part_lse = out  # never read: every program writes the output itself
    split_counters = counters(q.device, num_reqs * num_kv_heads, "attention")
    if qk_norm is not None:
        q_norm_w, k_norm_w, eps = qk_norm
        assert q_norm_w.shape == (head_dim,) and k_norm_w.shape == (head_dim,)
    else:
        q_norm_w = k_norm_w = cos_sin_cache  # unused
        eps = 0.0
    compiled = not is_interpret()
    pdl = compiled and pdl_enabled()
    line_elems = 128 // k_cache.element_size()
    half = head_dim // 2
    meta: dict = {"launch_pdl": True} if pdl else {}
    _fused_decode_attention_kernel[(num_reqs, num_kv_heads, max_splits)](
        q, k, v, positions, cos_sin_cache, q_norm_w, k_norm_w, k_cache, v_cache, slot_mapping,
        block_table, seq_lens, out, part_out, part_lse, split_counters,
        scale * LOG2E, eps, 1.0 / head_dim,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1), max_splits,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        HALF=half, PAGE_SIZE=page_size, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_R=max(16, triton.next_power_of_2(half)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=block_n,
        SPLIT_TOKENS=max(SPLIT_TOKENS, block_n), QK_NORM=qk_norm is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl,
        BLOCK_S=max(2, triton.next_power_of_2(max_splits)) if MERGE_TILE_FIT else MAX_NUM_SPLITS,
        LINES=max(1, triton.next_power_of_2(triton.cdiv(head_dim, line_elems))),
        LINE_ELEMS=line_elems, MERGE_BY_SPLIT=group in MERGE_BY_SPLIT_GROUPS,
        num_warps=WIDE_GROUP_WARPS.get(group, NUM_WARPS), num_stages=3,
        enable_fp_fusion=False,  # the roundings of rotary_kv_store (no fma), as HF
        **meta,
    )  # fmt: skip
    return out


__all__ = ["applies", "fused_decode_attention", "fused_decode_attention_ref", "set_enabled"]
