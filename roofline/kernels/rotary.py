"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama and Qwen use), in place.

For each token at position ``p`` and each head, the first ``rotary_dim`` features split into
halves ``x1 = x[:r/2]`` and ``x2 = x[r/2:r]`` which become ``x1 * cos - x2 * sin`` and
``x2 * cos + x1 * sin``; features past ``rotary_dim`` (partial rotary) are left alone. ``cos``
and ``sin`` come from ``cos_sin_cache[p] = [cos(p * f_0 .. f_{r/2-1}), sin(...)]`` built by
``roofline/layers/rotary.py`` (any frequency scaling, e.g. llama3, lives in that cache only). One
program per token rotates all of its q and k heads, reading cos/sin once; maths is in fp32 with a
single rounding to the tensor's dtype. q and k may be strided views (e.g. slices of a fused QKV
projection); only the feature dim must be contiguous.
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
    cs = cos_sin_cache[positions.long()].float()  # [T, rotary_dim]
    cos = cs[:, None, :half]  # [T, 1, half]
    sin = cs[:, None, half:]  # [T, 1, half]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half : 2 * half]  # [T, H, half] each
        out = xf.clone()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half : 2 * half] = x2 * cos + x1 * sin
        return out.to(x.dtype)

    return rotate(q), rotate(k)


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
    """Rotate the first 2 * HALF features of NUM_HEADS heads starting at ``base_ptr``."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NUM_HEADS)[:, None] & r_mask[None, :]
    ptr1 = base_ptr + offs_h[:, None] * stride_h + offs_r[None, :]  # [BLOCK_H, BLOCK_R]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(ptr1, o1.to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, o2.to(base_ptr.dtype.element_ty), mask=mask)


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
    cos = tl.load(cache_ptr + pos * stride_cache + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_r, mask=r_mask, other=0.0)
    sin = sin.to(tl.float32)
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
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
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
    )
    return q, k
