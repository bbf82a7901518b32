"""The weight-left grouped expert GEMM (``kernels.fused_moe_t``): 16-bit, int8, fp8 and int4
experts against the (dequantizing) torch loop, including experts that receive no token, tokens
that share an expert, ``NOT_LOCAL`` pairs, and the Hopper compile of the tiles it ships."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, assert_close
from torch import nn

from roofline.kernels import fused_moe as fm
from roofline.quantization.moe import GroupInt4MoEMethod, PerChannelMoEMethod


def _layer(kind: str, num_experts: int, hidden: int, inter: int, gen: torch.Generator):
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    if kind == "bf16":
        return w13.bfloat16().to(DEVICE), w2.bfloat16().to(DEVICE), {}
    layer = nn.Module()
    method = GroupInt4MoEMethod(32) if kind == "int4" else PerChannelMoEMethod(kind)
    method.create_weights(layer, num_experts, inter, hidden, torch.bfloat16)
    method.load(layer, "w13", slice(None), slice(None), w13)
    method.load(layer, "w2", slice(None), slice(None), w2)
    layer = layer.to(DEVICE)
    scales = {n: t for n, t in layer.named_parameters() if not n.endswith("weight")}
    return layer.w13_weight, layer.w2_weight, scales


CASES = [(kind, 9, 16, 4) for kind in ("bf16", "int8", "fp8", "int4")]
CASES += [(kind, 40, 4, 2) for kind in ("bf16", "int4")]  # blocks of 32 token rows


@pytest.mark.parametrize("kind,num_tokens,num_experts,top_k", CASES)
def test_weight_left_matches_reference(kind, num_tokens, num_experts, top_k, monkeypatch):
    monkeypatch.setitem(fm.WEIGHT_LEFT, 0, float("inf"))  # 16-bit experts too
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_experts)
    hidden, inter = 64, 96
    w13, w2, scales = _layer(kind, num_experts, hidden, inter, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16().to(DEVICE)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE)
    logits[:, num_experts // 2 :] -= 100.0  # the upper experts receive no token
    weights, ids = fm.route_ref(logits, top_k, renormalize=True)
    weights = weights.bfloat16()
    got = {}
    for layout, limit in ((0, float("inf")), (0, 0.0)):  # weight-left, then the first kernel
        if kind != "bf16":
            layout = 2 if kind == "int4" else 1
        monkeypatch.setitem(fm.WEIGHT_LEFT, layout, limit)
        got[limit] = fm.fused_moe(x, w13, w2, weights, ids, force_path="grouped", **scales)
    w13_ref, w2_ref = (w13.float(), w2.float()) if kind == "bf16" else (w13, w2)
    ref = fm.fused_moe_ref(x.float(), w13_ref, w2_ref, weights.float(), ids, **scales)
    assert_close(got[float("inf")], ref, torch.bfloat16)
    assert_close(got[float("inf")], got[0.0].float(), torch.bfloat16)
    # NOT_LOCAL: the experts from E/2 up live on another rank and add nothing
    half = num_experts // 2
    mine = ids < half
    local = {n: t[:half] for n, t in scales.items()}
    out = fm.fused_moe(x, w13[:half], w2[:half], weights, torch.where(mine, ids, half),
                       force_path="grouped", **local)  # fmt: skip
    ref_half = fm.fused_moe_ref(x.float(), w13_ref, w2_ref, (weights * mine).float(),
                                torch.where(mine, ids, 0), **scales)  # fmt: skip
    assert_close(out, ref_half, torch.bfloat16)


def test_weight_left_tiles_compile_for_hopper() -> None:
    """sm_90 compile of the shipped tiles (64 weight rows x 16 / 128 token rows x 128 of K):
    the MMA is a warpgroup MMA, for every weight kind."""
    from hopper_variants import compile_for_hopper

    variants, kinds = [], [(-1, "bf16", "bf16"), (0, "i8", "bf16"), (2, "fp8e4nv", "fp32"),
                           (1, "u8", "bf16")]  # fmt: skip
    for wkind, _, _ in kinds:
        for block_m in (16, 128):
            variants.append(dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, NUM_STAGES=3,
                                 SILU_MUL=block_m == 16, MUL_WEIGHT=block_m != 16, WKIND=wkind,
                                 GROUP=128 if wkind == 1 else 0, FAST_FP8=True))  # fmt: skip
    for i, (_, wdt, sdt) in enumerate(kinds):
        pointers = {n: "bf16" for n in ("a_ptr", "out_ptr", "weights_ptr")}
        pointers.update(q_ptr=wdt, s_ptr=sdt, o_ptr=sdt, sorted_ids_ptr="i32",
                        block_expert_ptr="i32", num_padded_ptr="i64")  # fmt: skip
        ptxs = compile_for_hopper("roofline.kernels.fused_moe_t", "_moe_gemm_t_kernel",
                                  variants[2 * i : 2 * i + 2], pointers, (),
                                  dict(num_warps=4))  # fmt: skip
        assert all("wgmma" in ptx for ptx in ptxs)
