"""Prefill attention whose in-chunk keys come through tensor descriptors (TMA on Hopper).

The same ragged causal attention as ``prefill_attention`` (same tiles, request search, online
softmax in base 2, last tiles first), split by where each key lives: keys of the cached prefix
(positions ``< context_len``) are gathered page by page from the paged cache as there, while the
step's own keys (this chunk's rows, ``k_new``/``v_new`` as the QKV projection wrote them: rotated,
not yet quantized) are read as whole ``[BLOCK_N, head_dim]`` boxes through 2-D tensor descriptors
over ``[num_tokens, num_kv_heads * head_dim]``, and q likewise. A fresh prompt then runs without
a single gathered load or per-key address; a chunk over a cached prefix pays the gathers only
for its prefix. The values are the ones the store just wrote to the cache (same dtype), so the
result is the paged kernel's up to summation order.

Causal structure per tile of rows ``[r0, r0 + BLOCK_M)`` (chunk-relative): prefix blocks and
chunk blocks entirely at or left of ``r0`` run without a mask; only the blocks that straddle the
diagonal mask. Descriptor boxes that run past a request's rows read the next request's rows (or
zeros past the tensor): those keys are right of every row's diagonal and masked, and rows past
the request are never stored. ``WARP_SPEC`` asks Triton to warp-specialise the unmasked loop
(producer warps issuing the loads, consumer warps the MMAs), where the compiler supports it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from roofline.kernels.prefill_attention import _attend_block
from roofline.kernels.prefix_gather import GatheredPrefix


@triton.jit
def _attend_new(
    acc, m_i, l_i, q, k_desc, v_desc, row0, col, j0, offs_m, scale_log2e,
    BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Fold the chunk's keys ``j0 .. j0 + BLOCK_N`` (descriptor rows ``row0 + j``) in."""
    k = k_desc.load([row0 + j0, col])  # [BLOCK_N, BLOCK_D]
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] unscaled
    if CAUSAL_MASK:
        offs_j = j0 + tl.arange(0, BLOCK_N)
        s = tl.where(offs_j[None, :] <= offs_m[:, None], s, float("-inf"))
    # The scale folded into the max and the exponent (one FMA per score, as FA does).
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2e)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale_log2e - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = v_desc.load([row0 + j0, col])  # [BLOCK_N, BLOCK_D]
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_gathered_prefix(
    acc, m_i, l_i, q, kp_desc, vp_desc, p_row, col, ctx_len, offs_m, scale_log2e,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Fold a gathered prefix in: keys ``0 .. ctx_len`` at descriptor rows ``p_row + j``."""
    prefix_full = ctx_len // BLOCK_N * BLOCK_N
    for j0 in range(0, prefix_full, BLOCK_N):
        acc, m_i, l_i = _attend_new(acc, m_i, l_i, q, kp_desc, vp_desc, p_row, col, j0, offs_m,
                                    scale_log2e, BLOCK_N, False, PRECISION)  # fmt: skip
    if prefix_full < ctx_len:  # keys j < ctx_len: the causal mask of a row at ctx_len - 1
        last = offs_m * 0 + (ctx_len - 1)
        acc, m_i, l_i = _attend_new(acc, m_i, l_i, q, kp_desc, vp_desc, p_row, col, prefix_full,
                                    last, scale_log2e, BLOCK_N, True, PRECISION)  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _attend_paged_prefix(
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, req, kv_head, ctx_len, offs_m,
    offs_d, scale_log2e, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Fold a prefix in from the pages (the last, partial block through the causal path, whose
    q_pos bound holds for every key)."""
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx_len + offs_m
    prefix_full = ctx_len // BLOCK_N * BLOCK_N
    for n0 in range(0, prefix_full, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_head, v_head, k_head, v_head, bt_row, n0, ctx_len, q_pos,
            stride_kp, stride_ks, stride_vp, stride_vs, 0, 0, offs_d, d_mask, scale_log2e,
            PAGE_SIZE, BLOCK_N, False, PRECISION, False,
        )  # fmt: skip
    if prefix_full < ctx_len:
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_head, v_head, k_head, v_head, bt_row, prefix_full, ctx_len,
            q_pos, stride_kp, stride_ks, stride_vp, stride_vs, 0, 0, offs_d, d_mask,
            scale_log2e, PAGE_SIZE, BLOCK_N, True, PRECISION, False,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_reqs", "num_tiles", "search_steps", "stride_bt"])
def _prefill_tma_kernel(
    q_desc, k_desc, v_desc, kp_desc, vp_desc, k_cache_ptr, v_cache_ptr, block_table_ptr,
    query_start_loc_ptr, prefix_start_loc_ptr, seq_lens_ptr, out_ptr, scale_log2e, num_reqs,
    num_tiles, search_steps,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt, stride_ot,
    stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, WARP_SPEC: tl.constexpr,
    HEADS_FAST: tl.constexpr, PREFIX_TMA: tl.constexpr, HAS_PREFIX: tl.constexpr,
):  # fmt: skip
    if HEADS_FAST:  # grid (heads, tiles)
        tile = num_tiles - 1 - tl.program_id(1)  # last tiles (longest causal rows) first
        head = tl.program_id(0)
    else:  # grid (tiles, heads)
        tile = num_tiles - 1 - tl.program_id(0)
        head = tl.program_id(1)
    lo = num_reqs * 0
    hi = num_reqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        right = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    req = lo
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_row = (tile - (q_start // BLOCK_M + req)) * BLOCK_M
    # first_row < 0: a tile before the first request's, when that request starts past row 0
    # (attention/split_backend.py gives the decode rows at the front to the decode kernel)
    if (first_row < 0) | (first_row >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    offs_m = first_row + tl.arange(0, BLOCK_M)  # [BLOCK_M] chunk-relative rows
    offs_d = tl.arange(0, HEAD_DIM)
    q = q_desc.load([q_start + first_row, head * HEAD_DIM])  # [BLOCK_M, HEAD_DIM]
    kv_head = head // GROUP
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    col = kv_head * HEAD_DIM
    # Cached prefix: every key precedes every row; only the last, partial block is masked (its
    # keys past the prefix). PREFIX_TMA: prefixes of long chunks were gathered into contiguous
    # rows (``kernels/prefix_gather.py``), this request's from ``prefix_start_loc[req]`` (-1:
    # not gathered), read as boxes like the chunk's own keys; the others from the pages.
    if not HAS_PREFIX:  # every request's context is empty (fresh prompts): no prefix code
        pass
    elif PREFIX_TMA:
        p_row = tl.load(prefix_start_loc_ptr + req)
        if (p_row >= 0) & (ctx_len > 0):
            acc, m_i, l_i = _attend_gathered_prefix(
                acc, m_i, l_i, q, kp_desc, vp_desc, p_row, col, ctx_len, offs_m, scale_log2e,
                BLOCK_N, PRECISION,
            )  # fmt: skip
        elif ctx_len > 0:
            acc, m_i, l_i = _attend_paged_prefix(
                acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, req, kv_head,
                ctx_len, offs_m, offs_d, scale_log2e, stride_kp, stride_ks, stride_kh,
                stride_vp, stride_vs, stride_vh, stride_bt, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                PRECISION,
            )  # fmt: skip
    elif ctx_len > 0:
        acc, m_i, l_i = _attend_paged_prefix(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, req, kv_head, ctx_len,
            offs_m, offs_d, scale_log2e, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, stride_bt, HEAD_DIM, PAGE_SIZE, BLOCK_N, PRECISION,
        )  # fmt: skip

    # This chunk's keys: blocks left of the tile's first row unmasked, the diagonal ones masked.
    full_end = (first_row + 1) // BLOCK_N * BLOCK_N
    for j0 in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPEC):
        acc, m_i, l_i = _attend_new(acc, m_i, l_i, q, k_desc, v_desc, q_start, col, j0, offs_m,
                                    scale_log2e, BLOCK_N, False, PRECISION)  # fmt: skip
    for j0 in range(full_end, tl.minimum(q_len, first_row + BLOCK_M), BLOCK_N):
        acc, m_i, l_i = _attend_new(acc, m_i, l_i, q, k_desc, v_desc, q_start, col, j0, offs_m,
                                    scale_log2e, BLOCK_N, True, PRECISION)  # fmt: skip

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tok = (q_start + offs_m).to(tl.int64)
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=(offs_m < q_len)[:, None])


def tma_applies(q: torch.Tensor, k_new: torch.Tensor | None, v_new: torch.Tensor | None) -> bool:
    """Whether the descriptor kernel can take these tensors: the chunk's K/V given, head_dim a
    power of two in 16..256, rows of q/k/v 16-byte aligned with contiguous heads."""
    if k_new is None or v_new is None:
        return False
    head_dim = q.shape[-1]
    if head_dim not in (16, 32, 64, 128, 256):
        return False
    for t in (q, k_new, v_new):
        if t.stride(-1) != 1 or t.stride(-2) != head_dim or t.data_ptr() % 16:
            return False
        if (t.stride(0) * t.element_size()) % 16:
            return False
    return k_new.shape[0] == q.shape[0] and v_new.shape == k_new.shape


def prefill_attention_tma(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_new: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's keys, rotated
    v_new: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale_log2e: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    warp_spec: bool = False,
    heads_fast: bool = False,
    prefix: GatheredPrefix | None = None,
    has_prefix: bool = True,
) -> torch.Tensor:
    """``prefix``: the cached prefixes gathered into contiguous rows (``gather_prefix``), read
    through descriptors too; None: the prefix is gathered from the pages inside the kernel."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    num_reqs = query_start_loc.shape[0] - 1
    q2 = TensorDescriptor(q, [num_tokens, num_heads * head_dim], [q.stride(0), 1],
                          [block_m, head_dim])  # fmt: skip
    k2, v2 = (_rows_desc(t, block_n) for t in (k_new, v_new))
    kp2, vp2, prefix_start = k2, v2, query_start_loc  # unused unless PREFIX_TMA
    if prefix is not None:
        kp2, vp2 = (_rows_desc(t, block_n) for t in (prefix.k, prefix.v))
        prefix_start = prefix.start_loc
    num_tiles = num_tokens // block_m + num_reqs
    grid = (num_heads, num_tiles) if heads_fast else (num_tiles, num_heads)
    _prefill_tma_kernel[grid](
        q2, k2, v2, kp2, vp2, k_cache, v_cache, block_table, query_start_loc, prefix_start,
        seq_lens, out, scale_log2e, num_reqs, num_tiles, max(1, (num_reqs - 1).bit_length() + 1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WARP_SPEC=warp_spec,
        HEADS_FAST=heads_fast, PREFIX_TMA=prefix is not None, HAS_PREFIX=has_prefix,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _rows_desc(t: torch.Tensor, block_n: int) -> TensorDescriptor:
    """A 2-D descriptor over ``t`` [rows, num_kv_heads, head_dim] (rows strided, heads
    contiguous) with ``[block_n, head_dim]`` boxes."""
    rows, num_kv_heads, head_dim = t.shape
    return TensorDescriptor(t, [rows, num_kv_heads * head_dim], [t.stride(0), 1],
                            [block_n, head_dim])  # fmt: skip
