"""GQA-packed prefill attention (``kernels/prefill_attention_gqa.py``) against the torch reference
of ``prefill_attention``: chunks over cached contexts, fresh prompts, decode rows, an empty
request, GQA ratios 2, 3 (a tile with padding rows) and 4, fp32/bf16, a quantized cache."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels.prefill_attention import prefill_attention_ref
from roofline.kernels.prefill_attention_gqa import applies, prefill_attention_gqa

HEAD_DIM = 128 if ON_GPU else 32


def _batch(query_lens, context_lens, num_kv_heads, group, dtype, page_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    pages_per = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per) + 2
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(seq_lens), max(max(pages_per), 1), dtype=torch.int32)
    nxt = 0
    for i, n in enumerate(pages_per):
        table[i, :n] = perm[nxt : nxt + n].to(torch.int32)
        nxt += n
    shape = (num_pages, page_size, num_kv_heads, HEAD_DIM)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), num_kv_heads * group, HEAD_DIM, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, kc, vc, table, qsl, lens)]


@pytest.mark.parametrize(
    "group,dtype", [(4, torch.float32), (2, torch.bfloat16), (3, torch.float32)]
)
def test_gqa_prefill_matches_reference(group, dtype) -> None:
    query_lens = [17, 1, 40, 0, 5, 33]
    context_lens = [48, 30, 0, 4, 71, 16]
    q, kc, vc, table, qsl, lens = _batch(query_lens, context_lens, 2, group, dtype, seed=group)
    scale = HEAD_DIM**-0.5
    out = prefill_attention_gqa(q, kc, vc, table, qsl, lens, scale)
    ref = prefill_attention_ref(q, kc, vc, table, qsl, lens, scale)
    assert_close(out, ref, dtype)


def test_gqa_prefill_quantized_cache() -> None:
    from roofline.quantization.kv_cache import quantize

    q, kc, vc, table, qsl, lens = _batch([9, 20, 3], [40, 5, 60], 2, 4, torch.float32, seed=5)
    kq, ks = quantize(kc, torch.int8)
    vq, vs = quantize(vc, torch.int8)
    scale = HEAD_DIM**-0.5
    out = prefill_attention_gqa(q, kq, vq, table, qsl, lens, scale, k_scale=ks, v_scale=vs)
    ref = prefill_attention_ref(q, kq, vq, table, qsl, lens, scale, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


def test_applies_to_grouped_heads_and_mostly_short_chunks() -> None:
    assert applies(32, 8, [64] * 10) and not applies(32, 32, [64] * 10)
    assert applies(32, 8, [2064] + [64] * 96)  # the preset's first admission step
    assert not applies(32, 8, [8192]) and not applies(32, 8, [2064] + [64] * 10)
    assert not applies(32, 8, [])


def test_step_choice_is_made_once_per_step(monkeypatch) -> None:
    from types import SimpleNamespace

    from roofline.kernels import prefill_attention_gqa as gqa

    choice = gqa.StepChoice()
    q, kc = torch.empty(3, 8, 4), torch.empty(1, 16, 2, 4)
    meta = SimpleNamespace(max_query_len=64, query_lens_cpu=[64])
    assert choice(q, kc, meta)
    meta.query_lens_cpu = [8192]  # the same step object: the remembered choice
    assert choice(q, kc, meta)
    assert not choice(q, kc, SimpleNamespace(max_query_len=8192, query_lens_cpu=[8192]))
    assert not choice(q, kc, SimpleNamespace(max_query_len=1, query_lens_cpu=[1, 1]))
    monkeypatch.setattr(gqa, "ENABLED", False)
    assert not choice(q, kc, SimpleNamespace(max_query_len=64, query_lens_cpu=[64]))


def test_graph_buckets_pack_only_when_asked(monkeypatch) -> None:
    from roofline.kernels import prefill_attention_gqa as gqa

    monkeypatch.setattr(gqa, "IN_GRAPHS", False)
    assert not gqa.in_graph_bucket(32, 8)
    monkeypatch.setattr(gqa, "IN_GRAPHS", True)
    assert gqa.in_graph_bucket(32, 8) and not gqa.in_graph_bucket(32, 32)
    monkeypatch.setattr(gqa, "ENABLED", False)
    assert not gqa.in_graph_bucket(32, 8)
