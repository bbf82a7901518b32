"""The fused decode attention kernel (q/k norm, RoPE, K/V store, attention, split merge in one
launch) against its unfused torch reference, in fp32 and bf16, with and without Qwen3's q/k
norm, one split and several (merged by the last split to finish), padding rows (slot -1) and
rows with no cached context; and compiled for Hopper on the CPU (the interpreter accepts code
the GPU compiler rejects)."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close, make_paged
from test_rotary import make_cos_sin_cache

from roofline.kernels import decode_attention_fused as fused
from roofline.kernels import last_program
from roofline.kernels.decode_attention_fused import (
    fused_decode_attention,
    fused_decode_attention_ref,
)

HEAD_DIM = 128 if ON_GPU else 32
PAGE_SIZE = 16


def _case(context_lens: list[int], dtype: torch.dtype, qk_norm: bool, seed: int = 0):
    num_heads, num_kv_heads = 8, 2
    batch = make_paged([1] * len(context_lens), context_lens, num_heads, num_kv_heads, HEAD_DIM,
                       PAGE_SIZE, dtype, seed=seed)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    num_reqs = len(context_lens)
    # q | k | v as one QKV row per request, the way the model hands them over (strided views)
    qkv = torch.randn(num_reqs, (num_heads + 2 * num_kv_heads) * HEAD_DIM, generator=gen)
    qkv = qkv.to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM, num_kv_heads * HEAD_DIM],
                        dim=-1)  # fmt: skip
    q = q.view(num_reqs, num_heads, HEAD_DIM)
    k, v = k.view(num_reqs, num_kv_heads, HEAD_DIM), v.view(num_reqs, num_kv_heads, HEAD_DIM)
    positions = (batch.seq_lens.long() - 1).to(DEVICE)
    norms = None
    if qk_norm:
        w = (1 + 0.5 * torch.randn(2, HEAD_DIM, generator=gen)).to(dtype).to(DEVICE)
        norms = (w[0], w[1], 1e-6)
    return batch, qkv, q, k, v, positions, norms


@pytest.mark.parametrize("merge_tile_fit", [False, True], ids=["merge-64", "merge-fit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm+rope"])
@pytest.mark.parametrize(
    "context_lens,max_splits,split_tokens",
    [([0, 40, 17], 1, 128), ([150, 0, 70, 200], 4, 64), ([300], 8, 64), ([300, 5], 2, 64)],
    ids=["one-split", "merged", "bs1-merged", "multi-block-splits"],
)
def test_fused_matches_reference(
    dtype: torch.dtype, qk_norm: bool, context_lens: list[int], max_splits: int,
    split_tokens: int, merge_tile_fit: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    if merge_tile_fit and (max_splits == 1 or qk_norm):
        pytest.skip("the merge's tile only")
    monkeypatch.setattr(fused, "SPLIT_TOKENS", split_tokens)
    monkeypatch.setattr(fused, "MERGE_TILE_FIT", merge_tile_fit)
    batch, qkv, q, k, v, positions, norms = _case(context_lens, dtype, qk_norm, seed=3)
    cos_sin = make_cos_sin_cache(HEAD_DIM, max_pos=512)
    qkv_before = qkv.clone()
    k_cache2, v_cache2 = batch.k_cache.clone(), batch.v_cache.clone()
    expected = fused_decode_attention_ref(
        q.clone(), k.clone(), v.clone(), positions, cos_sin, norms, k_cache2, v_cache2,
        batch.slot_mapping, batch.block_table, batch.seq_lens, HEAD_DIM**-0.5,
    )  # fmt: skip
    out = fused_decode_attention(
        q, k, v, positions, cos_sin, norms, batch.k_cache, batch.v_cache, batch.slot_mapping,
        batch.block_table, batch.seq_lens, HEAD_DIM**-0.5, max(batch.seq_lens_list),
        max_splits=max_splits,
    )  # fmt: skip
    assert_close(out, expected, dtype)
    torch.testing.assert_close(qkv, qkv_before, atol=0, rtol=0)  # q, k, v untouched
    if qk_norm:  # the norm's sum of squares is ordered differently: one ulp may move
        assert_close(batch.k_cache, k_cache2, dtype)
    else:
        torch.testing.assert_close(batch.k_cache, k_cache2, atol=0, rtol=0)
    torch.testing.assert_close(batch.v_cache, v_cache2, atol=0, rtol=0)
    assert not last_program._COUNTERS[(out.device, "attention")].any(), (
        "every launch leaves its counters at zero"
    )


def test_padding_rows_store_nothing() -> None:
    """Rows with slot -1 (CUDA-graph padding, context length 1) attend to their own token and
    write nothing to the cache."""
    batch, _, q, k, v, positions, _ = _case([33, 0], torch.float32, False, seed=5)
    slots = batch.slot_mapping.clone()
    slots[1] = -1
    cos_sin = make_cos_sin_cache(HEAD_DIM, max_pos=512)
    k_before, v_before = batch.k_cache.clone(), batch.v_cache.clone()
    out = fused_decode_attention(
        q, k, v, positions, cos_sin, None, batch.k_cache, batch.v_cache, slots,
        batch.block_table, batch.seq_lens, HEAD_DIM**-0.5, 34,
    )  # fmt: skip
    # row 1: softmax over one key is that key's value
    group = q.shape[1] // k.shape[1]
    torch.testing.assert_close(out[1], v[1].repeat_interleave(group, dim=0))
    page, row = divmod(int(batch.slot_mapping[0]), PAGE_SIZE)
    for cache, before in ((batch.k_cache, k_before), (batch.v_cache, v_before)):
        changed = (cache != before).any(-1).any(-1).nonzero().tolist()
        assert changed == [[page, row]]  # only row 0's new token


def test_applies() -> None:
    q = torch.empty(1, 8, 32, device=DEVICE)
    cache = torch.empty(4, 16, 2, 32, device=DEVICE)
    assert fused.applies(q, cache, torch.empty(10, 32, device=DEVICE), quantized=False)
    assert not fused.applies(q, cache, torch.empty(10, 16, device=DEVICE), quantized=False)
    assert not fused.applies(q, cache, torch.empty(10, 32, device=DEVICE), quantized=True)
    fused.set_enabled(False)
    try:
        assert not fused.applies(q, cache, torch.empty(10, 32, device=DEVICE), quantized=False)
    finally:
        fused.set_enabled(True)
    with pytest.raises(ValueError):
        fused.set_split_tokens(100)
    q8b, cache8b = torch.empty(1, 32, 128, device=DEVICE), torch.empty(4, 16, 8, 128, device=DEVICE)
    assert not fused.applies(q8b, cache8b, torch.empty(10, 128, device=DEVICE), quantized=False)


def test_compiles_for_hopper() -> None:
    """Triton's sm_90 compile (ptxas included) of the PDL variants, on any machine."""
    from hopper_variants import compile_for_hopper

    kernel = fused._fused_decode_attention_kernel
    pointers = {name: "bf16" for name in kernel.arg_names if name.endswith("_ptr")}
    pointers.update(positions_ptr="i64", cos_sin_ptr="fp32", slot_mapping_ptr="i64",
                    block_table_ptr="i32", seq_lens_ptr="i32", part_out_ptr="fp32",
                    part_lse_ptr="fp32", counter_ptr="i32")  # fmt: skip
    base = dict(
        NUM_HEADS=16, NUM_KV_HEADS=8, GROUP=2, HEAD_DIM=128, HALF=64, PAGE_SIZE=16, BLOCK_H=16,
        BLOCK_R=64, BLOCK_D=128, BLOCK_N=64, SPLIT_TOKENS=64, BLOCK_S=64, QK_NORM=True,
        PRECISION="tf32", PDL=True, LINES=2, LINE_ELEMS=64,
    )  # fmt: skip
    variants = [base, dict(base, QK_NORM=False, GROUP=4, NUM_HEADS=32, PDL=False)]
    ptxs = compile_for_hopper(
        "roofline.kernels.decode_attention_fused", "_fused_decode_attention_kernel", variants,
        pointers, ("scale_log2e", "norm_eps", "inv_head_dim"),
        dict(num_warps=4, num_stages=3, enable_fp_fusion=False),
    )  # fmt: skip
    for instruction in ("griddepcontrol.wait", "atom.global.gpu.acq_rel", "prefetch.global.L2"):
        assert instruction in ptxs[0]
    assert "griddepcontrol" not in ptxs[1] and "mma.sync" in ptxs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_takes_fused_path(dtype: torch.dtype) -> None:
    """A decode-only step given ``rope`` goes through the fused kernel in TritonAttentionBackend
    and matches the torch backend on q/k normalised and rotated by the layer modules."""
    from test_triton_backend import _metadata

    from roofline.attention.torch_backend import TorchAttentionBackend
    from roofline.attention.triton_backend import TritonAttentionBackend
    from roofline.layers.norm import RMSNorm
    from roofline.layers.rotary import RotaryEmbedding

    batch, _, q, k, v, positions, norms = _case([45, 3, 0, 130], dtype, True, seed=7)
    meta = _metadata(batch, PAGE_SIZE)
    rotary = RotaryEmbedding(HEAD_DIM, 256, 10000.0, None).to(DEVICE)
    rotary.reset_cache()
    q_norm, k_norm = RMSNorm(HEAD_DIM, 1e-6), RMSNorm(HEAD_DIM, 1e-6)
    q_norm.weight.data, k_norm.weight.data = norms[0], norms[1]
    q_ref, k_ref = rotary.forward_native(positions, q_norm.forward_native(q.clone()),
                                         k_norm.forward_native(k.clone()))  # fmt: skip
    k_cache2, v_cache2 = batch.k_cache.clone(), batch.v_cache.clone()
    scale = HEAD_DIM**-0.5
    expected = TorchAttentionBackend().forward(q_ref, k_ref, v, k_cache2, v_cache2, meta, scale)
    q_before = q.clone()
    rope = (positions, rotary.cos_sin_cache, norms)
    out = TritonAttentionBackend().forward(
        q, k, v, batch.k_cache, batch.v_cache, meta, scale, rope=rope
    )
    assert torch.equal(q, q_before), "the fused path leaves q as it was (the store path rotates it)"
    assert_close(out, expected, dtype)
    assert_close(batch.k_cache, k_cache2, dtype)


