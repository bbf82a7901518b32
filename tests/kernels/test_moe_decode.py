"""One token's experts in one launch (``kernels.moe_decode``) against the plain-torch loop over
experts and against ``fused_moe``'s two decode GEMVs, with the residual add, ragged intermediate
blocks, several reducers' column ranges and a not-local expert."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE

from roofline.kernels import last_program
from roofline.kernels.fused_moe import fused_moe, fused_moe_ref
from roofline.kernels.moe_decode import moe_experts


def _experts(num_experts: int, inter: int, hidden: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return w13.to(DEVICE), w2.to(DEVICE), gen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_experts,top_k,hidden,inter,config",
    [
        (8, 2, 64, 48, {}),  # two intermediate blocks, the second half empty
        (16, 4, 96, 32, dict(BLOCK_I=16, BLOCK_H=32)),  # three column chunks, one ragged
        (6, 3, 32, 80, dict(BLOCK_I=32, BLOCK_K=16, BLOCK_H=16)),
    ],
)
def test_matches_reference(dtype, num_experts, top_k, hidden, inter, config) -> None:
    w13, w2, gen = _experts(num_experts, inter, hidden, dtype, hidden + inter)
    for _ in range(2):  # the counters are zero again for the second launch
        x = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE)
        h = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE)
        ids = torch.randperm(num_experts, generator=gen)[:top_k].view(1, top_k).to(DEVICE)
        weights = torch.rand(1, top_k, generator=gen).to(dtype).to(DEVICE)
        got = moe_experts(x, w13, w2, weights, ids, residual=h, config=config)
        ref = h.float() + fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
        two_launches = fused_moe(x, w13, w2, weights, ids, residual=h)
        torch.testing.assert_close(got, two_launches, atol=1e-2, rtol=1e-2)
        alone = moe_experts(x, w13, w2, weights, ids, config=config)
        torch.testing.assert_close(alone, fused_moe(x, w13, w2, weights, ids), atol=1e-2, rtol=1e-2)
    assert not last_program._COUNTERS[(x.device, "moe_experts")][:2].any()


def test_not_local_expert_adds_nothing() -> None:
    """An id equal to E (another rank's expert under expert parallelism) reads nothing."""
    w13, w2, gen = _experts(4, 32, 64, torch.bfloat16, 7)
    x = torch.randn(1, 64, generator=gen).bfloat16().to(DEVICE)
    weights = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.bfloat16).to(DEVICE)
    got = moe_experts(x, w13, w2, weights, torch.tensor([[1, 4, 2]]).to(DEVICE))
    only_local = moe_experts(x, w13, w2, weights * torch.tensor([[1.0, 0.0, 1.0]]).bfloat16().to(
        DEVICE), torch.tensor([[1, 0, 2]]).to(DEVICE))  # fmt: skip
    torch.testing.assert_close(got, only_local, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_per_channel_8bit_experts(kind, monkeypatch) -> None:
    """int8 / fp8 experts with per-channel scales (as ``PerChannelMoEMethod`` stores them)
    against the dequantize-then-reference loop and the two GEMV launches, and through
    ``fused_moe.ONE_LAUNCH[1]``."""
    from roofline.kernels import fused_moe as fm
    from roofline.quantization.moe import PerChannelMoEMethod

    num_experts, inter, hidden = 8, 48, 64
    w13, w2, gen = _experts(num_experts, inter, hidden, torch.float32, 5)
    layer = torch.nn.Module()
    method = PerChannelMoEMethod(kind)
    method.create_weights(layer, num_experts, inter, hidden, torch.bfloat16)
    method.load(layer, "w13", slice(None), slice(None), w13.cpu())
    method.load(layer, "w2", slice(None), slice(None), w2.cpu())
    layer = layer.to(DEVICE)
    sk = dict(w13_scale=layer.w13_scale, w2_scale=layer.w2_scale)
    x = torch.randn(1, hidden, generator=gen).bfloat16().to(DEVICE)
    h = torch.randn(1, hidden, generator=gen).bfloat16().to(DEVICE)
    ids = torch.tensor([[6, 1, 3]]).to(DEVICE)
    weights = torch.tensor([[0.5, 0.3, 0.2]]).bfloat16().to(DEVICE)
    got = moe_experts(x, layer.w13_weight, layer.w2_weight, weights, ids, residual=h, **sk)
    ref = h.float() + fused_moe_ref(x.float(), layer.w13_weight, layer.w2_weight,
                                    weights.float(), ids, **sk)  # fmt: skip
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    two = fm.fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids, residual=h, **sk)
    torch.testing.assert_close(got, two, atol=1e-2, rtol=1e-2)
    monkeypatch.setitem(fm.ONE_LAUNCH, 1, True)
    via = fm.fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids, residual=h, **sk)
    assert torch.equal(via, got)
    with pytest.raises(ValueError, match="w13_scale"):
        moe_experts(x, layer.w13_weight, layer.w2_weight, weights, ids)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_experts(symmetric, monkeypatch) -> None:
    """int4 experts (groups of 32, symmetric or with zero points) against the dequantize-then-
    reference loop and the two int4 GEMV launches; two intermediate blocks, two K steps."""
    from roofline.kernels import fused_moe as fm
    from roofline.quantization.moe import GroupInt4MoEMethod

    num_experts, inter, hidden = 6, 64, 64
    w13, w2, gen = _experts(num_experts, inter, hidden, torch.float32, 9)
    layer = torch.nn.Module()
    method = GroupInt4MoEMethod(32, symmetric=symmetric)
    method.create_weights(layer, num_experts, inter, hidden, torch.bfloat16)
    method.load(layer, "w13", slice(None), slice(None), w13.cpu())
    method.load(layer, "w2", slice(None), slice(None), w2.cpu())
    layer = layer.to(DEVICE)
    sk = dict(w13_scale=layer.w13_scale, w2_scale=layer.w2_scale, w13_offset=layer.w13_offset,
              w2_offset=layer.w2_offset)  # fmt: skip
    x = torch.randn(1, hidden, generator=gen).bfloat16().to(DEVICE)
    h = torch.randn(1, hidden, generator=gen).bfloat16().to(DEVICE)
    ids = torch.tensor([[4, 0]]).to(DEVICE)
    weights = torch.tensor([[0.6, 0.4]]).bfloat16().to(DEVICE)
    q13, q2 = layer.w13_weight, layer.w2_weight
    got = moe_experts(x, q13, q2, weights, ids, residual=h, config=dict(BLOCK_H=32), **sk)
    ref = h.float() + fused_moe_ref(x.float(), q13, q2, weights.float(), ids, **sk)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    two = fm.fused_moe(x, q13, q2, weights, ids, residual=h, **sk)
    torch.testing.assert_close(got, two, atol=1e-2, rtol=1e-2)
    monkeypatch.setitem(fm.ONE_LAUNCH, 2, True)
    via = fm.fused_moe(x, q13, q2, weights, ids, residual=h, **sk)
    torch.testing.assert_close(via, moe_experts(x, q13, q2, weights, ids, residual=h, **sk),
                               atol=0, rtol=0)  # fmt: skip


