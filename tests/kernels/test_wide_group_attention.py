"""The fused decode attention at a wide GQA group (Qwen3-30B-A3B: 32 query heads on 4 KV heads,
group 8), as shipped: the last split merges all the group's heads at once
(``MERGE_BY_SPLIT_GROUPS``) at 8 warps (``WIDE_GROUP_WARPS``). Against the unfused torch
reference, against the per-head merge in fp32, the engine's shape taking the fused path, and
the sm_90 compile."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close, make_paged
from test_rotary import make_cos_sin_cache

from roofline.kernels import decode_attention_fused as fused
from roofline.kernels import last_program

HEAD_DIM = 128 if ON_GPU else 32
PAGE_SIZE = 16


def _case(context_lens: list[int], num_heads: int, num_kv_heads: int, dtype, seed: int = 0):
    batch = make_paged([1] * len(context_lens), context_lens, num_heads, num_kv_heads, HEAD_DIM,
                       PAGE_SIZE, dtype, seed=seed)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    num_reqs = len(context_lens)
    sizes = [num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM, num_kv_heads * HEAD_DIM]
    qkv = torch.randn(num_reqs, sum(sizes), generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split(sizes, dim=-1)  # strided views of one QKV row, as the model's
    q = q.view(num_reqs, num_heads, HEAD_DIM)
    k, v = k.view(num_reqs, num_kv_heads, HEAD_DIM), v.view(num_reqs, num_kv_heads, HEAD_DIM)
    positions = (batch.seq_lens.long() - 1).to(DEVICE)
    w = (1 + 0.5 * torch.randn(2, HEAD_DIM, generator=gen)).to(dtype).to(DEVICE)
    return batch, qkv, q, k, v, positions, (w[0], w[1], 1e-6)


def test_the_wide_group_is_shipped_fused() -> None:
    """Qwen3-30B-A3B's heads take the fused kernel, merged by split at 8 warps; Qwen3-0.6B's
    group of 2 merges by split at the default warps; Llama-3.1-8B's shape keeps the unfused
    kernels."""
    assert 8 in fused.MERGE_BY_SPLIT_GROUPS and fused.WIDE_GROUP_WARPS.get(8) == 8
    assert 2 in fused.MERGE_BY_SPLIT_GROUPS and 2 not in fused.WIDE_GROUP_WARPS
    cos_sin = torch.empty(10, 128, device=DEVICE)
    q, cache = torch.empty(1, 32, 128, device=DEVICE), torch.empty(4, 16, 4, 128, device=DEVICE)
    assert fused.applies(q, cache, cos_sin, quantized=False)
    assert not fused.applies(q, torch.empty(4, 16, 8, 128, device=DEVICE), cos_sin, False)


@pytest.mark.parametrize("num_kv_heads", [2, 8], ids=["group8", "group2"])
@pytest.mark.parametrize(
    "context_lens,max_splits", [([150], 4), ([1000], 16), ([300, 0, 77], 8), ([40], 1)],
    ids=["bs1-3-splits", "bs1-16-splits", "bs3-merged", "one-split"],
)  # fmt: skip
def test_wide_group_matches_reference(
    context_lens: list[int], max_splits: int, num_kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups 8 and 2 (16 query heads on 2 or 8 KV heads), q/k norm, bf16, the shipped
    settings (both merge by split): every head's output, the stored K/V, untouched q/k/v and
    zeroed counters, for one split, fewer splits than a merge round (4), several rounds and a
    batch with an empty request."""
    monkeypatch.setattr(fused, "SPLIT_TOKENS", 64)
    dtype = torch.bfloat16
    batch, qkv, q, k, v, positions, norms = _case(context_lens, 16, num_kv_heads, dtype, seed=11)
    cos_sin = make_cos_sin_cache(HEAD_DIM, max_pos=1024)
    qkv_before = qkv.clone()
    k_cache2, v_cache2 = batch.k_cache.clone(), batch.v_cache.clone()
    expected = fused.fused_decode_attention_ref(
        q.clone(), k.clone(), v.clone(), positions, cos_sin, norms, k_cache2, v_cache2,
        batch.slot_mapping, batch.block_table, batch.seq_lens, HEAD_DIM**-0.5,
    )  # fmt: skip
    out = fused.fused_decode_attention(
        q, k, v, positions, cos_sin, norms, batch.k_cache, batch.v_cache, batch.slot_mapping,
        batch.block_table, batch.seq_lens, HEAD_DIM**-0.5, max(batch.seq_lens_list),
        max_splits=max_splits,
    )  # fmt: skip
    assert_close(out, expected, dtype)
    torch.testing.assert_close(qkv, qkv_before, atol=0, rtol=0)
    assert_close(batch.k_cache, k_cache2, dtype)  # the norm's sum order may move one ulp
    torch.testing.assert_close(batch.v_cache, v_cache2, atol=0, rtol=0)
    assert not last_program._COUNTERS[(out.device, "attention")].any()


def test_merge_by_split_in_fp32_equals_the_head_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """In fp32 the two merges weigh the same partials the same way: equal to rounding (7
    splits: a full round of 4 and a partial one)."""
    monkeypatch.setattr(fused, "SPLIT_TOKENS", 64)
    batch, _, q, k, v, positions, norms = _case([400], 8, 1, torch.float32, seed=4)
    cos_sin = make_cos_sin_cache(HEAD_DIM, max_pos=512)
    outs = []
    for groups in (set(), {8}):
        monkeypatch.setattr(fused, "MERGE_BY_SPLIT_GROUPS", groups)
        outs.append(fused.fused_decode_attention(
            q, k, v, positions, cos_sin, norms, batch.k_cache.clone(), batch.v_cache.clone(),
            batch.slot_mapping, batch.block_table, batch.seq_lens, HEAD_DIM**-0.5, 401,
            max_splits=8,
        ))  # fmt: skip
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_wide_group_compiles_for_hopper() -> None:
    """sm_90 (ptxas) at 32/4/128 with q/k norm and PDL, as launched (8 warps, the merge by
    split)."""
    from hopper_variants import compile_for_hopper

    kernel = fused._fused_decode_attention_kernel
    pointers = {name: "bf16" for name in kernel.arg_names if name.endswith("_ptr")}
    pointers.update(positions_ptr="i64", cos_sin_ptr="fp32", slot_mapping_ptr="i64",
                    block_table_ptr="i32", seq_lens_ptr="i32", part_out_ptr="fp32",
                    part_lse_ptr="fp32", counter_ptr="i32")  # fmt: skip
    variant = dict(
        NUM_HEADS=32, NUM_KV_HEADS=4, GROUP=8, HEAD_DIM=128, HALF=64, PAGE_SIZE=16, BLOCK_H=16,
        BLOCK_R=64, BLOCK_D=128, BLOCK_N=64, SPLIT_TOKENS=64, BLOCK_S=64, QK_NORM=True,
        PRECISION="tf32", PDL=True, LINES=2, LINE_ELEMS=64, MERGE_BY_SPLIT=True,
    )  # fmt: skip
    (ptx,) = compile_for_hopper(
        "roofline.kernels.decode_attention_fused", "_fused_decode_attention_kernel", [variant],
        pointers, ("scale_log2e", "norm_eps", "inv_head_dim"),
        dict(num_warps=fused.WIDE_GROUP_WARPS[8], num_stages=3, enable_fp_fusion=False),
    )  # fmt: skip
    assert "griddepcontrol.wait" in ptx and "atom.global.gpu.acq_rel" in ptx
    assert "ld.global.cg" in ptx  # the partials of the other splits
