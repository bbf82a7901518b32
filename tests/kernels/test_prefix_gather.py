"""Long chunks' cached prefixes gathered into contiguous rows (``kernels/prefix_gather.py``) and
read through descriptors by the TMA prefill kernel, against the torch reference: a batch with
gathered chunks (prefixes on and off page boundaries), a chunk left on the pages (short), decode
rows and a fresh prompt; the plan's choices; the backend's per-step plan."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close, make_paged

from roofline.kernels import prefix_gather
from roofline.kernels.prefill_attention import prefill_attention, prefill_attention_ref

HEAD_DIM = 128 if ON_GPU else 32
PAGE = 16
# (query_len, context_len): gathered (>= MIN_QUERY_LEN), decode, fresh, gathered off a page
# boundary, a short chunk over a prefix (from the pages)
MIN_Q = 128 if ON_GPU else 64  # the descriptor kernel takes chunks of 64 rows and more
REQUESTS = [(MIN_Q + 9, 53), (1, 40), (30, 0), (MIN_Q, 64), (MIN_Q - 5, 21)]


@pytest.fixture
def small_min_query_len(monkeypatch):
    monkeypatch.setattr(prefix_gather, "MIN_QUERY_LEN", MIN_Q)


def _batch(dtype: torch.dtype, group: int):
    query_lens = [q for q, _ in REQUESTS]
    context_lens = [c for _, c in REQUESTS]
    num_kv_heads = 2
    batch = make_paged(query_lens, context_lens, num_kv_heads * group, num_kv_heads, HEAD_DIM,
                       PAGE, dtype, seed=11)  # fmt: skip
    k = torch.cat([ks[c:] for ks, c in zip(batch.k_seqs, context_lens, strict=True)])
    v = torch.cat([vs[c:] for vs, c in zip(batch.v_seqs, context_lens, strict=True)])
    return batch, k, v  # k, v: [num_tokens, num_kv_heads, head_dim], this step's rows


def test_plan_picks_long_chunks_over_a_prefix(small_min_query_len):
    batch, _, _ = _batch(torch.float32, 1)
    plan = prefix_gather.plan_prefix(batch.block_table, batch.seq_lens_list, batch.query_lens,
                                     PAGE)  # fmt: skip
    assert plan is not None
    # request 0: 53 cached -> 4 pages (64 rows) at row 0; request 3: 64 cached -> 4 pages at 64
    assert plan.start_loc.tolist() == [0, -1, -1, 64, -1]
    assert plan.num_rows == 128
    expected = torch.cat([batch.block_table[0, :4], batch.block_table[3, :4]]).long()
    assert torch.equal(plan.pages.cpu(), expected.cpu())
    gathered = prefix_gather.gather_prefix(plan, batch.k_cache, batch.v_cache)
    assert torch.equal(gathered.k[:53], batch.k_seqs[0][:53])
    assert torch.equal(gathered.v[64:128], batch.v_seqs[3][:64])
    none = prefix_gather.plan_prefix(batch.block_table, [30, 1], [30, 1], PAGE)
    assert none is None  # no context, or too short to pay


def test_has_cached_context_reads_the_host_lists():
    from types import SimpleNamespace

    from roofline.kernels.prefill_attention import has_cached_context

    def meta(seq_lens, query_lens):
        return SimpleNamespace(seq_lens_cpu=seq_lens, query_lens_cpu=query_lens)

    assert not has_cached_context(meta([300, 7], [300, 7]))  # fresh prompts only
    assert has_cached_context(meta([300, 41], [300, 1]))  # a decode row's context
    assert has_cached_context(meta([], []))  # a graph bucket's metadata: not known
    m = meta([5], [5])
    assert not has_cached_context(m)
    m.seq_lens_cpu = [9]  # the same step's metadata object: answered once
    assert not has_cached_context(m)


@pytest.mark.parametrize(
    "dtype,group,variant",
    [(torch.float32, 2, "tma"), (torch.bfloat16, 1, "tma_hf")],
    ids=["fp32-gqa2-tma", "bf16-mha-tma_hf"],
)
def test_gathered_prefix_matches_reference(small_min_query_len, dtype, group, variant):
    batch, k, v = _batch(dtype, group)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, HEAD_DIM**-0.5)  # fmt: skip
    ref = prefill_attention_ref(*args)
    plan = prefix_gather.plan_prefix(batch.block_table, batch.seq_lens_list, batch.query_lens,
                                     PAGE)  # fmt: skip
    prefix = prefix_gather.gather_prefix(plan, batch.k_cache, batch.v_cache)
    blocks = {} if ON_GPU else dict(block_m=16, block_n=16, num_warps=4, num_stages=1)
    max_q = max(batch.query_lens)
    out = prefill_attention(*args, max_q, k_new=k, v_new=v, variant=variant, prefix=prefix,
                            **blocks)  # fmt: skip
    assert_close(out, ref, dtype)
    if dtype == torch.float32:  # the same numbers as reading the prefix from the pages
        paged = prefill_attention(*args, max_q, k_new=k, v_new=v, variant=variant, **blocks)
        torch.testing.assert_close(out, paged, atol=1e-5, rtol=1e-5)
    # The gathered requests' prefixes are read from the gathered rows only: spoil their pages.
    for r in (0, 3):
        pages = batch.block_table[r, : -(-REQUESTS[r][1] // PAGE)].long()
        batch.k_cache[pages] = float("nan")
        batch.v_cache[pages] = float("nan")
    again = prefill_attention(*args, max_q, k_new=k, v_new=v, variant=variant, prefix=prefix,
                              **blocks)  # fmt: skip
    assert torch.equal(again, out)


def test_backend_plans_once_per_step(small_min_query_len, monkeypatch):
    from roofline.attention.metadata import AttentionMetadata

    batch, k, v = _batch(torch.float32, 1)
    calls = []
    real = prefix_gather.plan_prefix

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(prefix_gather, "plan_prefix", counting)
    qsl = batch.query_start_loc.tolist()
    meta = AttentionMetadata(
        num_reqs=len(REQUESTS), num_tokens=qsl[-1], query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_table=batch.block_table,
        slot_mapping=batch.slot_mapping, max_query_len=max(batch.query_lens),
        max_seq_len=max(batch.seq_lens_list), page_size=PAGE, query_start_loc_cpu=qsl,
        query_lens_cpu=batch.query_lens, seq_lens_cpu=batch.seq_lens_list,
    )  # fmt: skip
    gatherer = prefix_gather.PrefixGatherer()
    for _ in range(3):  # three layers of one step
        got = gatherer.gather(batch.q, k, v, batch.k_cache, batch.v_cache, meta)
        assert got is not None and got.k.shape == (128, 2, HEAD_DIM)
    assert len(calls) == 1
    scale = torch.ones(1, device=DEVICE)
    assert gatherer.gather(batch.q, k, v, batch.k_cache, batch.v_cache, meta, scale) is None


def test_split_path_reads_step_rows_and_gathered_prefix(small_min_query_len, monkeypatch):
    """A decode-first mixed step through the split backend: 20 decode rows (the prefill part
    starts past the first tiles, which must exit), a long chunk over a gathered prefix, a
    short one over its pages."""
    from roofline.kernels import prefill_attention_gqa as gqa

    monkeypatch.setattr(gqa, "ENABLED", False)  # these chunks are short: it would pack them
    from roofline.attention.split_backend import SplitAttentionBackend
    from roofline.attention.triton_backend import TritonAttentionBackend
    from roofline.worker.host_batch import HostBatch
    from roofline.worker.mixed_graph import eager_split_metadata

    num_decodes = 20
    query_lens = [1] * num_decodes + [MIN_Q + 3, 17]
    context_lens = [5 + 3 * i for i in range(num_decodes)] + [37, 40]
    b = make_paged(query_lens, context_lens, 4, 2, HEAD_DIM, PAGE, torch.float32, seed=5)
    host = HostBatch(PAGE)
    for q_len, seq_len in zip(query_lens, b.seq_lens_list, strict=True):
        host.input_ids.extend([0] * q_len)
        host.query_start.append(host.query_start[-1] + q_len)
        host.seq_lens.append(seq_len)
    n = host.num_tokens
    as_i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
    bt = b.block_table.to(DEVICE)
    meta = eager_split_metadata(
        host, num_decodes, as_i64(host.query_start), as_i64(host.seq_lens),
        torch.full((n,), -1, dtype=torch.int64, device=DEVICE),
        bt[:num_decodes].clone(), bt[num_decodes:].clone(),
    )  # fmt: skip
    k = torch.cat([ks[c:] for ks, c in zip(b.k_seqs, context_lens, strict=True)])
    v = torch.cat([vs[c:] for vs, c in zip(b.v_seqs, context_lens, strict=True)])
    backend = SplitAttentionBackend(TritonAttentionBackend())
    gathered = []
    real_gather = backend.base.prefix_gather.gather

    def spy(*a, **kw):
        got = real_gather(*a, **kw)
        gathered.append(got)
        return got

    backend.base.prefix_gather.gather = spy
    out = backend.forward(b.q, k, v, b.k_cache, b.v_cache, meta, HEAD_DIM**-0.5)
    ref = prefill_attention_ref(b.q, b.k_cache, b.v_cache, bt, b.query_start_loc,
                                b.seq_lens, HEAD_DIM**-0.5)  # fmt: skip
    assert_close(out, ref, torch.float32)
    (got,) = gathered
    assert got is not None and got.start_loc.tolist() == [0, -1]  # the long chunk only