def test_takes_one_token_of_narrow_experts() -> None:
    from roofline.kernels.moe_decode import takes

    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    assert takes(x, torch.zeros(4, 2 * 768, 32, dtype=torch.bfloat16), 1)
    assert not takes(x, torch.zeros(4, 2 * 768, 32, dtype=torch.bfloat16), 2)
    assert not takes(x, torch.zeros(2, 2 * 14336, 32, dtype=torch.bfloat16), 1)  # Mixtral's
    assert not takes(x.float(), torch.zeros(4, 64, 32), 1)  # fp32: the GEMVs


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_in_the_experts_launch(kind, renormalize, monkeypatch) -> None:
    """``logits`` (the router without its routing program): every program routes them itself
    and the result is the ids/weights path's, bit for bit."""
    from roofline.kernels import moe_router as mr
    from roofline.quantization.moe import PerChannelMoEMethod

    monkeypatch.setattr(mr, "FORCE_PRELOAD", True)
    num_experts, inter, hidden, top_k = 24, 32, 64, 4
    w13, w2, gen = _experts(num_experts, inter, hidden, torch.bfloat16, 13)
    sk: dict = {}
    if kind == "int8":
        layer = torch.nn.Module()
        method = PerChannelMoEMethod("int8")
        method.create_weights(layer, num_experts, inter, hidden, torch.bfloat16)
        method.load(layer, "w13", slice(None), slice(None), w13.float().cpu())
        method.load(layer, "w2", slice(None), slice(None), w2.float().cpu())
        layer = layer.to(DEVICE)
        w13, w2 = layer.w13_weight, layer.w2_weight
        sk = dict(w13_scale=layer.w13_scale, w2_scale=layer.w2_scale)
    router = (torch.randn(num_experts, hidden, generator=gen) / hidden**0.5).bfloat16().to(DEVICE)
    nw = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16().to(DEVICE)
    for _ in range(2):
        h = torch.randn(1, hidden, generator=gen).bfloat16().to(DEVICE)
        xn, logits = mr.moe_router_logits(h, nw, 1e-6, router)
        xn2, weights, ids = mr.moe_router(h, nw, 1e-6, router, top_k, renormalize)
        assert torch.equal(xn, xn2)
        got = moe_experts(xn, w13, w2, None, None, residual=h, logits=logits, top_k=top_k,
                          renormalize=renormalize, **sk)  # fmt: skip
        want = moe_experts(xn2, w13, w2, weights, ids, residual=h, **sk)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_rejects_a_batch() -> None:
    w13, w2, _ = _experts(4, 16, 32, torch.bfloat16, 1)
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="one token"):
        moe_experts(x, w13, w2, torch.ones(2, 2, dtype=torch.bfloat16, device=DEVICE), ids)


