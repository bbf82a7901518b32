"""One token's MoE block as shipped, the routing inside the gate/up GEMV
(``fused_moe(route_logits=...)`` behind ``moe_router.router_logits``;
``fused_decode.MOE_ROUTE_IN_GATE_UP``), against the router kernel that routes in its last
program: the same ids, weights and output bits, 16-bit and int8 experts, with and without
renormalisation; bad calls refused; the sm_90 compile of both kernels' variants."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE

from roofline.kernels import fused_moe as fm
from roofline.kernels import last_program
from roofline.kernels import moe_router as mr


def _block(dtype, quant: str | None, renormalize: bool, seed: int):
    from roofline.layers.moe import FusedMoE
    from roofline.layers.norm import RMSNorm
    from roofline.quantization.moe import PerChannelMoEMethod

    torch.manual_seed(seed)
    hidden, inter, experts, top_k = 64, 32, 16, 4
    method = PerChannelMoEMethod("int8") if quant else None
    moe = FusedMoE(hidden, inter, experts, top_k, renormalize=renormalize, method=method)
    with torch.no_grad():
        for p in moe.parameters():
            if p.is_floating_point():
                p.normal_(0.0, 0.2)
        if quant is not None:
            moe.init_dummy_weights(torch.Generator().manual_seed(seed + 1), 0.2)
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = 1 + 0.2 * torch.randn(hidden)
    moe, norm = moe.to(DEVICE, dtype), norm.to(DEVICE, dtype)
    moe._warmed = True  # one token: the grouped variants are not needed
    return moe, norm


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    "dtype,quant", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int8")]
)
def test_routing_in_gate_up_equals_the_router(dtype, quant, renormalize, monkeypatch) -> None:
    from roofline.layers import fused_decode

    monkeypatch.setattr(mr, "FORCE_PRELOAD", True)
    moe, norm = _block(dtype, quant, renormalize, seed=2)
    calls = []
    real = mr.router_logits
    monkeypatch.setattr(mr, "router_logits", lambda *a: calls.append(1) or real(*a))
    for seed in range(2):
        gen = torch.Generator().manual_seed(10 + seed)
        h = (2 * torch.randn(1, 64, generator=gen)).to(dtype).to(DEVICE)
        with torch.inference_mode():
            routed_inside = fused_decode.moe_norm_add(moe, norm, h)  # the shipped path
            assert calls == [1] * (seed + 1), "the default routes in the gate/up GEMV"
            monkeypatch.setattr(fused_decode, "MOE_ROUTE_IN_GATE_UP", False)
            router_routed = fused_decode.moe_norm_add(moe, norm, h)
            monkeypatch.setattr(fused_decode, "MOE_ROUTE_IN_GATE_UP", True)
        assert torch.equal(router_routed, routed_inside)
        # the ids and weights the gate/up programs wrote are the router kernel's
        xn, weights, ids = mr.moe_router(h, norm.weight, norm.eps, moe.gate.weight, moe.top_k,
                                         renormalize)  # fmt: skip
        xn2, logits = real(h, norm.weight, norm.eps, moe.gate.weight)
        assert torch.equal(xn, xn2)
        w2, i2 = torch.empty_like(weights), torch.empty_like(ids)
        fm.fused_moe(xn2, moe.w13_weight, moe.w2_weight, w2, i2, residual=h,
                     route_logits=(logits, renormalize), **moe.quant_tensors())  # fmt: skip
        assert torch.equal(i2, ids) and torch.equal(w2, weights)
    assert not last_program._COUNTERS[(h.device, "moe_router")].any()


def test_route_logits_refuses_what_it_cannot_route(monkeypatch) -> None:
    monkeypatch.setattr(mr, "FORCE_PRELOAD", True)
    moe, norm = _block(torch.float32, None, True, seed=0)
    h = torch.randn(1, 64).to(DEVICE)
    xn, logits = mr.router_logits(h, norm.weight, norm.eps, moe.gate.weight)
    w, i = torch.empty(1, 4).to(DEVICE), torch.empty(1, 4, dtype=torch.int64).to(DEVICE)
    with pytest.raises(ValueError, match="route_logits"):
        fm.fused_moe(xn, moe.w13_weight, moe.w2_weight, w, i, force_path="grouped",
                     route_logits=(logits, True))  # fmt: skip
    with pytest.raises(ValueError, match="route_logits"):
        fm.fused_moe(xn, moe.w13_weight, moe.w2_weight, w, i, route_logits=(logits[:8], True))
    x2 = torch.randn(2, 64).to(DEVICE)
    w2, i2 = torch.empty(2, 4).to(DEVICE), torch.empty(2, 4, dtype=torch.int64).to(DEVICE)
    with pytest.raises(ValueError, match="route_logits"):
        fm.fused_moe(x2, moe.w13_weight, moe.w2_weight, w2, i2, route_logits=(logits, True))
    monkeypatch.setattr(mr, "FORCE_PRELOAD", False)
    if not torch.cuda.is_available():  # no PDL: the preloading kernel does not apply
        assert mr.router_logits(h, norm.weight, norm.eps, moe.gate.weight) is None


def test_compiles_for_hopper() -> None:
    """sm_90: the gate/up GEMV that routes (bf16 and int8 experts) and the router that only
    stores its logits (no atomic)."""
    from hopper_variants import compile_for_hopper

    pointers = dict(a_ptr="bf16", w_ptr="bf16", s_ptr="bf16", o_ptr="bf16", out_ptr="bf16",
                    ids_ptr="i64", weights_ptr="bf16", res_ptr="bf16",
                    logits_ptr="bf16")  # fmt: skip
    base = dict(PAIRS_PER_PROGRAM=1, A_PER_PAIR=8, BLOCK_N=8, BLOCK_K=256, NUM_STAGES=3,
                SILU_MUL=True, MUL_WEIGHT=False, QUANT=0, GROUP=0, WIDEN=0, RESIDUAL=False,
                PDL=False, PREFETCH_LINES=1, LINE_BYTES=128, FAST_FP8=True, LATE_TRIGGER=False,
                ROUTE=True, RENORMALIZE=True, BLOCK_E=128)  # fmt: skip
    int8 = dict(pointers, w_ptr="i8", s_ptr="fp32", o_ptr="fp32")
    ptxs = [compile_for_hopper("roofline.kernels.fused_moe", "_moe_gemv_kernel", [base], ptrs,
                               (), dict(num_warps=4))[0]
            for ptrs in (pointers, int8)]  # fmt: skip
    assert all("st.global.b64" in p or "st.global.u64" in p for p in ptxs)  # the routed ids
    router_ptrs = {n: "bf16" for n in ("x_ptr", "norm_w_ptr", "w_ptr", "xn_ptr", "logits_ptr",
                                       "weights_ptr")}  # fmt: skip
    router_ptrs.update(ids_ptr="i64", counter_ptr="i32")
    pre = dict(TOP_K=8, RENORMALIZE=True, BLOCK_E=128, BLOCK_N=2, BLOCK_K=2048, PDL=True,
               COMPILED=True, TRIGGER=0)  # fmt: skip
    ptxs = compile_for_hopper("roofline.kernels.moe_router", "_router_preload_kernel",
                              [dict(pre, ROUTE=False), dict(pre, ROUTE=True)], router_ptrs,
                              ("inv_k", "eps"), dict(num_warps=4))  # fmt: skip
    assert "atom." not in ptxs[0] and "atom." in ptxs[1]
