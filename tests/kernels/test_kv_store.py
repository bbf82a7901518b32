"""KV store into the paged cache (and the fused RoPE + store) against the torch references."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE
from test_rotary import make_cos_sin_cache

from roofline.kernels.kv_store import rotary_kv_store, rotary_kv_store_ref, store_kv, store_kv_ref


def _setup(dtype: torch.dtype, page_size: int, num_tokens: int = 11, num_kv_heads: int = 3,
           head_dim: int = 32, num_pages: int = 6, seed: int = 0):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[3] = -1  # a padding row: stores nothing
    return k, v, k_cache, v_cache, slots.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [8, 16, 128])
def test_store_kv(dtype: torch.dtype, page_size: int) -> None:
    k, v, k_cache, v_cache, slots = _setup(dtype, page_size)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, k_ref, v_ref, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


def test_store_into_layer_view_of_larger_tensor() -> None:
    """The cache may be one layer's view of a [layers, 2, ...] tensor (non-contiguous pages)."""
    k, v, _, _, slots = _setup(torch.float16, 16, seed=1)
    kv = torch.zeros(2, 6, 2, 16, 3, 32, dtype=torch.float16, device=DEVICE)
    kv_ref = kv.clone()
    store_kv(k, v, kv[1, :, 0], kv[1, :, 1], slots)
    store_kv_ref(k, v, kv_ref[1, :, 0], kv_ref[1, :, 1], slots)
    torch.testing.assert_close(kv, kv_ref, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_kv_store(dtype: torch.dtype, rotary_dim: int) -> None:
    """Bit for bit the reference's (HF's) rounding points, like ``apply_rotary``."""
    k, v, k_cache, v_cache, slots = _setup(dtype, 16, seed=2)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(k.shape[0], 6, k.shape[2], generator=gen).to(dtype).to(DEVICE)
    positions = torch.randint(0, 64, (k.shape[0],), generator=gen).to(DEVICE)
    cache = make_cos_sin_cache(rotary_dim, max_pos=64)
    k_ref_cache, v_ref_cache = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = rotary_kv_store_ref(q, k, v, positions, cache, k_ref_cache, v_ref_cache, slots)
    rotary_kv_store(q, k, v, positions, cache, k_cache, v_cache, slots)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(k_cache, k_ref_cache) and torch.equal(v_cache, v_ref_cache)
