"""Fused MoE with quantized experts (int8 / fp8 e4m3 with per-channel scales, int4 with group
scales and offsets, symmetric or with zero points) against the dequantize-then-reference loop,
on both kernel paths; and the expert-parallel ``NOT_LOCAL`` id, which must contribute nothing
whichever path runs it."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, assert_close
from torch import nn

from roofline.kernels.fused_moe import fused_moe, fused_moe_ref, route_ref
from roofline.quantization import formats
from roofline.quantization.moe import GroupInt4MoEMethod, PerChannelMoEMethod


def _experts(num_experts: int, hidden: int, inter: int, gen: torch.Generator):
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13, w2


def _quantized(kind: str, w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """A module holding the stacks as ``PerChannelMoEMethod`` stores them (loaded in two
    halves of the experts and, for w13, the gate and up rows apart, as a checkpoint would)."""
    num_experts, two_inter, hidden = w13.shape
    layer = nn.Module()
    if kind.startswith("int4"):  # groups of 32 (int4 test shapes have K a multiple of 32)
        method = GroupInt4MoEMethod(32, symmetric=kind == "int4")
    else:
        method = PerChannelMoEMethod(kind)
    method.create_weights(layer, num_experts, two_inter // 2, hidden, dtype)
    half, inter = num_experts // 2, two_inter // 2
    for experts in (slice(0, half), slice(half, num_experts)):
        method.load(layer, "w13", experts, slice(0, inter), w13[experts, :inter])
        method.load(layer, "w13", experts, slice(inter, None), w13[experts, inter:])
        method.load(layer, "w2", experts, slice(None), w2[experts])
    return layer.to(DEVICE)


def test_expert_layouts_are_the_canonical_ones() -> None:
    """Each expert's rows quantize exactly as ``formats`` quantizes that expert's matrix."""
    gen = torch.Generator().manual_seed(0)
    w13, w2 = _experts(4, 32, 32, gen)
    layer = _quantized("int8", w13, w2, torch.float32).cpu()
    q = formats.quantize_int8(w13[2], 32, torch.float32)
    assert torch.equal(layer.w13_weight[2], q.qweight)
    assert torch.equal(layer.w13_scale[2], q.scales[:, 0])
    layer = _quantized("fp8", w13, w2, torch.bfloat16).cpu()
    q8, s8 = formats.quantize_fp8(w2[1])
    assert torch.equal(layer.w2_weight[1].view(torch.uint8), q8.view(torch.uint8))
    assert torch.equal(layer.w2_scale[1], s8) and layer.w2_scale.dtype == torch.float32
    layer = _quantized("int4-asym", w13, w2, torch.float32).cpu()
    q4 = formats.quantize_int4(w13[3], 32, False, torch.float32)
    assert torch.equal(layer.w13_weight[3], q4.qweight)
    assert torch.equal(layer.w13_offset[3], q4.offsets)


SHAPES = [(1, 8, 2, 64, 48), (2, 16, 4, 64, 32), (37, 8, 2, 32, 48), (100, 2, 1, 32, 16)]


KIND_DTYPES = [("int8", torch.float32), ("int8", torch.bfloat16), ("fp8", torch.bfloat16)]
KIND_DTYPES += [("int4", torch.float32), ("int4-asym", torch.bfloat16)]


@pytest.mark.parametrize("kind,dtype", KIND_DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter", SHAPES)
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_quantized_experts_match_dequantized_reference(
    kind, dtype, num_tokens, num_experts, top_k, hidden, inter, path
) -> None:
    if path == "gemv" and num_tokens > 2:
        pytest.skip("the GEMV path serves decode sizes")
    if kind.startswith("int4") and inter % 32:
        inter = 64  # whole groups of 32
    gen = torch.Generator().manual_seed(num_tokens * 7 + hidden)
    w13, w2 = _experts(num_experts, hidden, inter, gen)
    layer = _quantized(kind, w13, w2, dtype)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE)
    weights, ids = route_ref(logits, top_k, renormalize=True)
    weights = weights.to(dtype)
    scales = {n: t for n, t in layer.named_parameters() if not n.endswith("weight")}
    out = fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids, force_path=path, **scales)
    # the reference: each touched expert dequantized (in fp32 here), then the plain loop
    ref = fused_moe_ref(
        x.float(), layer.w13_weight, layer.w2_weight, weights.float(), ids, **scales
    )
    assert out.dtype == dtype
    assert_close(out, ref, dtype)
    # and against the unquantized experts: the quantization error stays small
    full = fused_moe_ref(x.float(), w13.to(DEVICE), w2.to(DEVICE), weights.float(), ids)
    err = (out.float() - full).abs().max() / full.abs().max()
    assert err < {"int8": 0.03, "fp8": 0.12}.get(kind, 0.25)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize(
    "num_tokens,path,widen", [(2, "gemv", 1), (2, "gemv", 2), (37, "grouped", 1)]
)
def test_tf32_widening_matches_reference(kind, num_tokens, path, widen, monkeypatch) -> None:
    """WIDEN 1: int8 widened by the magic-number trick, fp32 operands on TF32 tensor cores (the
    grouped GEMM) or CUDA cores (the GEMV); WIDEN 2 (GEMV): ``mixed_gemm``'s widening to bf16
    first: still the dequantized reference."""
    from roofline.kernels import fused_moe as mod

    monkeypatch.setitem(mod.GEMV_CONFIG_8BIT, "WIDEN", widen)
    monkeypatch.setitem(mod.GEMM_CONFIG_8BIT, "WIDEN", 1)
    gen = torch.Generator().manual_seed(11)
    w13, w2 = _experts(8, 64, 48, gen)
    layer = _quantized(kind, w13, w2, torch.bfloat16)
    x = torch.randn(num_tokens, 64, generator=gen).bfloat16().to(DEVICE)
    weights, ids = route_ref(torch.randn(num_tokens, 8, generator=gen).to(DEVICE), 2, True)
    scales = dict(w13_scale=layer.w13_scale, w2_scale=layer.w2_scale)
    out = fused_moe(x, layer.w13_weight, layer.w2_weight, weights.bfloat16(), ids,
                    force_path=path, **scales)  # fmt: skip
    ref = fused_moe_ref(x.float(), layer.w13_weight, layer.w2_weight, weights, ids, **scales)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize(
    "num_tokens,path", [(1, "gemv"), (2, "gemv"), (1, "grouped"), (40, "grouped")]
)
def test_not_local_pairs_contribute_nothing(quantized, num_tokens, path) -> None:
    """Ids equal to E (another rank's expert) give what the reference gives with those pairs
    dropped; a batch whose pairs are all elsewhere gives zeros."""
    num_experts, top_k, hidden, inter = 4, 2, 32, 16
    gen = torch.Generator().manual_seed(5 + num_tokens)
    w13, w2 = _experts(num_experts, hidden, inter, gen)
    if quantized:
        layer = _quantized("int8", w13, w2, torch.float32)
        args = (layer.w13_weight, layer.w2_weight)
        scales = dict(w13_scale=layer.w13_scale, w2_scale=layer.w2_scale)
    else:
        args, scales = (w13.to(DEVICE), w2.to(DEVICE)), {}
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    ids = torch.stack(
        [torch.randperm(2 * num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    ids = torch.where(ids >= num_experts, num_experts, ids).to(DEVICE)  # about half elsewhere
    ids[0, 0] = num_experts  # at least one elsewhere
    weights = torch.rand(num_tokens, top_k, generator=gen).to(DEVICE)
    out = fused_moe(x, *args, weights, ids, force_path=path, **scales)
    kept = ids != num_experts
    dropped = fused_moe_ref(x, *args, weights * kept, torch.where(kept, ids, 0), **scales)
    assert_close(out, dropped, torch.float32)
    assert_close(fused_moe_ref(x, *args, weights, ids, **scales), dropped, torch.float32)
    elsewhere = torch.full_like(ids, num_experts)
    zeros = fused_moe(x, *args, weights, elsewhere, force_path=path, **scales)
    assert torch.equal(zeros, torch.zeros_like(x))


def test_bad_quantized_arguments_are_refused() -> None:
    gen = torch.Generator().manual_seed(9)
    w13, w2 = _experts(2, 32, 32, gen)
    layer = _quantized("int8", w13, w2, torch.float32)
    x = torch.randn(1, 32).to(DEVICE)
    w, ids = torch.ones(1, 1).to(DEVICE), torch.zeros(1, 1, dtype=torch.long).to(DEVICE)
    with pytest.raises(ValueError, match="both"):
        fused_moe(x, layer.w13_weight, layer.w2_weight, w, ids, w13_scale=layer.w13_scale)
    with pytest.raises(ValueError, match="16-bit experts"):
        fused_moe(x, layer.w13_weight, layer.w2_weight, w, ids)
    with pytest.raises(ValueError, match="per-channel"):
        fused_moe(
            x, layer.w13_weight, layer.w2_weight, w, ids,
            w13_scale=layer.w13_scale[:, :4], w2_scale=layer.w2_scale,
        )  # fmt: skip
    with pytest.raises(ValueError, match="int8 or fp8"):
        PerChannelMoEMethod("int4")
    int4 = _quantized("int4", w13, w2, torch.float32)
    with pytest.raises(ValueError, match="offsets"):
        fused_moe(
            x, int4.w13_weight, int4.w2_weight, w, ids,
            w13_scale=int4.w13_scale, w2_scale=int4.w2_scale,
        )  # fmt: skip
    with pytest.raises(ValueError, match="group size 32 does not divide the experts' 48"):
        GroupInt4MoEMethod(32).create_weights(nn.Module(), 2, 48, 64, torch.float32)
    with pytest.raises(ValueError, match="groups must be one of"):
        GroupInt4MoEMethod(16)


def test_warm_up_takes_int4_stacks(monkeypatch) -> None:
    """warm_up builds its inputs at x's width, not the packed stack's (H / 2 bytes a row): every
    call it makes passes ``fused_moe``'s shape checks."""
    from roofline.kernels import fused_moe as mod

    layer = _quantized("int4", *_experts(4, 64, 32, torch.Generator().manual_seed(0)),
                       torch.bfloat16)  # fmt: skip
    scales = {n: t for n, t in layer.named_parameters() if not n.endswith("weight")}
    seen = []

    def check_only(x, w13, w2, weights, ids, **quant):
        names = ("w13_scale", "w2_scale", "w13_offset", "w2_offset")
        seen.append(mod._layout(x, w13, w2, ids, tuple(quant.get(n) for n in names)).quant)

    monkeypatch.setattr(mod, "fused_moe", check_only)
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device=DEVICE)
    mod.warm_up(x, layer.w13_weight, layer.w2_weight, 2, scales)
    assert seen and set(seen) == {2}
