"""The one-token down projection with all k experts' rows in one program's tile
(``kernels.moe_down``, ``fused_moe.WIDE_DOWN``) against the down GEMV it replaces (each
expert's sum, rounding and weight, the residual add; the k rows summed in another order: within
an ulp) and the reference, for 16-bit and 8-bit experts, with a not-local expert; other tiles;
bad shapes refused; the sm_90 compile of it and of the gate/up GEMV's routing (barriers,
registers, spills)."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU

from roofline.kernels import fused_moe as fm
from roofline.kernels.moe_down import moe_down_wide
from roofline.quantization.moe import PerChannelMoEMethod


def _layer(kind: str, num_experts: int, inter: int, hidden: int, gen: torch.Generator):
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    if kind in ("bf16", "fp32"):
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        return w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE), {}
    layer = torch.nn.Module()
    method = PerChannelMoEMethod(kind)
    method.create_weights(layer, num_experts, inter, hidden, torch.bfloat16)
    method.load(layer, "w13", slice(None), slice(None), w13)
    method.load(layer, "w2", slice(None), slice(None), w2)
    layer = layer.to(DEVICE)
    scales = dict(w13_scale=layer.w13_scale, w2_scale=layer.w2_scale)
    return layer.w13_weight, layer.w2_weight, scales


def test_on_for_16_bit_experts() -> None:
    assert fm.WIDE_DOWN == {0: True, 1: False}


@pytest.mark.parametrize("kind", ["bf16", "fp32", "int8", "fp8"])
@pytest.mark.parametrize("residual", [True, False])
def test_matches_the_down_gemv(kind, residual, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(4)
    num_experts, inter, hidden = 8, 48, 40  # a ragged column block and K step
    w13, w2, scales = _layer(kind, num_experts, inter, hidden, gen)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    x = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE)
    h = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE) if residual else None
    layout = 0 if kind in ("bf16", "fp32") else 1
    for ids in ([[5, 2, 7]], [[1, num_experts, 3]]):  # the second: another rank's expert
        ids_t = torch.tensor(ids).to(DEVICE)
        weights = torch.tensor([[0.5, 0.3, 0.2]]).to(dtype).to(DEVICE)
        monkeypatch.setitem(fm.WIDE_DOWN, layout, False)
        gemv = fm.fused_moe(x, w13, w2, weights, ids_t, residual=h, **scales)
        monkeypatch.setitem(fm.WIDE_DOWN, layout, True)
        wide = fm.fused_moe(x, w13, w2, weights, ids_t, residual=h, **scales)
        ref = fm.fused_moe_ref(x, w13, w2, weights, ids_t, **scales)
        ref = ref if h is None else (h.float() + ref.float()).to(dtype)
        ulp = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(wide, gemv, atol=ulp, rtol=ulp)
        torch.testing.assert_close(wide.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_tiles_and_bad_shapes() -> None:
    """Other tiles (4 rows x 256, past K's end; 2 x 16) give the default's result; a batch of
    two tokens and a non-contiguous act are refused."""
    gen = torch.Generator().manual_seed(6)
    _, w2, _ = _layer("fp32", 6, 40, 24, gen)
    act = torch.randn(4, 40, generator=gen).to(DEVICE)
    ids = torch.tensor([[0, 5, 3, 1]]).to(DEVICE)
    weights = torch.rand(1, 4, generator=gen).to(DEVICE)
    want = sum(weights[0, j] * (w2[ids[0, j]].float() @ act[j].float()) for j in range(4))
    for cfg in (None, dict(BLOCK_N=4, BLOCK_K=256), dict(BLOCK_N=2, BLOCK_K=16)):
        out = moe_down_wide(act, w2, weights, ids, torch.empty(1, 24, device=DEVICE), config=cfg)
        torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one token"):
        moe_down_wide(act, w2, weights.expand(2, 4), ids.expand(2, 4),
                      torch.empty(2, 24, device=DEVICE))  # fmt: skip
    with pytest.raises(ValueError, match="contiguous"):
        moe_down_wide(torch.randn(40, 4, device=DEVICE).t(), w2, weights, ids,
                      torch.empty(1, 24, device=DEVICE))  # fmt: skip


def hopper_report() -> dict:
    """sm_90 at Qwen3-30B-A3B's shapes (128 experts, top 8, bf16), compiled in a process
    without TRITON_INTERPRET: (barriers, registers, spill bytes) of the gate/up GEMV without
    and with its routing, and of this kernel at its tiles."""
    from sm90_inspect import compile_sm90, ptxas_usage

    from roofline.kernels import moe_down

    gemv = fm._moe_gemv_kernel
    base = dict(PAIRS_PER_PROGRAM=1, A_PER_PAIR=8, BLOCK_N=8, BLOCK_K=256, NUM_STAGES=3,
                SILU_MUL=True, MUL_WEIGHT=False, QUANT=0, GROUP=0, WIDEN=0, RESIDUAL=False,
                PDL=False, PREFETCH_LINES=1, LINE_BYTES=128, FAST_FP8=True, LATE_TRIGGER=False,
                ROUTE=True, RENORMALIZE=True, BLOCK_E=128, ROUTE_COPIES=4)  # fmt: skip
    sig = {n: "constexpr" if n in base else "i32" for n in gemv.arg_names}
    sig.update(a_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", o_ptr="*bf16", out_ptr="*bf16",
               ids_ptr="*i64", weights_ptr="*bf16", res_ptr="*bf16",
               logits_ptr="*bf16")  # fmt: skip
    divisible = ("N", "K", "num_experts", "stride_am", "stride_we", "stride_wn", "stride_om")
    report = {}
    for label, route in (("gate/up", dict(ROUTE=False)), ("gate/up routing", {})):
        kernel = compile_sm90(gemv, sig, dict(base, **route), 4, divisible)
        report[label] = (kernel.asm["ptx"].count("bar.sync"), *ptxas_usage(kernel))
    wide = moe_down._moe_down_wide_kernel
    consts = dict(TOP_K=8, BLOCK_J=8, NUM_STAGES=3, QUANT=False, RESIDUAL=True)
    sig = {n: "constexpr" if n in consts or n.startswith("BLOCK_") else "i32"
           for n in wide.arg_names}  # fmt: skip
    sig.update(act_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", ids_ptr="*i64",
               weights_ptr="*bf16", res_ptr="*bf16", out_ptr="*bf16")  # fmt: skip
    for block_n, block_k in ((8, 128), (4, 256)):
        tiles = dict(consts, BLOCK_N=block_n, BLOCK_K=block_k)
        kernel = compile_sm90(wide, sig, tiles, 4, ("H", "INTER", "stride_am", "stride_we",
                                                     "stride_wn"))  # fmt: skip
        report[f"down {block_n}x{block_k}"] = (kernel.asm["ptx"].count("bar.sync"),
                                               *ptxas_usage(kernel))  # fmt: skip
    return report


@pytest.mark.skipif(ON_GPU, reason="the GPU compiles the kernels itself in the tests above")
def test_compiles_for_hopper() -> None:
    """Routing with one copy of the logits a warp adds few barriers to the gate/up GEMV (one
    copy a program added 36) and no spills; the down kernel's tiles compile without spills."""
    from sm90_inspect import report_in_subprocess

    pytest.importorskip("triton.backends.nvidia.compiler")
    report = report_in_subprocess("test_moe_down")
    assert report["gate/up routing"][0] - report["gate/up"][0] <= 8, report
    assert report["gate/up routing"][1] <= report["gate/up"][1] + 8, report
    assert all(0 < regs <= 255 and spills == 0 for _, regs, spills in report.values()), report
