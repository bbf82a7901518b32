"""Fresh prompts through torch SDPA (``attention/fresh_prefill.py``): which steps qualify, and
the per-request causal attention over the step's strided q/k/v views (grouped-query heads)
written into the output at each request's rows, against the paged torch reference. On the CPU
the math backend stands in for cuDNN."""

from __future__ import annotations

import torch
from kernel_utils import DEVICE, ON_GPU, assert_close, make_paged

from roofline.attention import fresh_prefill
from roofline.kernels.prefill_attention import prefill_attention_ref


def test_which_steps_qualify(monkeypatch):
    monkeypatch.setattr(fresh_prefill, "MIN_QUERY_LEN", 4)
    ok = fresh_prefill.fresh_and_long
    assert ok([8, 5], [8, 5])
    assert not ok([9, 5], [8, 5])  # a cached prefix
    assert not ok([8, 3], [8, 3])  # too short
    assert not ok([], [])  # a captured graph's metadata
    assert not ok([8] * 5, [8] * 5)  # too many requests
    monkeypatch.delenv("ROOFLINE_FRESH_PREFILL", raising=False)
    assert not fresh_prefill.enabled()
    monkeypatch.setenv("ROOFLINE_FRESH_PREFILL", "cudnn")
    assert fresh_prefill.enabled()


def test_attend_matches_reference(monkeypatch):
    if not ON_GPU:
        monkeypatch.setattr(fresh_prefill, "_backend", lambda: torch.nn.attention.SDPBackend.MATH)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    query_lens, head_dim = [37, 20], 32
    b = make_paged(query_lens, [0, 0], 8, 2, head_dim, 16, dtype, seed=3)
    n = sum(query_lens)
    # q, k, v as views of one QKV row, the model's layout
    k = torch.cat([ks for ks in b.k_seqs])
    v = torch.cat([vs for vs in b.v_seqs])
    qkv = torch.cat([b.q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=1)
    q_v, k_v, v_v = qkv.to(DEVICE).split([8 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    q_v, k_v, v_v = (t.view(n, -1, head_dim) for t in (q_v, k_v, v_v))
    out = torch.full_like(q_v, float("nan"))
    fresh_prefill.attend(q_v, k_v, v_v, [0, 37, 57], head_dim**-0.5, out)
    ref = prefill_attention_ref(b.q, b.k_cache, b.v_cache, b.block_table, b.query_start_loc,
                                b.seq_lens, head_dim**-0.5)  # fmt: skip
    assert_close(out.cpu(), ref.cpu(), dtype)
