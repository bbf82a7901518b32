"""Paged multi-query decode attention: ``Q`` query tokens per request, causal among themselves.

A speculative verification step (and a draft model's catch-up step) gives each request the
``1 + k`` tokens after its cached context: query row ``t`` (0-based) of request ``r`` sits at
position ``seq_lens[r] - Q + t`` and attends every key up to and including itself. That is
decode-shaped, not prefill-shaped: the cost is reading each request's K/V once, so the kernel
is the split-K flash-decoding kernel of ``decode_attention`` with more rows per program. One
program per (request, kv_head, split) loads the ``Q x GROUP`` query rows that share its KV head
(row ``i``: token ``i // GROUP``, head ``i % GROUP`` of the group; padded to 16 for ``tl.dot``),
walks its slice of the context once, and masks keys past each row's own position. Splits
merge with ``decode_attention``'s merge kernel (a token's rows are merged like a request's).

Every request has exactly ``Q`` rows (``q: [num_reqs * Q, num_heads, head_dim]``), so with the
split count fixed the launch has one shape per (batch, Q) and is captured in CUDA graphs
(``roofline/spec_decode/verify_graph.py``); requests with fewer real rows are padded by the
caller (their extra rows attend stale keys and are never read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, num_sms
from roofline.kernels.decode_attention import (
    LOG2E,
    _decode_merge_kernel,
    _pick_config,
    _pick_quant_config,
    _pv_f16,
    _q_f16,
    _widen_f16,
    choose_num_splits,
    scale_args,
    widening,
)
from roofline.quantization.kv_cache import dequantize


def verify_attention_ref(
    q: torch.Tensor,  # [num_reqs * Q, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, each >= Q
    scale: float,
    query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_reqs * Q, num_heads, head_dim]
    """Plain torch, one request at a time, in fp32."""
    if k_scale is not None:
        k_cache = dequantize(k_cache, k_scale, q.dtype)
        v_cache = dequantize(v_cache, v_scale, q.dtype)
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        pages = block_table[i, : -(-seq_len // page_size)].long()
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # [S, Hk, D]
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # [S, Hk, D]
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)  # [S, H, D]
        rows = q[i * query_len : (i + 1) * query_len].float()  # [Q, H, D]
        scores = torch.einsum("thd,shd->ths", rows, k) * scale  # [Q, H, S]
        dev = q.device
        pos = torch.arange(seq_len - query_len, seq_len, device=dev).view(-1, 1, 1)  # [Q, 1, 1]
        keys = torch.arange(seq_len, device=dev).view(1, 1, -1)  # [1, 1, S]
        scores = scores.masked_fill(keys > pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Q, H, S]
        out[i * query_len : (i + 1) * query_len] = torch.einsum("ths,shd->thd", probs, v).to(
            q.dtype
        )
    return out


@triton.jit(do_not_specialize=["stride_bt", "split_len", "num_splits"])
def _verify_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
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
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    QUERY_LEN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_F16: tl.constexpr = False,  # 1-byte pages widened to fp16 (decode_attention.KV_F16)
    KV_I8_ASM: tl.constexpr = False,  # int8 pages through decode_attention.I8_TO_F16_PTX
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - QUERY_LEN  # keys before the first query row
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M] rows = (query token, head of the group)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < QUERY_LEN * GROUP
    d_mask = offs_d < HEAD_DIM
    tok = offs_m // GROUP  # [BLOCK_M] query token within the request
    heads = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    tokens = req.to(tl.int64) * QUERY_LEN + tok  # [BLOCK_M] row of q / out
    last_key = context + tok  # [BLOCK_M] the last key each row may see
    q_ptrs = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q_mma = q
    if KV_QUANT and KV_F16:  # fp16 products with 1-byte pages, as decode_attention's
        q_mma = _q_f16(q)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    k_scale_head = k_scale_ptr + kv_head
    v_scale_head = v_scale_ptr + kv_head
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_mask = offs_n < end
        pages = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = offs_n % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_off = pages * stride_kp + rows * stride_ks  # [BLOCK_N] int64
        k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT:
            s_off = pages * stride_sp + rows * stride_ss
            if KV_F16:
                k = _widen_f16(k, True, KV_I8_ASM)
            else:
                k = k.to(tl.float32).to(q.dtype)
        s = tl.dot(q_mma, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if KV_QUANT:
            s = s * tl.load(k_scale_head + s_off, mask=n_mask, other=0.0)[None, :]
        s = s * scale_log2e
        visible = n_mask[None, :] & (offs_n[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = pages * stride_vp + rows * stride_vs
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT and KV_F16:  # (decode_attention's fp16 widening)
            pv = _pv_f16(p, v, v_scale_head + s_off, n_mask, True, KV_I8_ASM, PRECISION)
            acc = acc * alpha[:, None] + pv
        else:
            if KV_QUANT:
                p = p * tl.load(v_scale_head + s_off, mask=n_mask, other=0.0)[None, :]
                v = v.to(tl.float32).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [BLOCK_M, BLOCK_D]
    o_mask = m_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        o_ptrs = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
        tl.store(o_ptrs + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # part_out: [num_tokens, num_heads, num_splits, HEAD_DIM]; part_lse: [num_tokens,
        # num_heads, num_splits]; a split a row sees nothing of keeps lse = -inf (weight 0).
        row = (tokens * NUM_HEADS + heads) * num_splits + split  # [BLOCK_M]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=o_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=m_mask)


def verify_attention(
    q: torch.Tensor,  # [num_reqs * Q, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, each >= Q (query rows included)
    scale: float,
    query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_reqs * Q, num_heads, head_dim]
    """Attend ``query_len`` causal query rows per request over its paged K/V; returns ``out``.
    ``max_seq_len`` (a host int) sizes the splits; ``num_splits`` fixes the grid instead."""
    check_device(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    page_size = k_cache.shape[1]
    assert num_tokens % query_len == 0 and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    num_reqs = num_tokens // query_len
    if out is None:
        out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group * query_len))
    block_d = max(16, triton.next_power_of_2(head_dim))
    f16, i8_asm = widening(q, k_cache, k_scale)
    block_n, num_warps, num_stages = _pick_quant_config(head_dim) if f16 else _pick_config(head_dim)
    if block_m > 64:  # many rows per program: fewer keys per iteration keep registers in bounds
        block_n, num_warps = 32, 8
    if num_splits is None:
        num_splits = choose_num_splits(
            num_reqs, num_kv_heads, max_seq_len, num_sms(q.device), block_n
        )
    split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    single = num_splits == 1
    if single:
        part_out = part_lse = out
    else:
        part_out = torch.empty(
            num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                               device=q.device)  # fmt: skip
    k_s, v_s, stride_sp, stride_ss = scale_args(k_cache, v_cache, k_scale, v_scale)
    _verify_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_s, v_s, block_table, seq_lens, out, part_out, part_lse,
        scale * LOG2E, stride_sp, stride_ss, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1), split_len, num_splits,
        NUM_HEADS=num_heads, GROUP=group, QUERY_LEN=query_len, HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n,
        SINGLE_SPLIT=single, PRECISION=precision, KV_QUANT=k_scale is not None,
        KV_F16=f16, KV_I8_ASM=i8_asm,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if not single:
        _decode_merge_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out


__all__ = ["verify_attention", "verify_attention_ref"]
