"""The SDPA prefill strategy (``attention/sdpa_prefill.py``): bucketing, segment planning, the
q/k/v views and padding, and the Triton backends with it on, against the paged fp32 reference.

SDPA's math backend stands in for cuDNN on the CPU (the same call: causal top-left, GQA); the
runs left to Triton go through the interpreter. Rows right of a segment (the padding a bucket
reads in place) hold large values, so a padding or mask-alignment error shows in real rows.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close, make_paged

from roofline.attention import sdpa_prefill as sp
from roofline.attention.metadata import AttentionMetadata
from roofline.attention.split_backend import SplitAttentionBackend
from roofline.attention.triton_backend import TritonAttentionBackend
from roofline.kernels.prefill_attention import prefill_attention_ref
from roofline.worker.host_batch import HostBatch
from roofline.worker.mixed_graph import eager_split_metadata

H, HK, D, PS = 8, 2, 128 if ON_GPU else 32, 16
SCALE = D**-0.5


def test_bucket_len_boundaries_and_padding_bound() -> None:
    assert [sp.bucket_len(n) for n in (1, 128, 129, 2048, 2049, 4096, 4097, 8192, 8193)] == [
        128, 128, 256, 2048, 2304, 4096, 4608, 8192, 9216,
    ]  # fmt: skip
    buckets = sp.bucket_lengths(2048, 8192)
    assert buckets[0] == 2048 and buckets[-1] == 8192 and len(buckets) == 17
    assert buckets == sorted(set(buckets)) and all(b % 128 == 0 for b in buckets)
    for n in range(2048, 8193, 37):
        b = sp.bucket_len(n)
        assert b in buckets and n <= b < n * 1.126
    assert sp.bucket_len(37, per_octave=4, min_granule=8) == 40
    with pytest.raises(ValueError):
        sp.bucket_len(0)


def test_plan_segments_splits_runs_exactly(monkeypatch) -> None:
    # decode over 40, a short fresh prompt, a long fresh one, a chunk over 10 cached tokens, a
    # long fresh one whose bucket (40) would cost (40 / 33)^2 > MAX_PAD_COST, a long fresh last
    query_lens, ctx = [1, 9, 37, 23, 33, 45], [40, 0, 0, 10, 0, 0]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    seq_lens = [q + c for q, c in zip(query_lens, ctx, strict=True)]
    kw = dict(per_octave=4, min_granule=8)
    plan = sp.plan_segments(starts, seq_lens, starts[-1], 32, None, **kw)
    assert plan.segments == [sp.Segment(2, 10, 37, 40), sp.Segment(5, 103, 45, 48)]
    assert plan.runs == [sp.Run(0, 2, 0, 10), sp.Run(3, 5, 47, 103)]
    monkeypatch.setattr(sp, "MAX_PAD_COST", 1.5)  # now 33 -> 40 pays
    loose = sp.plan_segments(starts, seq_lens, starts[-1], 32, None, **kw)
    assert [s.req for s in loose.segments] == [2, 4, 5]
    assert loose.runs == [sp.Run(0, 2, 0, 10), sp.Run(3, 4, 47, 70)]
    only = sp.plan_segments(starts, seq_lens, starts[-1], 32, {48}, **kw)  # warmed buckets only
    assert only.segments == [sp.Segment(5, 103, 45, 48)] and only.runs == [sp.Run(0, 5, 0, 103)]
    assert sp.plan_segments(starts, seq_lens, starts[-1], 64, None, **kw) is None
    # chunks over a cached prefix: 40 over 6 (window 46 -> 48: 48^2 <= 1.25 (40^2 + 2 40 6))
    # qualifies, 32 over 32 (64^2 > 1.25 (32^2 + 2 32 32)) does not
    monkeypatch.setattr(sp, "MAX_PAD_COST", 1.25)
    ctx_plan = sp.plan_segments([0, 40, 72], [46, 64], 72, 32, None, **kw)
    assert ctx_plan.segments == [sp.Segment(0, 0, 40, 48, 6)]
    assert ctx_plan.runs == [sp.Run(1, 2, 40, 72)]
    monkeypatch.setattr(sp, "WITH_CONTEXT", False)
    assert sp.plan_segments([0, 40, 72], [46, 64], 72, 32, None, **kw) is None


def _step(query_lens: list[int], ctx: list[int], dtype: torch.dtype, packed: bool = True):
    """q/k/v of a step (views of one QKV row per token when ``packed``), its metadata and the
    fp32 paged reference; the rows after the step's last request are absent."""
    b = make_paged(query_lens, ctx, H, HK, D, PS, dtype, seed=sum(query_lens))
    k = torch.cat([ks[c:] for ks, c in zip(b.k_seqs, ctx, strict=True)])
    v = torch.cat([vs[c:] for vs, c in zip(b.v_seqs, ctx, strict=True)])
    t = k.shape[0]
    if packed:
        qkv = torch.cat([b.q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
        q, k, v = sp.split_rows(qkv, H, HK, D)
        assert sp.packed_rows(q, k, v) is not None
    else:
        q = b.q
    meta = AttentionMetadata(
        num_reqs=len(query_lens), num_tokens=t, query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens, block_table=b.block_table, slot_mapping=b.slot_mapping,
        max_query_len=max(query_lens), max_seq_len=max(b.seq_lens_list), page_size=PS,
        query_start_loc_cpu=b.query_start_loc.tolist(), query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(b.seq_lens_list),
    )  # fmt: skip
    ref = prefill_attention_ref(q, b.k_cache, b.v_cache, b.block_table, b.query_start_loc,
                                b.seq_lens, SCALE)  # fmt: skip
    return q, k, v, b, meta, ref


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
def test_attend_segment_in_place_and_padded_copy(packed: bool) -> None:
    dtype = torch.float32
    # request 0 (37 rows, bucket 40) reads rows 37..39, request 1's, in place (packed); request
    # 1 (45 rows at the end, bucket 48) goes through a padded copy; request 2 is on its bucket
    q, k, v, b, meta, _ = _step([37, 45, 32], [0, 0, 0], dtype, packed)
    k[37:40] *= 30.0  # keys request 0 must never see: a leak would swamp its softmax
    v[37:40] += 50.0
    b.k_cache.view(-1, HK, D)[b.slot_mapping[37:40]] = k[37:40]  # the pages agree
    b.v_cache.view(-1, HK, D)[b.slot_mapping[37:40]] = v[37:40]
    ref = prefill_attention_ref(q, b.k_cache, b.v_cache, b.block_table, b.query_start_loc,
                                b.seq_lens, SCALE)  # fmt: skip
    kw = dict(per_octave=4, min_granule=8)
    for r, start, n in ((0, 0, 37), (1, 37, 45), (2, 82, 32)):
        seg = sp.Segment(r, start, n, sp.bucket_len(n, **kw))
        o = sp.attend_segment(seg, q, k, v, SCALE)
        assert o.shape == (seg.bucket, H, D) and seg.bucket == (40, 48, 32)[r]
        assert_close(o[:n], ref[start : start + n], dtype)


def test_wrong_padding_or_mask_fails() -> None:
    """The checks above can fail: padding on the left, or no causal mask over a right-padded
    window, changes real rows."""
    q, k, v, b, meta, ref = _step([37, 8], [0, 0], torch.float32)
    assert_close(sp.causal_sdpa(q[:37], k[:37], v[:37], SCALE), ref[:37], torch.float32)
    pad = 3
    qp = torch.cat([torch.randn(pad, H, D), q[:37]])  # left padding
    kp = torch.cat([torch.randn(pad, HK, D) * 30, k[:37]])
    vp = torch.cat([torch.randn(pad, HK, D) + 50, v[:37]])
    left = sp.causal_sdpa(qp, kp, vp, SCALE)[pad:]
    assert not torch.allclose(left, ref[:37], atol=1e-2)
    qh, kh, vh = (t[:40].transpose(0, 1)[None] for t in (q, k, v))  # right-padded, no mask
    unmasked = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=SCALE,
                                                                enable_gqa=True)  # fmt: skip
    assert not torch.allclose(unmasked[0].transpose(0, 1)[:37], ref[:37], atol=1e-2)


def _enable(backend: TritonAttentionBackend, monkeypatch) -> sp.SdpaPrefill:
    monkeypatch.setattr(sp, "BUCKETS_PER_OCTAVE", 4)
    monkeypatch.setattr(sp, "MIN_GRANULE", 8)
    backend.sdpa_prefill = sp.SdpaPrefill(min_query_len=32, enabled=True)
    return backend.sdpa_prefill


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_with_sdpa_segments(dtype: torch.dtype, monkeypatch) -> None:
    # a decode row, a short prompt, a long fresh prompt (in-place padding), a short chunk over
    # a cached prefix (Triton), a long chunk over a short prefix (its window: prefix, rows,
    # padding), a long chunk over a long prefix (Triton), a long fresh prompt last (padded copy)
    query_lens, ctx = [1, 9, 37, 23, 40, 32, 45], [40, 0, 0, 10, 6, 32, 0]
    q, k, v, b, meta, ref = _step(query_lens, ctx, dtype)
    backend = TritonAttentionBackend()
    sdpa = _enable(backend, monkeypatch)
    plan = sdpa.plan(q, meta, False)
    assert [(s.req, s.context) for s in plan.segments] == [(2, 0), (4, 6), (6, 0)]
    assert [(r.first, r.end) for r in plan.runs] == [(0, 2), (3, 4), (5, 6)]
    out = backend.forward(q, k, v, b.k_cache, b.v_cache, meta, SCALE)
    assert sdpa.enabled and out.shape == q.shape
    assert_close(out, ref, dtype)
    backend.sdpa_prefill.enabled = False  # the same step through the Triton kernels alone
    assert_close(backend.forward(q, k, v, b.k_cache, b.v_cache, meta, SCALE), out, dtype)


@pytest.mark.parametrize("ctx", [0, 6, 12], ids=["fresh", "prefix-6", "prefix-12"])
def test_one_chunk_is_the_whole_step(ctx: int, monkeypatch) -> None:
    # 40 new rows: fresh (bucket 40, in place) or over 6 / 12 cached (windows 46, 52 -> 48, 56)
    q, k, v, b, meta, ref = _step([40], [ctx], torch.float32)
    backend = TritonAttentionBackend()
    sdpa = _enable(backend, monkeypatch)
    plan = sdpa.plan(q, meta, False)
    assert plan.segments == [sp.Segment(0, 0, 40, (40, 48, 56)[(0, 6, 12).index(ctx)], ctx)]
    assert sdpa.whole_step(plan)
    out = backend.forward(q, k, v, b.k_cache, b.v_cache, meta, SCALE)
    assert_close(out, ref, torch.float32)


def test_whole_step_on_a_bucket_boundary(monkeypatch) -> None:
    q, k, v, b, meta, ref = _step([48], [0], torch.float32)
    backend = TritonAttentionBackend()
    sdpa = _enable(backend, monkeypatch)
    plan = sdpa.plan(q, meta, False)
    assert plan.segments == [sp.Segment(0, 0, 48, 48)] and sdpa.whole_step(plan)
    assert_close(backend.forward(q, k, v, b.k_cache, b.v_cache, meta, SCALE), ref, torch.float32)
    assert sdpa.plan(q, meta, True) is None  # a quantized cache keeps the Triton path


def test_split_backend_decode_first_with_sdpa(monkeypatch) -> None:
    query_lens, ctx = [1, 1, 37, 5, 40], [40, 17, 0, 3, 0]
    q, k, v, b, meta, ref = _step(query_lens, ctx, torch.float32)
    host = HostBatch(PS)
    for n, s in zip(query_lens, b.seq_lens_list, strict=True):
        host.input_ids.extend([0] * n)
        host.query_start.append(host.query_start[-1] + n)
        host.seq_lens.append(s)
    i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
    split = eager_split_metadata(host, 2, i64(host.query_start), i64(host.seq_lens),
                                 b.slot_mapping, b.block_table[:2].clone(),
                                 b.block_table[2:].clone())  # fmt: skip
    base = TritonAttentionBackend()
    sdpa = _enable(base, monkeypatch)
    plan = sdpa.plan(q, split, False)
    assert [(s.req, s.start) for s in plan.segments] == [(0, 2), (2, 44)]
    assert plan.runs == [sp.Run(1, 2, 39, 44)]
    out = SplitAttentionBackend(base).forward(q, k, v, b.k_cache, b.v_cache, split, SCALE)
    assert_close(out, ref, torch.float32)


def test_warm_up_builds_every_bucket_then_plans_only_those(monkeypatch) -> None:
    sdpa = _enable(TritonAttentionBackend(), monkeypatch)
    assert sdpa.warm_up(H, HK, D, torch.float32, torch.device("cpu"), 50) == 4
    assert sdpa.ready == {32, 40, 48, 56} and set(sdpa.warmup_s) == sdpa.ready
    q, k, v, b, meta, ref = _step([60], [0], torch.float32)  # bucket 64: not built
    assert sdpa.plan(q, meta, False) is None


@pytest.mark.parametrize("mode", ["full", "full_decode_only"], ids=["split", "in-order"])
def test_runs_beside_sdpa_segments_launch_only_warmed_kernel_variants(
    tmp_path, monkeypatch, mode: str
) -> None:
    """With the path on, the Triton launches of a step's leftover runs (their own metadata,
    row slices) find every compiled variant among the warm-up's (``worker/warmup.py``, run with
    the path on as at start-up): no JIT compile mid-serving. Fresh prompts of 400+ rows go to
    SDPA (the warm-up's own long chunk, 273 rows, stays below)."""
    import test_warmup_specializations as ws

    from roofline.kernels import prefill_attention, prefill_attention_gqa
    from roofline.worker.warmup import warmup_batches
    from tests.e2e.hf_reference import tiny_hf_model

    for module in (prefill_attention, prefill_attention_gqa):  # the GPU's tiles, no launches
        monkeypatch.setattr(module, "is_interpret", lambda: False)
    monkeypatch.setattr(sp, "ENABLED", True)
    monkeypatch.setattr(sp, "MIN_QUERY_LEN", 400)
    tiny_hf_model("llama", tmp_path, num_hidden_layers=1, head_dim=128, hidden_size=256,
                  num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=ws.MAX_LEN)  # fmt: skip
    runner = ws._runner(tmp_path, mode)
    split = runner.mixed is not None
    assert runner.backend.sdpa_prefill.enabled and split == (mode == "full")
    limit = min(runner.num_pages * ws.PAGE, ws.MAX_LEN)
    warm = set(ws._keys(runner, warmup_batches(32, limit, ws.PAGE, runner.num_pages, split)))
    planned = []
    original = sp.SdpaPrefill.plan

    def plan(self, *a):  # noqa: ANN001, ANN002, ANN202
        p = original(self, *a)
        planned.append(p is not None)
        return p

    monkeypatch.setattr(sp.SdpaPrefill, "plan", plan)
    missing = {}
    for batch in ws._odd_batches(11, split, 24):
        for key in ws._keys(runner, [batch]):
            if key not in warm:
                missing.setdefault(key, batch)
    assert any(planned), "no odd step sent a segment to SDPA"
    report = "\n".join(f"{k.diff(warm)}\n    first in {b}" for k, b in missing.items())
    assert not missing, "variants the warm-up did not compile:\n" + report


def test_a_step_loop_on_another_thread_builds_its_buckets_once(monkeypatch) -> None:
    """cuDNN's graphs are per thread in torch: the first plan on a thread the warm-up did not
    run on warms that thread (once), then plans as on the warm-up's."""
    import threading

    sdpa = _enable(TritonAttentionBackend(), monkeypatch)
    assert sdpa.warm_up(H, HK, D, torch.float32, torch.device("cpu"), 50) == 4
    calls = []
    original = sdpa.warm_up
    monkeypatch.setattr(sdpa, "warm_up", lambda *a: calls.append(a) or original(*a))
    q, k, v, b, meta, ref = _step([40], [0], torch.float32)
    assert sdpa.plan(q, meta, False) is not None and not calls  # the warm-up's thread
    plans = []

    def serve() -> None:
        for _ in range(2):
            sdpa._step = None
            plans.append(sdpa.plan(q, meta, False))

    t = threading.Thread(target=serve)
    t.start()
    t.join()
    assert len(calls) == 1 and all(p is not None for p in plans) and len(plans) == 2


def test_a_run_with_a_gathered_prefix_beside_a_segment(monkeypatch) -> None:
    """A run's chunk long enough for a gathered prefix (``prefix_gather.py``: 128+ rows over
    100 cached, too long a prefix for a window; past the packed kernel's short chunks) reads
    its slice of the step's gathered rows."""
    q, k, v, b, meta, ref = _step([37, 300], [0, 100], torch.bfloat16)
    backend = TritonAttentionBackend()
    sdpa = _enable(backend, monkeypatch)
    plan = sdpa.plan(q, meta, False)
    assert plan.segments == [sp.Segment(0, 0, 37, 40, 0)] and plan.runs == [sp.Run(1, 2, 37, 337)]
    gathered = []
    gather = backend.prefix_gather.gather
    monkeypatch.setattr(backend.prefix_gather, "gather",
                        lambda *a: gathered.append(gather(*a)) or gathered[-1])  # fmt: skip
    out = backend.forward(q, k, v, b.k_cache, b.v_cache, meta, SCALE)
    assert gathered and gathered[0] is not None and gathered[0].start_loc.tolist() == [-1, 0]
    assert_close(out, ref, torch.bfloat16)
