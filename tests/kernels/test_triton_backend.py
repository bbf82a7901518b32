"""TritonAttentionBackend end to end: stores the step's K/V, then attends (decode-only and mixed).

Compared with the kernels' torch references and with the lead's ``TorchAttentionBackend`` on the
same metadata, for a decode-only step and a mixed prefill / chunked-prefill / decode step.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import ON_GPU, PagedBatch, assert_close, dense_causal_sdpa, make_paged

from roofline.attention.metadata import AttentionMetadata
from roofline.attention.triton_backend import TritonAttentionBackend

HEAD_DIM = 128 if ON_GPU else 32


def _metadata(batch: PagedBatch, page_size: int) -> AttentionMetadata:
    qsl = batch.query_start_loc.tolist()
    return AttentionMetadata(
        num_reqs=len(batch.query_lens),
        num_tokens=sum(batch.query_lens),
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        slot_mapping=batch.slot_mapping,
        max_query_len=max(batch.query_lens),
        max_seq_len=max(batch.seq_lens_list),
        page_size=page_size,
        query_start_loc_cpu=qsl,
        query_lens_cpu=list(batch.query_lens),
        seq_lens_cpu=list(batch.seq_lens_list),
    )


def _new_kv(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's new K/V rows; their cache slots are then overwritten with garbage."""
    lens = list(zip(batch.seq_lens_list, batch.query_lens, strict=True))
    k = torch.cat([ks[s - q :] for ks, (s, q) in zip(batch.k_seqs, lens, strict=True)])
    v = torch.cat([vs[s - q :] for vs, (s, q) in zip(batch.v_seqs, lens, strict=True)])
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    batch.k_cache.view(-1, num_kv_heads, head_dim)[batch.slot_mapping] = 1e4
    batch.v_cache.view(-1, num_kv_heads, head_dim)[batch.slot_mapping] = -1e4
    return k, v


