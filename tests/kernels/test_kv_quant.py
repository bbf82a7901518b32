"""Quantized KV cache (fp8 e4m3 / int8 pages with per-token, per-head scales): the store
kernels against ``kv_cache.quantize``, and the decode / prefill attention kernels reading
quantized pages against the torch references over the dequantized cache."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, make_paged
from test_rotary import make_cos_sin_cache

from roofline.kernels.decode_attention import decode_attention, decode_attention_ref
from roofline.kernels.kv_store import rotary_kv_store, rotary_kv_store_ref, store_kv, store_kv_ref
from roofline.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from roofline.quantization.kv_cache import KVCacheSpec, dequantize, quantize

PAGE_DTYPES = [torch.float8_e4m3fn, torch.int8]


def _caches(page_dtype: torch.dtype, num_pages: int, page_size: int, heads: int, dim: int):
    spec = KVCacheSpec.create("fp8" if page_dtype == torch.float8_e4m3fn else "int8", torch.float32)
    data, scales = spec.allocate(1, num_pages, page_size, heads, dim, DEVICE)
    return data[0, 0], data[0, 1], scales[0, 0], scales[0, 1]


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
def test_quantize_round_trip(page_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=gen) * torch.logspace(-3, 3, 7)[:, None, None]
    x[2, 1] = 0.0  # an all-zero head: scale 1, zeros back
    q, s = quantize(x, page_dtype)
    back = dequantize(q, s, torch.float32)
    # int8: half a step of amax / 127; fp8 e4m3: 3 mantissa bits (relative 2^-4) above 2^-6
    amax = x.abs().amax(-1, keepdim=True)
    bound = amax / 254 if page_dtype == torch.int8 else x.abs() / 16 + amax / 448 * 2**-9
    assert torch.all((back - x).abs() <= bound * 1.0001)
    assert torch.all(back[2, 1] == 0)
    assert q.float().abs().amax() == (127 if page_dtype == torch.int8 else 448)


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_quantized(page_dtype: torch.dtype, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(9, 3, 32, generator=gen) * 3).to(dtype).to(DEVICE)
    v = torch.randn(9, 3, 32, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(4 * 8, generator=gen)[:9]
    slots[4] = -1  # padding row: stores nothing
    slots = slots.to(DEVICE)
    got = _caches(page_dtype, 4, 8, 3, 32)
    ref = [t.clone() for t in got]
    store_kv(k, v, *got[:2], slots, *got[2:])
    store_kv_ref(k, v, *ref[:2], slots, *ref[2:])
    for a, b in zip(got, ref):  # bit-exact: fp8 compared as raw bytes
        bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
def test_rotary_kv_store_quantized(page_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(6, 4, 32, generator=gen).to(DEVICE)
    k = torch.randn(6, 2, 32, generator=gen).to(DEVICE)
    v = torch.randn(6, 2, 32, generator=gen).to(DEVICE)
    positions = torch.tensor([0, 5, 9, 17, 3, 30], device=DEVICE)
    cos_sin = make_cos_sin_cache(32, 64)
    slots = torch.tensor([3, 8, -1, 12, 0, 31], device=DEVICE)
    got = _caches(page_dtype, 4, 8, 2, 32)
    ref = [t.clone() for t in got]
    q_ref, k_ref = rotary_kv_store_ref(q, k, v, positions, cos_sin, *ref[:2], slots, *ref[2:])
    rotary_kv_store(q, k, v, positions, cos_sin, *got[:2], slots, k_scale=got[2], v_scale=got[3])
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=0)


def _quantized_batch(page_dtype: torch.dtype, query_lens, context_lens, dtype, seed=0):
    batch = make_paged(query_lens, context_lens, 8, 2, 32, 8, dtype, seed=seed)
    kq, ks = quantize(batch.k_cache, page_dtype)  # garbage pages quantized too: never read
    vq, vs = quantize(batch.v_cache, page_dtype)
    return batch, kq, vq, ks, vs


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_quantized(page_dtype, dtype, num_splits) -> None:
    context_lens = [0, 37, 70, 5]
    batch, kq, vq, ks, vs = _quantized_batch(page_dtype, [1] * 4, context_lens, dtype)
    args = (batch.q, kq, vq, batch.block_table, batch.seq_lens, 0.125)
    out = decode_attention(*args, num_splits=num_splits, k_scale=ks, v_scale=vs)
    ref = decode_attention_ref(*args, k_scale=ks, v_scale=vs)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # and close to attention over the unquantized cache (quantization error only)
    exact = decode_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.block_table,
                                 batch.seq_lens, 0.125)  # fmt: skip
    err = (out.float() - exact.float()).abs().max().item()
    assert err < (0.05 if page_dtype == torch.int8 else 0.15), err


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_quantized(page_dtype, dtype) -> None:
    query_lens, context_lens = [19, 1, 7], [0, 40, 12]
    batch, kq, vq, ks, vs = _quantized_batch(page_dtype, query_lens, context_lens, dtype, seed=3)
    args = (batch.q, kq, vq, batch.block_table, batch.query_start_loc, batch.seq_lens, 0.125)
    out = prefill_attention(*args, max_query_len=max(query_lens), k_scale=ks, v_scale=vs)
    ref = prefill_attention_ref(*args, k_scale=ks, v_scale=vs)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
