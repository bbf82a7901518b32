"""Cascade (shared-prefix) decode attention: the torch reference and the kernel against plain
paged decode over the same block tables.

A batch's member rows begin with the same shared pages and go on with their own pages; other
rows (``suffix_start = 0``) own all their pages. Covers fp32/fp16/bf16, GQA ratios 1 and 4,
prefixes of one page and several, forced prefix and suffix split counts (empty splits
included), the merge kernel and the merge fused into a single suffix split, row counts that
leave a partial row block, and a batch where no row is a member.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels.cascade_attention import cascade_attention, cascade_attention_ref
from roofline.kernels.decode_attention import decode_attention_ref

HEAD_DIM = 128 if ON_GPU else 32


def shared_batch(
    num_reqs: int,
    prefix_pages: int,
    suffix_lens: list[int],
    members: list[bool],
    group: int,
    dtype: torch.dtype,
    page_size: int = 16,
    num_kv_heads: int = 2,
    seed: int = 0,
):
    """(q, k_cache, v_cache, block_table, seq_lens, prefix_pages, prefix_len, suffix_start)."""
    gen = torch.Generator().manual_seed(seed)
    own = [-(-s // page_size) for s in suffix_lens]
    num_pages = prefix_pages + sum(own) + sum(prefix_pages for m in members if not m) + 2
    shape = (num_pages, page_size, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    shared = [perm.pop() for _ in range(prefix_pages)]
    prefix_len = prefix_pages * page_size
    width = prefix_pages + max(own)
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    seq_lens, starts = [], []
    for i in range(num_reqs):
        head = shared if members[i] else [perm.pop() for _ in range(prefix_pages)]
        row = head + [perm.pop() for _ in range(own[i])]
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        seq_lens.append(prefix_len + suffix_lens[i])
        starts.append(prefix_len if members[i] else 0)
    q = torch.randn(num_reqs, num_kv_heads * group, HEAD_DIM, generator=gen).to(dtype)
    i32 = torch.int32
    return (
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE),
        torch.tensor(seq_lens, dtype=i32, device=DEVICE),
        torch.tensor(shared + [0] * 3, dtype=i32, device=DEVICE),
        torch.tensor([prefix_len], dtype=i32, device=DEVICE),
        torch.tensor(starts, dtype=i32, device=DEVICE),
    )  # fmt: skip


def _plain(batch, scale):
    q, kc, vc, table, seq_lens, *_ = batch
    return decode_attention_ref(q, kc, vc, table, seq_lens, scale)


def _cascade(batch, scale, **kwargs):
    q, kc, vc, table, seq_lens, pages, prefix_len, starts = batch
    max_suffix = int((seq_lens - starts).max())
    return cascade_attention(
        q, kc, vc, table, seq_lens, pages, prefix_len, starts, scale,
        max_suffix_len=max_suffix, max_prefix_len=int(prefix_len), **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_plain_decode(group: int) -> None:
    members = [True, False, True, True, False]
    batch = shared_batch(5, 3, [1, 17, 40, 5, 16], members, group, torch.float32)
    scale = HEAD_DIM**-0.5
    q, kc, vc, table, seq_lens, pages, prefix_len, starts = batch
    ref = cascade_attention_ref(q, kc, vc, table, seq_lens, pages, int(prefix_len), starts, scale)
    torch.testing.assert_close(ref, _plain(batch, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [None, 1], ids=["merge-kernel", "fused-merge"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_kernel_matches_plain_decode(dtype: torch.dtype, group: int, num_splits) -> None:
    n = 9  # 9 x group rows: a partial row block
    suffix = [1, 33, 16, 7, 50, 2, 64, 19, 3]
    members = [True] * n
    members[4] = False
    batch = shared_batch(n, 4, suffix, members, group, dtype, seed=group)
    scale = HEAD_DIM**-0.5
    out = _cascade(batch, scale, num_splits=num_splits, prefix_splits=3)
    assert_close(out, _plain(batch, scale), dtype)


@pytest.mark.parametrize("splits", [(1, 1), (3, 2), (2, 7)])
def test_forced_splits(splits: tuple[int, int]) -> None:
    num_splits, prefix_splits = splits
    batch = shared_batch(4, 5, [20, 1, 45, 9], [True] * 4, 4, torch.float32, page_size=8)
    scale = HEAD_DIM**-0.5
    out = _cascade(batch, scale, num_splits=num_splits, prefix_splits=prefix_splits)
    assert_close(out, _plain(batch, scale), torch.float32)


def test_block_m_128_rows_span_many_requests() -> None:
    """128-row tiles (the large-batch config): 40 requests x 4 heads leave a partial block."""
    n = 40
    members = [i % 9 != 0 for i in range(n)]
    batch = shared_batch(n, 2, [1 + (7 * i) % 23 for i in range(n)], members, 4, torch.float32)
    scale = HEAD_DIM**-0.5
    assert_close(_cascade(batch, scale, block_m=128), _plain(batch, scale), torch.float32)


def test_no_member_rows_is_plain_decode() -> None:
    batch = shared_batch(3, 2, [5, 30, 1], [False] * 3, 4, torch.float32)
    scale = HEAD_DIM**-0.5
    assert_close(_cascade(batch, scale), _plain(batch, scale), torch.float32)


def test_triton_backend_runs_the_cascade_of_its_metadata() -> None:
    from roofline.attention.cascade import CascadeMetadata
    from roofline.attention.metadata import AttentionMetadata
    from roofline.attention.triton_backend import TritonAttentionBackend

    n = 6
    batch = shared_batch(n, 3, [3, 9, 1, 20, 5, 2], [True] * n, 4, torch.float32, seed=3)
    q, kc, vc, table, seq_lens, pages, prefix_len, starts = batch
    lens = seq_lens.tolist()
    # the step's new K/V are the ones already in the cache (stored again, same values)
    last = [table[i, (s - 1) // 16].item() * 16 + (s - 1) % 16 for i, s in enumerate(lens)]
    slots = torch.tensor(last, dtype=torch.int64, device=DEVICE)
    k = kc.view(-1, *kc.shape[2:])[slots].clone()
    v = vc.view(-1, *vc.shape[2:])[slots].clone()
    meta = AttentionMetadata(
        num_reqs=n, num_tokens=n,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=seq_lens, block_table=table, slot_mapping=slots, max_query_len=1,
        max_seq_len=max(lens), page_size=16, query_start_loc_cpu=list(range(n + 1)),
        query_lens_cpu=[1] * n, seq_lens_cpu=lens,
        cascade=CascadeMetadata(pages, prefix_len, starts, max(lens) - 48, 48),
    )  # fmt: skip
    scale = HEAD_DIM**-0.5
    out = TritonAttentionBackend().forward(q, k, v, kc, vc, meta, scale)
    assert_close(out, _plain(batch, scale), torch.float32)


@pytest.mark.parametrize(
    "tuning",
    [
        dict(concurrent=True),
        dict(concurrent=True, prefix_splits=1),
        dict(prefix_splits=2, suffix_config=(16, 2, 2)),
    ],
    ids=["concurrent", "concurrent-one-prefix-split", "fixed-splits-suffix-config"],
)
def test_tuning_choices_match_plain_decode(tuning: dict) -> None:
    """The swept launch choices (``TUNING``): the prefix pass beside the suffix pass, every
    slot merged by the merge kernel; a fixed prefix split count; another suffix tile."""
    from roofline.kernels import cascade_attention as ca

    n = 7
    members = [i != 3 for i in range(n)]
    batch = shared_batch(n, 3, [1, 30, 16, 8, 47, 2, 64], members, 4, torch.bfloat16, seed=5)
    scale = HEAD_DIM**-0.5
    saved = ca.TUNING
    ca.TUNING = ca.CascadeTuning(**tuning)
    try:
        out = _cascade(batch, scale, num_splits=1)
    finally:
        ca.TUNING = saved
    assert_close(out, _plain(batch, scale), torch.bfloat16)


@pytest.mark.parametrize("page_dtype", [torch.float8_e4m3fn, torch.int8])
def test_cascade_over_1_byte_pages(page_dtype) -> None:
    """Shared-prefix decode over a quantized cache (the grouped kernels, each K / V row
    dequantized as it is loaded): plain decode over the same pages, and the reference over the
    dequantized cache; some rows not members."""
    from roofline.quantization.kv_cache import quantize

    n, group = 9, 4
    suffix = [1, 33, 16, 7, 50, 2, 64, 19, 3]
    members = [True] * n
    members[4] = False
    q, kc, vc, table, seq_lens, pages, prefix_len, starts = shared_batch(
        n, 4, suffix, members, group, torch.bfloat16, seed=5
    )
    (kq, ks), (vq, vs) = quantize(kc, page_dtype), quantize(vc, page_dtype)
    scale = HEAD_DIM**-0.5
    max_suffix = int((seq_lens - starts).max())
    out = cascade_attention(q, kq, vq, table, seq_lens, pages, prefix_len, starts, scale,
                            max_suffix_len=max_suffix, max_prefix_len=int(prefix_len),
                            k_scale=ks, v_scale=vs).float()  # fmt: skip
    plain = decode_attention_ref(q, kq, vq, table, seq_lens, scale, ks, vs).float()
    torch.testing.assert_close(out, plain, atol=2e-2, rtol=2e-2)
    ref = cascade_attention_ref(q, kq, vq, table, seq_lens, pages, int(prefix_len), starts, scale,
                                ks, vs).float()  # fmt: skip
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    # and the quantization is what the pages hold: far from attending the 16-bit cache exactly
    exact = decode_attention_ref(q, kc, vc, table, seq_lens, scale).float()
    assert (out - exact).abs().max() > (out - plain).abs().max()