@pytest.mark.parametrize(
    "query_lens,context_lens",
    [([1, 1, 1], [0, 40, 17]), ([9, 1, 23, 1], [0, 35, 10, 3])],
    ids=["decode", "mixed"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend(query_lens: list[int], context_lens: list[int], dtype: torch.dtype) -> None:
    page_size = 16
    batch = make_paged(query_lens, context_lens, 8, 2, HEAD_DIM, page_size, dtype, seed=4)
    meta = _metadata(batch, page_size)
    k, v = _new_kv(batch)
    scale = HEAD_DIM**-0.5
    out = TritonAttentionBackend().forward(batch.q, k, v, batch.k_cache, batch.v_cache, meta, scale)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert_close(out, dense_causal_sdpa(batch, scale), dtype)

    torch_backend = pytest.importorskip("roofline.attention.torch_backend")
    k_cache2, v_cache2 = batch.k_cache.clone(), batch.v_cache.clone()
    expected = torch_backend.TorchAttentionBackend().forward(
        batch.q, k, v, k_cache2, v_cache2, meta, scale
    )
    assert_close(out, expected, dtype)
    torch.testing.assert_close(batch.k_cache, k_cache2, atol=0, rtol=0)


@pytest.mark.parametrize(
    "dtype,qk_norm,first_len",
    [(torch.float32, False, 9), (torch.bfloat16, False, 9), (torch.float32, True, 9),
     (torch.bfloat16, True, 9), (torch.bfloat16, True, 70)],
    ids=["fp32-rope", "bf16-rope", "fp32-qk-norm+rope", "bf16-qk-norm+rope",
         "bf16-qk-norm+rope-long"],
)  # fmt: skip
def test_backend_with_fused_rope(dtype: torch.dtype, qk_norm: bool, first_len: int) -> None:
    """Given ``rope``, the backend rotates q/k inside its KV store (after Qwen3's per-head q/k
    RMSNorm when asked): the same output and cache as the RMSNorm and RotaryEmbedding modules
    applied first and the torch backend given the result. A query of 70 rows takes the default
    prefill variant, which reads the step's keys from ``k`` as the store left them (rotated)."""
    from roofline.attention.torch_backend import TorchAttentionBackend
    from roofline.layers.norm import RMSNorm
    from roofline.layers.rotary import RotaryEmbedding

    page_size = 16
    batch = make_paged([first_len, 1, 23, 1], [0, 35, 10, 3], 8, 2, HEAD_DIM, page_size, dtype,
                       seed=5)  # fmt: skip
    meta = _metadata(batch, page_size)
    k, v = _new_kv(batch)
    lens = zip(batch.seq_lens_list, batch.query_lens, strict=True)
    positions = torch.cat([torch.arange(s - q, s) for s, q in lens]).to(batch.q.device)
    rotary = RotaryEmbedding(HEAD_DIM, 128, 10000.0, None).to(batch.q.device)
    rotary.reset_cache()
    scale = HEAD_DIM**-0.5
    q_ref, k_ref = batch.q.clone(), k.clone()
    norms = None
    if qk_norm:
        gen = torch.Generator().manual_seed(3)
        q_norm, k_norm = RMSNorm(HEAD_DIM, 1e-6), RMSNorm(HEAD_DIM, 1e-6)
        for m in (q_norm, k_norm):
            m.weight.data = (1 + 0.5 * torch.randn(HEAD_DIM, generator=gen)).to(dtype)
            m.to(batch.q.device)
        q_ref, k_ref = q_norm.forward_native(q_ref), k_norm.forward_native(k_ref)
        norms = (q_norm.weight, k_norm.weight, 1e-6)
    q_ref, k_ref = rotary.forward_native(positions, q_ref, k_ref)
    k_cache2, v_cache2 = batch.k_cache.clone(), batch.v_cache.clone()
    expected = TorchAttentionBackend().forward(q_ref, k_ref, v, k_cache2, v_cache2, meta, scale)
    out = TritonAttentionBackend().forward(
        batch.q, k, v, batch.k_cache, batch.v_cache, meta, scale,
        rope=(positions, rotary.cos_sin_cache, norms),
    )  # fmt: skip
    assert_close(out, expected, dtype)
    if qk_norm:  # the sum of squares is ordered differently: the norm may move by one ulp
        assert_close(batch.k_cache, k_cache2, dtype)
    else:
        torch.testing.assert_close(batch.k_cache, k_cache2, atol=0, rtol=0)


@pytest.mark.parametrize(
    "page_dtype,context_lens",
    [(torch.float8_e4m3fn, [0, 0]), (torch.int8, [0, 0]), (torch.float8_e4m3fn, [0, 21])],
    ids=["fp8-fresh", "int8-fresh", "fp8-cached"],
)
def test_backend_prefill_over_1_byte_pages(page_dtype, context_lens, monkeypatch) -> None:
    """A prefill step over a quantized cache: fresh steps attend their rows read back from the
    pages and dequantized (``fresh_rows_dequantized``, the descriptor kernel), which must equal
    the paged kernel reading the pages, and the reference over the dequantized cache; a step
    with cached context keeps the paged kernel."""
    from roofline.attention import triton_backend as tb
    from roofline.kernels.prefill_attention import prefill_attention_ref
    from roofline.quantization.kv_cache import KVCacheSpec

    page_size = 16
    query_lens = [264, 8]  # mostly long chunks: not the GQA-packed kernel (MAX_QUERY_LEN)
    batch = make_paged(query_lens, context_lens, 8, 2, HEAD_DIM, page_size, torch.bfloat16, 5)
    meta = _metadata(batch, page_size)
    k, v = _new_kv(batch)
    spec = KVCacheSpec.create("fp8" if page_dtype == torch.float8_e4m3fn else "int8",
                              torch.bfloat16)  # fmt: skip
    num_pages = batch.k_cache.shape[0]
    data, scales = spec.allocate(1, num_pages, page_size, 2, HEAD_DIM, batch.q.device)
    kc, vc, ks, vs = data[0, 0], data[0, 1], scales[0, 0], scales[0, 1]
    # the cached context as the store would have left it, from the batch's 16-bit cache
    from roofline.quantization.kv_cache import quantize

    (kq, kqs), (vq, vqs) = quantize(batch.k_cache, page_dtype), quantize(batch.v_cache, page_dtype)
    kc.copy_(kq), vc.copy_(vq), ks.copy_(kqs), vs.copy_(vqs)
    scale = HEAD_DIM**-0.5
    outs, used = {}, {}
    for on in (False, True):
        monkeypatch.setattr(tb, "DEQUANT_FRESH", on)
        calls = []
        real = tb.fresh_rows_dequantized

        def spy(*a, _real=real, _calls=calls):
            got = _real(*a)
            _calls.append(got is not None)
            return got

        monkeypatch.setattr(tb, "fresh_rows_dequantized", spy)
        kcc, vcc = kc.clone(), vc.clone()
        kss, vss = ks.clone(), vs.clone()
        outs[on] = (
            tb.TritonAttentionBackend()
            .forward(batch.q, k, v, kcc, vcc, meta, scale, kv_scales=(kss, vss))
            .float()
        )
        used[on] = any(calls)
    fresh = sum(context_lens) == 0
    assert used[True] == fresh and not used[False]
    ref = prefill_attention_ref(batch.q, kcc, vcc, batch.block_table, batch.query_start_loc,
                                batch.seq_lens, scale, kss, vss).float()  # fmt: skip
    for on in (False, True):
        torch.testing.assert_close(outs[on], ref, atol=2e-2, rtol=2e-2)
    # the same keys either way (up to summation order and the output's rounding; attending
    # the step's unquantized rows instead failed this)
    torch.testing.assert_close(outs[True], outs[False], atol=4e-3, rtol=4e-3)
