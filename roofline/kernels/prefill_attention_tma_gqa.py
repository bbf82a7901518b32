"""Prefill attention through tensor descriptors with the query heads of one KV head packed into
each tile: long prompts of grouped-query models.

``prefill_attention_tma`` gives each (query tile, query head) a program, so the ``GROUP`` query
heads that share a KV head each stream the same keys and values from L2: at 8,192 tokens, 32
query / 8 KV heads, d 128, that is ~4 GB of K/V tiles per layer into the SMs (~3.4 TB/s at the
kernel's 1.2 ms). Here a program owns ``BLOCK_Q`` consecutive query tokens of one request and
all ``GROUP`` heads of one KV head, ``BLOCK_M = BLOCK_Q x GROUP`` rows (row ``m``: token
``m // GROUP``, head ``kv_head x GROUP + m % GROUP``): each K/V box is loaded once for the group
and multiplied by a full tile. q comes in one ``[BLOCK_Q, GROUP, head_dim]`` box of a 3-D
descriptor over ``[num_tokens, num_heads, head_dim]``; the key loops, the cached prefix (gathered
rows through descriptors, or the pages), the causal split into unmasked and diagonal blocks and
the last-tiles-first order are ``prefill_attention_tma``'s, with each row's mask from its token.
``GROUP`` must be a power of two (``applies``); ``BLOCK_N`` smaller than the per-head kernel's
keeps the diagonal's masked work small (a tile's tokens span only ``BLOCK_Q`` positions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from roofline.kernels.prefill_attention_tma import (
    _attend_gathered_prefix,
    _attend_new,
    _attend_paged_prefix,
    _rows_desc,
)
from roofline.kernels.prefix_gather import GatheredPrefix


@triton.jit(do_not_specialize=["num_reqs", "num_tiles", "search_steps", "stride_bt"])
def _prefill_tma_gqa_kernel(
    q_desc, k_desc, v_desc, kp_desc, vp_desc, k_cache_ptr, v_cache_ptr, block_table_ptr,
    query_start_loc_ptr, prefix_start_loc_ptr, seq_lens_ptr, out_ptr, scale_log2e, num_reqs,
    num_tiles, search_steps,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt, stride_ot,
    stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    HEADS_FAST: tl.constexpr, PREFIX_TMA: tl.constexpr, HAS_PREFIX: tl.constexpr,
    PAGED_PREFIX: tl.constexpr,
):  # fmt: skip
    if HEADS_FAST:  # grid (kv heads, tiles): a tile's KV heads side by side
        tile = num_tiles - 1 - tl.program_id(1)  # last tiles (longest causal rows) first
        kv_head = tl.program_id(0)
    else:
        tile = num_tiles - 1 - tl.program_id(0)
        kv_head = tl.program_id(1)
    lo = num_reqs * 0
    hi = num_reqs
    for _ in range(search_steps):  # the request whose first tile (qsl[i] // BLOCK_Q + i) <= tile
        mid = (lo + hi) // 2
        right = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    req = lo
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_tok = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if (first_tok < 0) | (first_tok >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    tok_in = first_tok + offs_m // GROUP  # [BLOCK_M] chunk-relative token of each row
    offs_d = tl.arange(0, HEAD_DIM)
    q = q_desc.load([q_start + first_tok, kv_head * GROUP, 0])  # [BLOCK_Q, GROUP, HEAD_DIM]
    q = tl.reshape(q, [BLOCK_M, HEAD_DIM])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    col = kv_head * HEAD_DIM
    if not HAS_PREFIX:  # every request's context is empty (fresh prompts): no prefix code
        pass
    elif PREFIX_TMA:
        p_row = tl.load(prefix_start_loc_ptr + req)
        if (p_row >= 0) & (ctx_len > 0):
            acc, m_i, l_i = _attend_gathered_prefix(
                acc, m_i, l_i, q, kp_desc, vp_desc, p_row, col, ctx_len, tok_in, scale_log2e,
                BLOCK_N, PRECISION,
            )  # fmt: skip
        elif PAGED_PREFIX:  # (False: every request with context was gathered)
            if ctx_len > 0:
                acc, m_i, l_i = _attend_paged_prefix(
                    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, req, kv_head,
                    ctx_len, tok_in, offs_d, scale_log2e, stride_kp, stride_ks, stride_kh,
                    stride_vp, stride_vs, stride_vh, stride_bt, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                    PRECISION,
                )  # fmt: skip
    elif ctx_len > 0:
        acc, m_i, l_i = _attend_paged_prefix(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, req, kv_head, ctx_len,
            tok_in, offs_d, scale_log2e, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, stride_bt, HEAD_DIM, PAGE_SIZE, BLOCK_N, PRECISION,
        )  # fmt: skip

    # This chunk's keys: blocks left of the tile's first token unmasked, the diagonal masked.
    full_end = (first_tok + 1) // BLOCK_N * BLOCK_N
    for j0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_new(acc, m_i, l_i, q, k_desc, v_desc, q_start, col, j0, tok_in,
                                    scale_log2e, BLOCK_N, False, PRECISION)  # fmt: skip
    for j0 in range(full_end, tl.minimum(q_len, first_tok + BLOCK_Q), BLOCK_N):
        acc, m_i, l_i = _attend_new(acc, m_i, l_i, q, k_desc, v_desc, q_start, col, j0, tok_in,
                                    scale_log2e, BLOCK_N, True, PRECISION)  # fmt: skip

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    heads = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    tok = (q_start + tok_in).to(tl.int64)
    o_ptrs = out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=(tok_in < q_len)[:, None])


CONFIG: tuple[int, int, int, int] = (128, 64, 8, 3)
"""(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) of chunks long enough for 128-row tiles
(``prefill_attention`` picks smaller tiles for short ones), head_dim 128, 16-bit: 32 tokens x 4
heads; no register spills at sm_90 (ptxas) where 128 x 128 spills beside the paged-prefix path."""


def applies(num_heads: int, num_kv_heads: int) -> bool:
    """Grouped query heads in a power-of-two group (rows of a tile: tokens x group)."""
    group = num_heads // num_kv_heads
    return group >= 2 and group & (group - 1) == 0


def prefill_attention_tma_gqa(
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
    heads_fast: bool = True,
    prefix: GatheredPrefix | None = None,
    has_prefix: bool = True,
) -> torch.Tensor:
    """``prefill_attention_tma``'s contract (its ``tma_applies`` tensors), ``block_m`` rows per
    tile = ``block_m // group`` tokens x the group's heads."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    assert applies(num_heads, num_kv_heads) and block_m % group == 0
    block_q = block_m // group
    num_reqs = query_start_loc.shape[0] - 1
    q3 = TensorDescriptor(q, list(q.shape), list(q.stride()), [block_q, group, head_dim])
    k2, v2 = (_rows_desc(t, block_n) for t in (k_new, v_new))
    kp2, vp2, prefix_start = k2, v2, query_start_loc  # unused unless PREFIX_TMA
    if prefix is not None:
        kp2, vp2 = (_rows_desc(t, block_n) for t in (prefix.k, prefix.v))
        prefix_start = prefix.start_loc
    num_tiles = num_tokens // block_q + num_reqs  # upper bound on sum(cdiv(query_len, block_q))
    grid = (num_kv_heads, num_tiles) if heads_fast else (num_tiles, num_kv_heads)
    _prefill_tma_gqa_kernel[grid](
        q3, k2, v2, kp2, vp2, k_cache, v_cache, block_table, query_start_loc, prefix_start,
        seq_lens, out, scale_log2e, num_reqs, num_tiles, max(1, (num_reqs - 1).bit_length() + 1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HEADS_FAST=heads_fast, PREFIX_TMA=prefix is not None, HAS_PREFIX=has_prefix,
        PAGED_PREFIX=prefix is None or not prefix.complete,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
