"""RoPE (rotate-half layout) in place against the torch reference and the HF formulation, bit for
bit: HF rounds cos/sin to q's dtype and each product and sum after it, and so must we."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU

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
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


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
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    torch.testing.assert_close(qkv[:, num_heads + num_kv_heads :], v_before, atol=0, rtol=0)


def _hf_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor):
    """HF's apply_rotary_pos_emb with LlamaRotaryEmbedding's cos/sin (fp32, then cast to q's
    dtype): ``q * cos + rotate_half(q) * sin`` as eager ops in q's dtype."""
    half = cache.shape[1] // 2
    cos = cache[positions.long(), :half].repeat(1, 2)[:, None, :].to(q.dtype)  # [T, 1, D]
    sin = cache[positions.long(), half:].repeat(1, 2)[:, None, :].to(q.dtype)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bit_exact_with_hf_apply_rotary_pos_emb(dtype: torch.dtype) -> None:
    head_dim = 64
    q, k, positions = _qk(7, 9, 3, head_dim, dtype, seed=2)
    q = q * 20  # larger values: more products land near a rounding boundary
    cache = make_cos_sin_cache(head_dim)
    q_hf, k_hf = _hf_rotary(q, k, positions, cache)
    q_ref, k_ref = rotary_ref(q, k, positions, cache)
    assert torch.equal(q_ref, q_hf) and torch.equal(k_ref, k_hf)
    apply_rotary(q, k, positions, cache)
    assert torch.equal(q, q_hf) and torch.equal(k, k_hf)


def test_single_rounding_would_differ_from_hf() -> None:
    """The reason for the per-op roundings: fp32 maths rounded once to bf16 is not HF's result."""
    head_dim = 64
    q, k, positions = _qk(7, 9, 3, head_dim, torch.bfloat16, seed=2)
    cache = make_cos_sin_cache(head_dim)
    q_hf, _ = _hf_rotary(q, k, positions, cache)
    half = head_dim // 2
    cs = cache[positions.long()][:, None, :]  # [T, 1, D] fp32
    cos, sin = cs[..., :half], cs[..., half:]
    x1, x2 = q.float()[..., :half], q.float()[..., half:]
    once = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(torch.bfloat16)
    assert not torch.equal(once, q_hf)
