"""The MoE decode prologue kernel (RMSNorm, router GEMV, top-k routing, the normalised row)
against the unfused torch sequence, and compiled for Hopper on the CPU."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE

from roofline.kernels import last_program
from roofline.kernels.gemv import skinny_gemm
from roofline.kernels.moe_router import moe_router, moe_router_ref
from roofline.kernels.rmsnorm import rms_norm


@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts,top_k,hidden", [(16, 4, 96), (40, 8, 64)])
def test_matches_unfused(
    dtype, renormalize, num_experts, top_k, hidden, preload, monkeypatch
) -> None:
    from roofline.kernels import moe_router as mr

    monkeypatch.setattr(mr, "FORCE_PRELOAD", preload)
    gen = torch.Generator().manual_seed(num_experts + top_k)
    h = (3 * torch.randn(1, hidden, generator=gen)).to(dtype).to(DEVICE)
    nw = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    router = (torch.randn(num_experts, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    xn, weights, ids = moe_router(h, nw, 1e-6, router, top_k, renormalize)
    xn_ref, weights_ref, ids_ref = moe_router_ref(h, nw, 1e-6, router, top_k, renormalize)
    # the row the experts read: rms_norm's roundings (the fp32 sum of squares in another order)
    torch.testing.assert_close(
        xn, rms_norm(h, nw, 1e-6), atol=0, rtol=1e-2 if dtype != torch.float32 else 1e-6
    )
    torch.testing.assert_close(xn, xn_ref, atol=1e-2, rtol=1e-2)
    assert ids.tolist() == ids_ref.tolist()
    torch.testing.assert_close(
        weights, weights_ref, atol=1e-2 if dtype != torch.float32 else 1e-6, rtol=1e-2
    )
    # logits as the router GEMV on the kernel's own xn give the same routing
    logits = skinny_gemm(xn, router) if dtype != torch.float32 else xn @ router.T
    assert ids.tolist() == logits.float().softmax(-1).topk(top_k).indices.tolist()
    assert not last_program._COUNTERS[(h.device, "moe_router")].any()


@pytest.mark.parametrize("renormalize", [True, False])
def test_preload_ties_go_to_the_lowest_expert(renormalize, monkeypatch) -> None:
    """Equal logits (a zero router row block) rank by index (a stable descending sort; CPU
    torch.topk orders ties otherwise), the weights stored at their rank; the tiled kernel's k
    argmax passes agree."""
    from roofline.kernels import moe_router as mr

    monkeypatch.setattr(mr, "FORCE_PRELOAD", True)
    hidden, experts, top_k = 32, 24, 6
    gen = torch.Generator().manual_seed(3)
    router = torch.randn(experts, hidden, generator=gen) / hidden**0.5
    router[4:20] = 0.0  # sixteen experts tie at logit 0
    router[2] = router[3]  # and two more, above or below 0
    h = torch.randn(1, hidden, generator=gen).to(DEVICE)
    nw = torch.ones(hidden).to(DEVICE)
    router = router.to(DEVICE)
    xn, weights, ids = moe_router(h, nw, 1e-6, router, top_k, renormalize)
    probs = (xn.float() @ router.float().T).softmax(-1)  # [1, E]
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert ids.tolist() == order.tolist()
    want = probs.gather(1, order)
    if renormalize:
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, want, atol=1e-6, rtol=1e-6)
    monkeypatch.setattr(mr, "FORCE_PRELOAD", False)
    assert moe_router(h, nw, 1e-6, router, top_k, renormalize)[2].tolist() == order.tolist()


def test_compiles_for_hopper() -> None:
    """sm_90 compile of the Qwen3-30B-A3B variant (128 experts, top 8, PDL)."""
    from hopper_variants import compile_for_hopper

    base = dict(TOP_K=8, RENORMALIZE=True, BLOCK_E=128, BLOCK_TOP=8, BLOCK_N=2, BLOCK_K=512,
                NUM_STAGES=5, USE_DOT=False, EVEN_K=True, PDL=True, LATE_TRIGGER=False,
                COMPILED=True,
                PREFETCH_LINES=64, LINE_ELEMS=64)  # fmt: skip
    pointers = {name: "bf16" for name in ("x_ptr", "norm_w_ptr", "w_ptr", "xn_ptr", "logits_ptr",
                                          "weights_ptr")}  # fmt: skip
    pointers.update(ids_ptr="i64", counter_ptr="i32")
    ptxs = compile_for_hopper("roofline.kernels.moe_router", "_moe_router_kernel",
                              [base, dict(base, USE_DOT=True, BLOCK_N=16, PDL=False)], pointers,
                              ("inv_k", "eps"), dict(num_warps=4))  # fmt: skip
    assert "griddepcontrol.wait" in ptxs[0] and "atom." in ptxs[0] and "mul.rn.f32" in ptxs[0]
    pre = dict(TOP_K=8, RENORMALIZE=True, BLOCK_E=128, BLOCK_N=2, BLOCK_K=2048, PDL=True,
               COMPILED=True)  # fmt: skip
    ptxs = compile_for_hopper("roofline.kernels.moe_router", "_router_preload_kernel",
                              [dict(pre, TRIGGER=t) for t in (0, 1, 2)], pointers,
                              ("inv_k", "eps"), dict(num_warps=4))  # fmt: skip
    assert all("griddepcontrol.wait" in p and "atom." in p for p in ptxs)
    assert "griddepcontrol.launch_dependents" not in ptxs[0]
    assert all("griddepcontrol.launch_dependents" in p for p in ptxs[1:])


@pytest.mark.parametrize(
    "dtype,quant",
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.bfloat16, "int8"),
        (torch.bfloat16, "int4"),
    ],
)
def test_fused_moe_layer_matches_unfused(dtype, quant) -> None:
    """``fused_decode.moe_norm_add`` (router kernel + expert GEMVs with the residual add in the
    down store) against the block's own forward on the normalised row plus the residual, with
    16-bit and quantized experts."""
    from roofline.layers.fused_decode import moe_norm_add
    from roofline.layers.moe import FusedMoE
    from roofline.layers.norm import RMSNorm
    from roofline.quantization.moe import GroupInt4MoEMethod, PerChannelMoEMethod

    torch.manual_seed(0)
    hidden, inter, experts, top_k = 64, 32, 8, 2
    method = {None: None, "int8": PerChannelMoEMethod("int8"), "int4": GroupInt4MoEMethod(32)}
    moe = FusedMoE(hidden, inter, experts, top_k, renormalize=True, method=method[quant])
    with torch.no_grad():
        for p in moe.parameters():
            if p.is_floating_point():
                p.normal_(0.0, 0.2)
        if quant is not None:
            moe.init_dummy_weights(torch.Generator().manual_seed(1), 0.2)
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = 1 + 0.2 * torch.randn(hidden)
    moe, norm = moe.to(DEVICE, dtype), norm.to(DEVICE, dtype)
    moe._warmed = True  # warm_up compiles every grouped variant: not needed for one token
    for seed in range(3):
        h = (2 * torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed))).to(dtype)
        h = h.to(DEVICE)
        with torch.inference_mode():
            got = moe_norm_add(moe, norm, h)
            want = h + moe(norm(h))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