def test_compiles_for_hopper() -> None:
    """sm_90 compile of the Qwen3-30B-A3B variant (192 programs, 16 reducers that wait)."""
    from hopper_variants import compile_for_hopper

    base = dict(TOP_K=8, NUM_IB=24, BLOCK_IB=32, REDUCERS=16, BLOCK_I=32, BLOCK_K=128,
                BLOCK_H=128, NUM_STAGES=3, RESIDUAL=True, SPIN_LIMIT=1 << 24,
                QUANT=0, GROUP13=0, GROUP2=0, ROUTE=False, RENORMALIZE=True,
                BLOCK_E=128)  # fmt: skip
    pointers = {n: "bf16" for n in ("x_ptr", "w13_ptr", "w2_ptr", "weights_ptr", "res_ptr",
                                    "out_ptr")}  # fmt: skip
    pointers.update(ids_ptr="i64", part_ptr="fp32", counter_ptr="i32", s13_ptr="fp32",
                    s2_ptr="fp32", o13_ptr="fp32", o2_ptr="fp32", logits_ptr="bf16")  # fmt: skip
    ptxs = compile_for_hopper("roofline.kernels.moe_decode", "_moe_experts_kernel",
                              [dict(base, PDL=False, PREFETCH_W2=False),
                               dict(base, PDL=True, PREFETCH_W2=True, ROUTE=True)],
                              pointers, (),
                              dict(num_warps=8))  # fmt: skip
    assert "atom." in ptxs[0] and "griddepcontrol" not in ptxs[0]
    assert "griddepcontrol.wait" in ptxs[1] and "griddepcontrol.launch_dependents" in ptxs[1]
    assert "prefetch.global.L2" in ptxs[1] and "prefetch.global.L2" not in ptxs[0]
    for wtype in ("i8", "fp8e4nv"):  # per-channel 8-bit experts
        q8 = compile_for_hopper("roofline.kernels.moe_decode", "_moe_experts_kernel",
                                [dict(base, PDL=False, PREFETCH_W2=False, QUANT=1,
                                      BLOCK_K=256)],
                                dict(pointers, w13_ptr=wtype, w2_ptr=wtype), (),
                                dict(num_warps=8))  # fmt: skip
        assert "atom." in q8[0]
    q4 = compile_for_hopper("roofline.kernels.moe_decode", "_moe_experts_kernel",
                            [dict(base, PDL=True, PREFETCH_W2=False, QUANT=2, BLOCK_I=64,
                                  NUM_IB=12, BLOCK_IB=16, BLOCK_H=64, GROUP13=128,
                                  GROUP2=128)],
                            dict(pointers, w13_ptr="u8", w2_ptr="u8", s13_ptr="bf16",
                                 s2_ptr="bf16", o13_ptr="bf16", o2_ptr="bf16"), (),
                            dict(num_warps=8))  # fmt: skip
    assert "atom." in q4[0] and "griddepcontrol.wait" in q4[0]


def test_fused_moe_takes_it_at_one_token(monkeypatch) -> None:
    """``fused_moe.ONE_LAUNCH`` sends one token of 16-bit experts here, two tokens to the GEMVs."""
    from roofline.kernels import fused_moe as fm

    w13, w2, gen = _experts(8, 32, 64, torch.bfloat16, 11)
    x = torch.randn(2, 64, generator=gen).bfloat16().to(DEVICE)
    ids = torch.tensor([[1, 5], [2, 5]]).to(DEVICE)
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]]).bfloat16().to(DEVICE)
    monkeypatch.setitem(fm.ONE_LAUNCH, 0, True)
    one = fm.fused_moe(x[:1], w13, w2, weights[:1], ids[:1])
    assert torch.equal(one, moe_experts(x[:1], w13, w2, weights[:1], ids[:1]))
    two = fm.fused_moe(x, w13, w2, weights, ids)
    monkeypatch.setitem(fm.ONE_LAUNCH, 0, False)
    assert torch.equal(two, fm.fused_moe(x, w13, w2, weights, ids))
