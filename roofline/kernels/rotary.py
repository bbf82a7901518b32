"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama and Qwen use), in place.

For each token at position ``p`` and each head, the first ``rotary_dim`` features split into
halves ``x1 = x[:r/2]`` and ``x2 = x[r/2:r]`` which become ``x1 * cos - x2 * sin`` and
``x2 * cos + x1 * sin``; features past ``rotary_dim`` (partial rotary) are left alone. ``cos``
and ``sin`` come from ``cos_sin_cache[p] = [cos(p * f_0 .. f_{r/2-1}), sin(...)]`` built by
``roofline/layers/rotary.py`` (any frequency scaling, e.g. llama3, lives in that cache only). One
program per token rotates all of its q and k heads, reading cos/sin once. q and k may be strided
views (e.g. slices of a fused QKV projection); only the feature dim must be contiguous.

Numerics follow HF's ``apply_rotary_pos_emb`` op by op, so half-precision results are bit-exact
with it: ``cos`` and ``sin`` (fp32 in the cache) are first rounded to q's dtype, as HF casts them;
then each product (``x1 * cos``, ``x2 * sin``, ...) is rounded to that dtype, and so is their sum,
as separate eager ops would store them. The roundings are in-register casts (products of two half
values are exact in fp32, so each cast is the eager op's one rounding; the compiler emits them as
``mul.rn.bf16``-style half ops), and a no-op for fp32. The launch disables mul-add fusion: with it
the compiler would merge a rounded product and the sum into one ``fma`` (a single rounding), in
half precision and in fp32 alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device


def rotary_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]: cos half, then sin half
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated copies of q, k
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.long()].to(q.dtype)  # [T, rotary_dim], rounded as HF does
    cos = cs[:, None, :half]  # [T, 1, half]
    sin = cs[:, None, half:]  # [T, 1, half]

    def rotate(x: torch.Tensor) -> torch.Tensor:  # eager ops in x's dtype, as HF computes
        x1, x2 = x[..., :half], x[..., half : 2 * half]  # [T, H, half] each
        out = x.clone()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half : 2 * half] = x2 * cos + x1 * sin
        return out

    return rotate(q), rotate(k)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round fp32 ``x`` to ``dtype`` and widen it back (what storing an eager op's result does)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(
    base_ptr,
    stride_h,
    cos,
    sin,
    offs_r,
    r_mask,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rotate the first 2 * HALF features of NUM_HEADS heads starting at ``base_ptr``; ``cos``
    and ``sin`` must already be rounded to the heads' dtype."""
    dtype = base_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NUM_HEADS)[:, None] & r_mask[None, :]
    ptr1 = base_ptr + offs_h[:, None] * stride_h + offs_r[None, :]  # [BLOCK_H, BLOCK_R]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = _round(x1 * cos[None, :], dtype) - _round(x2 * sin[None, :], dtype)
    o2 = _round(x2 * cos[None, :], dtype) + _round(x1 * sin[None, :], dtype)
    tl.store(ptr1, o1.to(dtype), mask=mask)
    tl.store(ptr1 + HALF, o2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < HALF
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cache_ptr + pos * stride_cache + offs_r, mask=r_mask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_r, mask=r_mask, other=0.0)
    cos = _round(cos.to(tl.float32), dtype)  # [BLOCK_R], HF's cos.to(q.dtype)
    sin = _round(sin.to(tl.float32), dtype)
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, cos, sin, offs_r, r_mask,
                  NUM_Q_HEADS, BLOCK_HQ, HALF)  # fmt: skip
    _rotate_heads(k_ptr + tok * stride_kt, stride_kh, cos, sin, offs_r, r_mask,
                  NUM_K_HEADS, BLOCK_HK, HALF)  # fmt: skip


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    positions: torch.Tensor,  # [num_tokens] int32/int64
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]: cos half, then sin half
) -> tuple[torch.Tensor, torch.Tensor]:  # (q, k), the same tensors
    check_device(q, k, positions, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rotary_dim = cos_sin_cache.shape[1]
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and positions.shape == (num_tokens,)
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim and q.dtype == k.dtype
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    half = rotary_dim // 2
    block_hq = triton.next_power_of_2(num_q_heads)
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HALF=half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_R=triton.next_power_of_2(half),
        num_warps=4 if block_hq * half <= 2048 else 8,
        enable_fp_fusion=False,  # fp32: no fma, a rounded product then a rounded add, as HF
    )
    return q, k
