"""Fused dequant skinny GEMM and the dequantize kernel against the plain-torch reference
(dequantize, round to x's dtype, fp32 matmul) for int8 (per channel and grouped), int4 (groups
smaller and larger than the K tile, with offsets) and fp8 (per channel and per tensor), with bias,
several row counts (one row on CUDA cores, more on tensor cores, more than one row block) and the
SiLU-and-mul prologue."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels.activation import silu_and_mul_ref
from roofline.kernels.dequant_gemm import (
    dequant_gemm,
    dequant_gemm_ref,
    dequantize_ref,
    dequantize_weight,
)
from roofline.quantization import formats

N, K = (4096, 4096) if ON_GPU else (48, 256)


def _weight(kind: str, group: int, seed: int = 0, n: int = N, k: int = K):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    if kind == "int8":
        q = formats.quantize_int8(w, group, torch.bfloat16)
        return q.qweight.to(DEVICE), q.scales.to(DEVICE), None
    if kind == "int4":
        q = formats.quantize_int4(w, group, symmetric=False, scale_dtype=torch.float16)
        return q.qweight.to(DEVICE), q.scales.to(DEVICE), q.offsets.to(DEVICE)
    q, s = formats.quantize_fp8(w, per_channel=group != 0)
    return q.to(DEVICE), s.to(DEVICE), None


CASES = [("int8", K), ("int8", 32), ("int4", 32), ("int4", 128), ("fp8", K), ("fp8", 0)]


@pytest.mark.parametrize("kind,group", CASES)
@pytest.mark.parametrize("m", [1, 3, 20] if not ON_GPU else [1, 4, 16, 64, 100])
def test_dequant_gemm_matches_reference(kind: str, group: int, m: int) -> None:
    qweight, scales, offsets = _weight(kind, group)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).to(DEVICE)
    expected = dequant_gemm_ref(kind, x, qweight, scales, offsets, bias)
    got = dequant_gemm(kind, x, qweight, scales, offsets, bias)
    assert_close(got, expected, torch.bfloat16)


@pytest.mark.parametrize("kind,group", CASES)
def test_dequantize_kernel_matches_reference(kind: str, group: int) -> None:
    qweight, scales, offsets = _weight(kind, group, seed=2)
    expected = dequantize_ref(kind, qweight, scales, offsets, torch.bfloat16)
    got = dequantize_weight(kind, qweight, scales, offsets, torch.bfloat16)
    assert torch.equal(got.float(), expected.float())
    buf = torch.full_like(got, float("nan"))  # into a caller's buffer: the same values
    assert dequantize_weight(kind, qweight, scales, offsets, torch.bfloat16, out=buf) is buf
    assert torch.equal(buf.float(), expected.float())
    with pytest.raises(ValueError, match="is not"):
        dequantize_weight(kind, qweight, scales, offsets, torch.bfloat16, out=buf[:, :-16])


def test_silu_mul_prologue() -> None:
    qweight, scales, offsets = _weight("int4", 32, seed=3)
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(1, 2 * K, generator=gen).to(torch.bfloat16).to(DEVICE)
    expected = dequant_gemm_ref("int4", silu_and_mul_ref(gate_up), qweight, scales, offsets)
    got = dequant_gemm("int4", gate_up, qweight, scales, offsets, silu_mul=True)
    assert_close(got, expected, torch.bfloat16)


def test_bad_shapes_refused() -> None:
    qweight, scales, offsets = _weight("int4", 32)
    x = torch.zeros(1, K + 2, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="does not match"):
        dequant_gemm("int4", x, qweight, scales, offsets)
