"""Write the new tokens' K/V into the paged cache, optionally fused with RoPE.

``slot_mapping[t]`` is the flat cache slot of new token ``t``: page ``slot // page_size``, row
``slot % page_size`` of ``k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]`` (the
cache may be a strided view, e.g. one layer of a larger tensor; only head_dim must be
contiguous). A negative slot means "padding row, store nothing" (CUDA-graph padding). Values are
cast to the cache dtype on store. One program per token copies all its KV heads.

A quantized cache (fp8 e4m3 or int8 pages, ``roofline/quantization/kv_cache.py``) passes
``k_scale, v_scale: [num_pages, page_size, num_kv_heads]`` fp32: the kernel then quantizes each
head vector with its own scale (``amax / qmax``, IEEE division, clamp, round) as it stores it,
with the same arithmetic as ``kv_cache.quantize``.

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

from roofline.kernels import check_device, is_interpret
from roofline.kernels.pdl import pdl_enabled
from roofline.kernels.rotary import _rotate_heads, _round, rotary_ref
from roofline.quantization.kv_cache import qmax_of, store_quantized_ref


def store_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: torch.Tensor | None = None,  # [num_pages, page_size, num_kv_heads] fp32 (quantized)
    v_scale: torch.Tensor | None = None,
) -> None:
    if k_scale is not None:
        assert v_scale is not None
        store_quantized_ref(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        return
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated copies of q, k
    q_rot, k_rot = rotary_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
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
def _round_to_e4m3(y):
    """Round fp32 ``y`` (|y| <= 448) to the nearest float8 e4m3 value, ties to even, staying in
    fp32: ``(y + C) - C`` with C = 1.5 * 2^23 * the e4m3 step at y's exponent (subnormals below
    2^-6 share the step 2^-9). The cast to fp8 after it is then exact, on the GPU and in the
    interpreter alike (whose own fp8 cast drops the carry when rounding crosses a power of 2)."""
    exp = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of |y|
    exp = tl.maximum(exp, 127 - 6)
    magic = (((exp - 3 + 23) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    return (y + magic) - magic


@triton.jit
def _store_rows(
    cache_ptr,
    scale_ptr,
    c_off,
    slot,
    stride_sp,
    stride_ss,
    offs_h,
    x,
    mask,
    h_mask,
    PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT: tl.constexpr,
):
    """Store ``x [BLOCK_H, BLOCK_D]`` (masked-out entries 0) at ``c_off``; quantized with one
    scale per head (stored at the slot's row of ``scale_ptr``) when ``QUANT``."""
    if QUANT:
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), axis=1)  # [BLOCK_H]
        scale = tl.where(amax > 0.0, tl.math.div_rn(amax, QMAX), 1.0)  # [BLOCK_H]
        y = tl.math.div_rn(xf, scale[:, None])
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if IS_INT:  # round half away from zero (kv_cache.quantize)
            y = tl.where(y >= 0.0, tl.floor(y + 0.5), -tl.floor(0.5 - y))
        else:
            y = _round_to_e4m3(y)
        tl.store(cache_ptr + c_off, y.to(cache_ptr.dtype.element_ty), mask=mask)
        s_off = (slot // PAGE_SIZE) * stride_sp + (slot % PAGE_SIZE) * stride_ss + offs_h
        tl.store(scale_ptr + s_off, scale, mask=h_mask)
    else:
        tl.store(cache_ptr + c_off, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_sp,
    stride_ss,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # Loads first (they do not depend on the slot), so they overlap the slot_mapping load.
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k_src = k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    v_src = v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    k = tl.load(k_src, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_D]
    v = tl.load(v_src, mask=mask, other=0.0)
    slot, c_off = _cache_offsets(
        slot_mapping_ptr, tok, stride_cp, stride_cs, stride_ch, offs_h, offs_d, PAGE_SIZE
    )
    mask = mask & (slot >= 0)
    h_mask = (offs_h < NUM_KV_HEADS) & (slot >= 0)
    _store_rows(k_cache_ptr, k_scale_ptr, c_off, slot, stride_sp, stride_ss, offs_h, k, mask,
                h_mask, PAGE_SIZE, QUANT, QMAX, IS_INT)  # fmt: skip
    _store_rows(v_cache_ptr, v_scale_ptr, c_off, slot, stride_sp, stride_ss, offs_h, v, mask,
                h_mask, PAGE_SIZE, QUANT, QMAX, IS_INT)  # fmt: skip


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


def _scale_args(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int, int, dict]:
    """(k_scale, v_scale, stride_sp, stride_ss, constexprs) for the store kernels; the cache
    itself stands in for the unused scale pointers of a 16/32-bit cache."""
    if k_scale is None:
        assert v_scale is None
        return k_cache, k_cache, 0, 0, {"QUANT": False, "QMAX": 1.0, "IS_INT": False}
    assert v_scale is not None and k_scale.shape == k_cache.shape[:3]
    assert k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
    assert k_scale.dtype == torch.float32 and v_scale.dtype == torch.float32
    quant = {"QUANT": True, "QMAX": qmax_of(k_cache.dtype), "IS_INT": k_cache.dtype == torch.int8}
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1), quant


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], updated in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = skip
    k_scale: torch.Tensor | None = None,  # [num_pages, page_size, num_kv_heads] fp32: quantize
    v_scale: torch.Tensor | None = None,
) -> None:
    check_device(k, v, k_cache, v_cache, slot_mapping)
    _check_cache(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k_s, v_s, stride_sp, stride_ss, quant = _scale_args(k_cache, k_scale, v_scale)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_s,
        v_s,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        stride_sp,
        stride_ss,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
        **quant,
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
    k_scale_ptr,
    v_scale_ptr,
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
    stride_sp,
    stride_ss,
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
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent (see kernels/gemv.py)
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)  # step inputs and the cos/sin table: no
    offs_r = tl.arange(0, BLOCK_R)  # kernel of the step writes them, so read before the wait
    r_mask = offs_r < HALF
    cs_row = cos_sin_ptr + pos * stride_cos_sin
    dtype = k_ptr.dtype.element_ty
    cos = _round(tl.load(cs_row + offs_r, mask=r_mask, other=0.0).to(tl.float32), dtype)
    sin = _round(tl.load(cs_row + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32), dtype)
    if PDL:  # q/k/v come from the previous kernel: wait for it, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
        v = tl.load(v_src, mask=mask, other=0.0)
        k_rot = tl.where(mask, k_rot, 0.0)  # padding heads/features out of the amax
        h_mask = offs_h < NUM_KV_HEADS
        _store_rows(k_cache_ptr, k_scale_ptr, c_off, slot, stride_sp, stride_ss, offs_h, k_rot,
                    mask, h_mask, PAGE_SIZE, QUANT, QMAX, IS_INT)  # fmt: skip
        _store_rows(v_cache_ptr, v_scale_ptr, c_off, slot, stride_sp, stride_ss, offs_h, v,
                    mask, h_mask, PAGE_SIZE, QUANT, QMAX, IS_INT)  # fmt: skip


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
    k_scale: torch.Tensor | None = None,  # [num_pages, page_size, num_kv_heads] fp32: quantize
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (q, k), the same tensors, rotated
    """RoPE on q and k (in place) and the K/V store, in one kernel. With ``qk_norm`` each q and k
    head is RMS-normalised first (Qwen3's q_norm / k_norm, HF's rounding points); with scales
    the stored K/V are quantized (the rotated k, as ``rotary_kv_store_ref``)."""
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
    k_s, v_s, stride_sp, stride_ss, quant = _scale_args(k_cache, k_scale, v_scale)
    pdl = pdl_enabled() and not is_interpret()
    if pdl:
        quant = dict(quant, launch_pdl=True)
    _rotary_kv_store_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        k_s,
        v_s,
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
        stride_sp,
        stride_ss,
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
        PDL=pdl,
        num_warps=4,
        enable_fp_fusion=False,  # keep each rounded product and sum (no fma), as HF
        **quant,
    )
    return q, k