def test_tiny_qwen3_fp32_greedy_matches_hf(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3 (q/k norm) through the Triton backend with RoPE fused (as on CUDA): every
    decode step's attention runs the fused kernel (forced to split and merge), and the fp32
    greedy tokens equal HF transformers'."""
    from roofline import LLM, SamplingParams
    from roofline.attention import triton_backend
    from roofline.layers.attention import Attention
    from tests.e2e.hf_reference import hf_greedy, tiny_hf_model

    hf = tiny_hf_model("qwen3", tmp_path, num_hidden_layers=2)
    prompts = [[5, 6, 7, 8, 9] * 9, [11, 12, 13]]
    expected = [hf_greedy(hf, p, 10) for p in prompts]
    monkeypatch.setattr(Attention, "fuses_rope", staticmethod(lambda q, ctx: True))
    monkeypatch.setattr(fused, "SPLIT_TOKENS", 16)  # BLOCK_N-sized splits: the merge runs
    monkeypatch.setattr(fused, "BLOCK_N", 16)
    calls = []
    kernel = fused.fused_decode_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **dict(kwargs, max_splits=4))

    monkeypatch.setattr(triton_backend.decode_attention_fused, "fused_decode_attention", counted)
    llm = LLM(str(tmp_path), dtype="float32", device=str(DEVICE), attention_backend="triton",
              max_model_len=128, page_size=8)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len(calls) >= 2 * 9  # two layers, nine decode steps at least
