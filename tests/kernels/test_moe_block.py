"""The one-launch MoE block (``kernels.moe_block``) against the three-launch path it replaces
(``moe_router`` + ``fused_moe`` with the residual), under the interpreter (programs run in
ticket order there) and compiled for Hopper."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE
from torch import nn

from roofline.kernels import last_program
from roofline.kernels.fused_moe import fused_moe, fused_moe_ref
from roofline.kernels.moe_block import moe_block
from roofline.kernels.moe_router import moe_router, moe_router_ref
from roofline.quantization.moe import PerChannelMoEMethod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_three_launches(dtype, renormalize) -> None:
    gen = torch.Generator().manual_seed(3)
    experts, top_k, hidden, inter = 16, 4, 64, 48
    h = (2 * torch.randn(1, hidden, generator=gen)).to(dtype).to(DEVICE)
    norm_w = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    router = (torch.randn(experts, hidden, generator=gen) / 4).to(dtype).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / 8).to(dtype).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / 7).to(dtype).to(DEVICE)
    for _ in range(2):  # the counters are reset for the next launch
        got = moe_block(h, norm_w, 1e-6, router, w13, w2, top_k, renormalize)
    xn, w, ids = moe_router(h, norm_w, 1e-6, router, top_k, renormalize)
    want = fused_moe(xn, w13, w2, w, ids, residual=h)
    if dtype == torch.bfloat16:  # and with int8 / fp8 experts made from the same weights
        for kind in ("int8", "fp8"):
            layer = nn.Module()
            method = PerChannelMoEMethod(kind)
            method.create_weights(layer, experts, inter, hidden, dtype)
            method.load(layer, "w13", slice(None), slice(None), w13.cpu().float())
            method.load(layer, "w2", slice(None), slice(None), w2.cpu().float())
            layer = layer.to(DEVICE)
            sk = dict(w13_scale=layer.w13_scale, w2_scale=layer.w2_scale)
            q = moe_block(h, norm_w, 1e-6, router, layer.w13_weight, layer.w2_weight, top_k,
                          renormalize, **sk)  # fmt: skip
            q3 = fused_moe(xn, layer.w13_weight, layer.w2_weight, w, ids, residual=h, **sk)
            torch.testing.assert_close(q.float(), q3.float(), atol=2e-2, rtol=2e-2)
    xr, wr, idr = moe_router_ref(h, norm_w, 1e-6, router, top_k, renormalize)
    assert idr.tolist() == ids.tolist()
    ref = h.float() + fused_moe_ref(xr.float(), w13.float(), w2.float(), wr.float(), idr)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    assert not last_program._COUNTERS[(h.device, "moe_block")][:5].any()


def test_refuses_mismatched_arguments() -> None:
    h = torch.zeros(2, 8, device=DEVICE)
    w13, w2 = torch.zeros(4, 8, 8, device=DEVICE), torch.zeros(4, 8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="h must be"):
        moe_block(h, torch.ones(8, device=DEVICE), 1e-6, torch.zeros(4, 8, device=DEVICE), w13,
                  w2, 2, True)  # fmt: skip


def test_compiles_for_hopper() -> None:
    """sm_90 compile of the Qwen3-30B-A3B variant (PDL, compiled roundings, the prefetch)."""
    from hopper_variants import compile_for_hopper

    variant = dict(TOP_K=8, RENORMALIZE=True, ROUTER_PROGS=64, GATE_PROGS=768, ROUTER_N=2,
                   BLOCK_E=128, BLOCK_TOP=8, BLOCK_N=8, BLOCK_K=256, NUM_STAGES=3, PDL=True,
                   COMPILED=True, PREFETCH_LINES=16, MAX=1 << 16, QUANT=False)  # fmt: skip
    names = ("h_ptr", "norm_w_ptr", "router_ptr", "w13_ptr", "w2_ptr", "out_ptr", "xn_ptr",
             "logits_ptr", "weights_ptr", "act_ptr")  # fmt: skip
    pointers = {n: "bf16" for n in names + ("s13_ptr", "s2_ptr")}
    pointers.update(ids_ptr="i64", cnt_ptr="i32")
    (ptx,) = compile_for_hopper("roofline.kernels.moe_block", "_moe_block_kernel", [variant],
                                pointers, ("inv_h", "eps"), dict(num_warps=4))  # fmt: skip
    pointers.update(w13_ptr="i8", w2_ptr="i8")
    compile_for_hopper("roofline.kernels.moe_block", "_moe_block_kernel",
                       [dict(variant, QUANT=True, BLOCK_K=512, PREFETCH_LINES=8)], pointers,
                       ("inv_h", "eps"), dict(num_warps=4))  # fmt: skip
    assert "griddepcontrol.wait" in ptx and "prefetch.global.L2" in ptx and "atom." in ptx
    assert "ld.volatile" in ptx and "fence.acq_rel.gpu" in ptx and "nanosleep" in ptx
