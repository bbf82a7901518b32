"""Write the new tokens' K/V into the paged cache, optionally fused with RoPE.

``slot_mapping[t]`` is the flat cache slot of new token ``t``: page ``slot // page_size``, row
``slot % page_size`` of ``k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]`` (the
cache may be a strided view, e.g. one layer of a larger tensor; only head_dim must be
contiguous). A negative slot means "padding row, store nothing" (CUDA-graph padding). Values are
cast to the cache dtype on store. One program per token copies all its KV heads.

``rotary_kv_store`` fuses the rotary embedding (see ``rotary.py``) with the store: it rotates q
and k in place and writes the rotated k and the untouched v to the cache in the same pass, so k
is read once instead of three times. Its numerics are ``rotary.py``'s (HF's rounding points).
With ``qk_norm`` it also applies Qwen3's per-head q/k RMSNorm before rotating (two launches of
the norm kernel per layer saved), rounding where HF's ``Qwen3RMSNorm`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device
from roofline.kernels.rotary import _rotate_heads, _round, rotary_ref


def store_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep].long()
    pages, rows = slots // page_size, slots % page_size
    k_cache[pages, rows] = k[keep].to(k_cache.dtype)
    v_cache[pages, rows] = v[keep].to(v_cache.dtype)


def rotary_kv_store_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens]
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]
    k_cache: torch.Tensor,  # updated in place
    v_cache: torch.Tensor,  # updated in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated copies of q, k
    q_rot, k_rot = rotary_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot, k_rot


@triton.jit
def _cache_offsets(
    slot_mapping_ptr,
    tok,
    stride_cp,
    stride_cs,
    stride_ch,
    offs_h,
    offs_d,
    PAGE_SIZE: tl.constexpr,
):
    """(slot, [BLOCK_H, BLOCK_D] int64 offsets of token ``tok``'s heads in the cache)."""
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    base = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs
    return slot, base + offs_h[:, None].to(tl.int64) * stride_ch + offs_d[None, :]


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # Loads first (they do not depend on the slot), so they overlap the slot_mapping load.
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k_src = k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    v_src = v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    k = tl.load(k_src, mask=mask)  # [BLOCK_H, BLOCK_D]
    v = tl.load(v_src, mask=mask)
    slot, c_off = _cache_offsets(
        slot_mapping_ptr, tok, stride_cp, stride_cs, stride_ch, offs_h, offs_d, PAGE_SIZE
    )
    mask = mask & (slot >= 0)
    tl.store(k_cache_ptr + c_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + c_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    assert k.shape == v.shape and k.shape[0] == slot_mapping.shape[0]
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == k.shape[1:], (
        "cache is [num_pages, page_size, num_kv_heads, head_dim]"
    )
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = skip
) -> None:
    check_device(k, v, k_cache, v_cache, slot_mapping)
    _check_cache(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


@triton.jit
def _rotary_kv_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    q_norm_ptr,
    k_norm_ptr,
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
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < HALF
    cs_row = cos_sin_ptr + pos * stride_cos_sin
    dtype = k_ptr.dtype.element_ty
    cos = _round(tl.load(cs_row + offs_r, mask=r_mask, other=0.0).to(tl.float32), dtype)
    sin = _round(tl.load(cs_row + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32), dtype)
    if QK_NORM:  # Qwen3: RMSNorm of each q head (over HEAD_DIM == 2 * HALF), then RoPE
        offs_hq = tl.arange(0, BLOCK_HQ)
        q_mask = (offs_hq < NUM_Q_HEADS)[:, None] & r_mask[None, :]
        q1_ptr = q_ptr + tok * stride_qt + offs_hq[:, None] * stride_qh + offs_r[None, :]
        q1 = tl.load(q1_ptr, mask=q_mask, other=0.0).to(tl.float32)  # [BLOCK_HQ, BLOCK_R]
        q2 = tl.load(q1_ptr + HALF, mask=q_mask, other=0.0).to(tl.float32)
        ss = tl.sum(q1 * q1, axis=1) + tl.sum(q2 * q2, axis=1)
        rstd = tl.rsqrt(ss * inv_head_dim + norm_eps)[:, None]  # [BLOCK_HQ, 1]
        w1 = tl.load(q_norm_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(q_norm_ptr + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
        # HF: weight * (x * rstd).to(dtype), both rounded to dtype
        q1 = _round(_round(q1 * rstd, dtype) * w1, dtype)
        q2 = _round(_round(q2 * rstd, dtype) * w2, dtype)
        o1 = _round(q1 * cos[None, :], dtype) - _round(q2 * sin[None, :], dtype)
        o2 = _round(q2 * cos[None, :], dtype) + _round(q1 * sin[None, :], dtype)
        tl.store(q1_ptr, o1.to(dtype), mask=q_mask)
        tl.store(q1_ptr + HALF, o2.to(dtype), mask=q_mask)
    else:
        _rotate_heads(q_ptr + tok * stride_qt, stride_qh, cos, sin, offs_r, r_mask,
                      NUM_Q_HEADS, BLOCK_HQ, HALF)  # fmt: skip

    # k: rotate the first 2 * HALF features, keep the rest; write to k (in place) and the cache.
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k_src = k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    k = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    # Partner feature of d under rotate-half: d + HALF in the first half, d - HALF in the second.
    first = offs_d < HALF
    rotated = offs_d < 2 * HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    k_partner = tl.load(
        k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + partner[None, :],
        mask=mask & rotated[None, :],
        other=0.0,
    ).to(tl.float32)
    if QK_NORM:  # RMSNorm of each k head first (the partner shares its head's statistic)
        rstd = tl.rsqrt(tl.sum(k * k, axis=1) * inv_head_dim + norm_eps)[:, None]
        d_ok = offs_d < HEAD_DIM
        w = tl.load(k_norm_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        w_p = tl.load(k_norm_ptr + partner, mask=d_ok & rotated, other=0.0).to(tl.float32)[None, :]
        k = _round(_round(k * rstd, dtype) * w, dtype)
        k_partner = _round(_round(k_partner * rstd, dtype) * w_p, dtype)
    d_half = tl.where(first, offs_d, offs_d - HALF)
    d_half = tl.where(rotated, d_half, 0)
    cos_d = _round(tl.load(cs_row + d_half, mask=rotated, other=1.0).to(tl.float32), dtype)
    sin_d = _round(tl.load(cs_row + HALF + d_half, mask=rotated, other=0.0).to(tl.float32), dtype)
    sign = tl.where(first, -1.0, 1.0)
    # HF: k * cos + rotate_half(k) * sin, each product and the sum rounded to k's dtype.
    k_rot = _round(k * cos_d[None, :], dtype) + _round(
        sign[None, :] * k_partner * sin_d[None, :], dtype
    )
    k_rot = k_rot.to(dtype)  # [BLOCK_H, BLOCK_D]
    tl.debug_barrier()  # every partner load above happens before k is overwritten
    tl.store(k_src, k_rot, mask=mask)

    slot, c_off = _cache_offsets(
        slot_mapping_ptr, tok, stride_cp, stride_cs, stride_ch, offs_h, offs_d, PAGE_SIZE
    )
    if slot >= 0:
        v_src = v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        v = tl.load(v_src, mask=mask)
        tl.store(k_cache_ptr + c_off, k_rot.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + c_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_kv_store(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int32/int64
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]: cos half, then sin half
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = skip the store
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q_w, k_w [head_dim], eps)
) -> tuple[torch.Tensor, torch.Tensor]:  # (q, k), the same tensors, rotated
    """RoPE on q and k (in place) and the K/V store, in one kernel. With ``qk_norm`` each q and k
    head is RMS-normalised first (Qwen3's q_norm / k_norm, HF's rounding points)."""
    check_device(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    _check_cache(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim and positions.shape == (num_tokens,)
    assert q.dtype == k.dtype
    assert q.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    half = rotary_dim // 2
    if qk_norm is not None:
        assert rotary_dim == head_dim, "q/k norm fused with RoPE needs full-width rotary"
        q_norm_w, k_norm_w, eps = qk_norm
        assert q_norm_w.shape == (head_dim,) and k_norm_w.shape == (head_dim,)
    else:
        q_norm_w = k_norm_w = cos_sin_cache  # unused
        eps = 0.0
    _rotary_kv_store_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        q_norm_w,
        k_norm_w,
        eps,
        1.0 / head_dim,  # fp32(1 / n): torch's mean factor, as in kernels/rmsnorm.py
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_R=triton.next_power_of_2(half),
        QK_NORM=qk_norm is not None,
        num_warps=4,
        enable_fp_fusion=False,  # keep each rounded product and sum (no fma), as HF
    )
    return q, k
