"""The one-token down projection with the experts split over programs (``kernels.moe_down``)
against the down GEMV it replaces (the same bits: each expert's sum, rounding and weight, the
slot-order sum, the residual add), for 16-bit and 8-bit experts, with a not-local expert."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE

from roofline.kernels import fused_moe as fm
from roofline.kernels import last_program
from roofline.kernels.moe_down import moe_down_split
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


@pytest.mark.parametrize("kind", ["bf16", "fp32", "int8", "fp8"])
@pytest.mark.parametrize("residual", [True, False])
def test_same_bits_as_the_down_gemv(kind, residual, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(4)
    num_experts, inter, hidden = 8, 48, 40  # a ragged column block and K step
    w13, w2, scales = _layer(kind, num_experts, inter, hidden, gen)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    x = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE)
    h = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE) if residual else None
    for ids in ([[5, 2, 7]], [[1, num_experts, 3]]):  # the second: another rank's expert
        ids_t = torch.tensor(ids).to(DEVICE)
        weights = torch.tensor([[0.5, 0.3, 0.2]]).to(dtype).to(DEVICE)
        layout = 0 if kind in ("bf16", "fp32") else 1
        monkeypatch.setitem(fm.SPLIT_DOWN, layout, False)
        want = fm.fused_moe(x, w13, w2, weights, ids_t, residual=h, **scales)
        monkeypatch.setitem(fm.SPLIT_DOWN, layout, True)
        got = fm.fused_moe(x, w13, w2, weights, ids_t, residual=h, **scales)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not last_program._COUNTERS[(x.device, "moe_down")].any()


def test_rejects_bad_shapes() -> None:
    act = torch.zeros(2, 16, dtype=torch.bfloat16, device=DEVICE)
    w2 = torch.zeros(4, 32, 16, dtype=torch.bfloat16, device=DEVICE)
    out = torch.zeros(1, 32, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.zeros(1, 3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="one token"):
        moe_down_split(act, w2, torch.ones(1, 3, dtype=torch.bfloat16, device=DEVICE), ids, out)


def test_compiles_for_hopper() -> None:
    from hopper_variants import compile_for_hopper

    base = dict(TOP_K=8, BLOCK_N=8, BLOCK_K=256, NUM_STAGES=3, RESIDUAL=True)
    pointers = {n: "bf16" for n in ("act_ptr", "w_ptr", "weights_ptr", "res_ptr", "out_ptr")}
    pointers.update(s_ptr="fp32", ids_ptr="i64", part_ptr="fp32", counter_ptr="i32")
    ptxs = compile_for_hopper("roofline.kernels.moe_down", "_moe_down_split_kernel",
                              [dict(base, QUANT=False)], pointers, (),
                              dict(num_warps=4))  # fmt: skip
    assert "atom." in ptxs[0]
