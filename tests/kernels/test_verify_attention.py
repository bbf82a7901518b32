"""Multi-query (verification) decode attention: the reference against dense causal SDPA, the
kernel against the reference, with one and several splits, GQA groups, bf16 and fp32, and
quantized pages."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import ON_GPU, assert_close, dense_causal_sdpa, make_paged

from roofline.kernels.verify_attention import verify_attention, verify_attention_ref

HEAD_DIM = 128 if ON_GPU else 32
CONTEXTS = [0, 700, 2049, 33, 4100] if ON_GPU else [0, 37, 70, 16]


def _batch(dtype: torch.dtype, group: int, query_len: int, seed: int = 0):
    n = len(CONTEXTS)
    return make_paged([query_len] * n, CONTEXTS, 2 * group, 2, HEAD_DIM, 16, dtype, seed=seed)


@pytest.mark.parametrize("query_len", [2, 5])
def test_reference_matches_dense_sdpa(query_len: int) -> None:
    batch = _batch(torch.float32, 4, query_len)
    scale = HEAD_DIM**-0.5
    ref = verify_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale, query_len
    )
    torch.testing.assert_close(ref, dense_causal_sdpa(batch, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "group", "query_len", "num_splits"),
    [
        (torch.float32, 4, 5, None),
        (torch.float32, 1, 3, 3),
        (torch.bfloat16, 4, 5, 2),
        (torch.bfloat16, 8, 9, None),  # 72 rows per program: the wide-block config
    ],
)
def test_kernel_matches_reference(dtype, group: int, query_len: int, num_splits) -> None:
    batch = _batch(dtype, group, query_len, seed=group + query_len)
    scale = HEAD_DIM**-0.5
    ref = verify_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale, query_len
    )
    out = verify_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale,
        query_len, max_seq_len=max(batch.seq_lens_list), num_splits=num_splits,
    )  # fmt: skip
    assert_close(out, ref, dtype)


def test_fixed_grid_bounded_by_device_lengths() -> None:
    """Under graph capture the split length comes from max_model_len, not the step: a grid far
    larger than the contexts must give the same result."""
    batch = _batch(torch.float32, 2, 4, seed=7)
    scale = HEAD_DIM**-0.5
    ref = verify_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale, 4
    )
    out = verify_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale, 4,
        max_seq_len=8 * max(batch.seq_lens_list), num_splits=4,
    )  # fmt: skip
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("page_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_pages(page_dtype, dtype, monkeypatch) -> None:
    """1-byte pages: fp32 queries widen them through fp32; 16-bit queries to fp16 in the load
    layout (``decode_attention.KV_F16``, V's scales normalised per tile: V scaled by 1e-3 here
    too) or through fp32 (``KV_F16`` off), both against the reference over the same pages."""
    from test_kv_quant import _quantized_batch

    from roofline.kernels import decode_attention as da
    from roofline.quantization.kv_cache import quantize

    query_len = 3
    batch, kq, vq, ks, vs = _quantized_batch(
        page_dtype, [query_len] * 3, [0, 37, 12], dtype, seed=5
    )
    cases = [(1.0, True)] if dtype == torch.float32 else [(1.0, True), (1.0, False), (1e-3, True)]
    for v_mul, f16 in cases:
        monkeypatch.setattr(da, "KV_F16", f16)
        if v_mul != 1.0:
            vq, vs = quantize(batch.v_cache * v_mul, page_dtype)
        args = (batch.q, kq, vq, batch.block_table, batch.seq_lens, 0.125, query_len)
        out = verify_attention(*args, max_seq_len=max(batch.seq_lens_list), num_splits=2,
                               k_scale=ks, v_scale=vs)  # fmt: skip
        ref = verify_attention_ref(*args, k_scale=ks, v_scale=vs)
        tol = 2e-5 if dtype == torch.float32 else 2e-2 * v_mul
        torch.testing.assert_close(
            out.float(), ref.float(), atol=tol, rtol=2e-5 if tol < 1e-4 else 2e-2
        )
