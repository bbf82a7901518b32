"""RoPE (rotate-half layout) in place against the torch reference and the HF formulation."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels.rotary import apply_rotary, rotary_ref

MAX_POS = 4096 if ON_GPU else 64


def make_cos_sin_cache(rotary_dim: int, max_pos: int = MAX_POS, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)  # [r/2]
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]  # [max_pos, r/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)  # [max_pos, r]


def _qk(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen).to(DEVICE)
    return q, k, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (32, 8)])
def test_rotary_matches_reference(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    head_dim = 128 if ON_GPU else 32
    q, k, positions = _qk(9, *heads, head_dim, dtype)
    cache = make_cos_sin_cache(head_dim)
    q_ref, k_ref = rotary_ref(q, k, positions, cache)
    q_out, k_out = apply_rotary(q, k, positions, cache)
    assert q_out is q and k_out is k
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)


def test_partial_rotary_and_strided_views() -> None:
    """q/k sliced out of one fused QKV row; only the first rotary_dim features rotate."""
    num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim = 6, 4, 2, 32, 16
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    qkv = qkv.to(torch.float16).to(DEVICE)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    v_before = qkv[:, num_heads + num_kv_heads :].clone()
    positions = torch.arange(num_tokens, device=DEVICE, dtype=torch.int32) * 7
    cache = make_cos_sin_cache(rotary_dim)
    q_ref, k_ref = rotary_ref(q, k, positions, cache)
    apply_rotary(q, k, positions, cache)
    assert_close(q, q_ref, torch.float16)
    assert_close(k, k_ref, torch.float16)
    torch.testing.assert_close(qkv[:, num_heads + num_kv_heads :], v_before, atol=0, rtol=0)


def test_reference_matches_hf_rotate_half() -> None:
    head_dim = 16
    q, k, positions = _qk(5, 2, 1, head_dim, torch.float32, seed=2)
    cache = make_cos_sin_cache(head_dim)
    cos = cache[positions, : head_dim // 2].repeat(1, 2)[:, None, :]  # [T, 1, D] HF layout
    sin = cache[positions, head_dim // 2 :].repeat(1, 2)[:, None, :]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], dim=-1)

    q_ref, k_ref = rotary_ref(q, k, positions, cache)
    torch.testing.assert_close(q_ref, q * cos + rotate_half(q) * sin)
    torch.testing.assert_close(k_ref, k * cos + rotate_half(k) * sin)
