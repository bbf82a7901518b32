"""The decode GEMV for quantized weights (``kernels.quant_gemv``) against x times the exactly
dequantized weight in fp32, for int8 (per channel, grouped), int4 (symmetric and with offsets,
groups smaller and larger than the K step), fp8 (per channel, per tensor; every conversion
route), both unpack paths, one row (CUDA cores) and several (tensor cores), bias, the SiLU-and-mul
prologue, and the configs it must refuse."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels.activation import silu_and_mul_ref
from roofline.kernels.dequant_gemm import dequantize_ref
from roofline.kernels.quant_gemv import QuantGemvConfig, quant_gemv, supports
from roofline.quantization import formats

N, K = (4096, 4096) if ON_GPU else (40, 256)


def _weight(kind: str, group: int, symmetric: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) / K**0.5
    if kind == "int8":
        q = formats.quantize_int8(w, group, torch.bfloat16)
        return q.qweight.to(DEVICE), q.scales.to(DEVICE), None
    if kind == "int4":
        q = formats.quantize_int4(w, group, symmetric=symmetric, scale_dtype=torch.float16)
        return q.qweight.to(DEVICE), q.scales.to(DEVICE), q.offsets.to(DEVICE)
    q, s = formats.quantize_fp8(w, per_channel=group != 0)
    return q.to(DEVICE), s.to(DEVICE), None


def _expected(kind, x, qweight, scales, offsets, bias=None):
    w = dequantize_ref(kind, qweight, scales, offsets, torch.float32)  # [N, K] exact
    out = x.float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# (kind, group, unpack, block_k): block_k below, at and above the group
CASES = [
    ("int8", K, 1, 128),
    ("int8", K, 0, 256),
    ("int8", 64, 1, 128),
    ("int8", 128, 0, 64),
    ("int4", 32, 1, 128),
    ("int4", 128, 1, 64),
    ("int4", 128, 1, 256),
    ("int4", 64, 0, 128),
    ("int4", 128, 2, 256),
    ("int4", 128, 2, 128),
    ("fp8", K, 0, 128),
    ("fp8", K, 1, 256),
    ("fp8", 0, 2, 64),
]


@pytest.mark.parametrize("kind,group,unpack,block_k", CASES)
@pytest.mark.parametrize("m,x_split", [(1, 0), (3, 0), (1, 1), (3, 1)])
def test_quant_gemv_matches_reference(
    kind: str, group: int, unpack: int, block_k: int, m: int, x_split: int
):
    qweight, scales, offsets = _weight(kind, group)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).to(DEVICE)
    cfg = QuantGemvConfig(16, block_k, 4, 2, unpack)
    if (
        m > 1
        and (block_k if kind == "fp8" else min(block_k, group) // (8 if kind == "int4" else 4)) < 16
    ):
        with pytest.raises(ValueError, match="cannot run"):
            quant_gemv(kind, x, qweight, scales, offsets, bias, config=cfg)
        return
    got = quant_gemv(kind, x, qweight, scales, offsets, bias, config=cfg)
    assert_close(got, _expected(kind, x, qweight, scales, offsets, bias), torch.bfloat16)


@pytest.mark.parametrize("m,unpack", [(1, None), (16, None), (2, 2)])
def test_symmetric_int4_fp16(m: int, unpack: int | None) -> None:
    qweight, scales, offsets = _weight("int4", 128, symmetric=True, seed=5)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    x = x.to(torch.float16)
    assert supports("int4", x, qweight, scales)
    cfg = None if unpack is None else QuantGemvConfig(8, 256, 4, 2, unpack, 0, 1)
    got = quant_gemv("int4", x, qweight, scales, offsets, config=cfg)
    assert_close(got, _expected("int4", x, qweight, scales, offsets), torch.bfloat16)


@pytest.mark.parametrize("kind,group,unpack", [("int4", 128, 2), ("int8", K, 1), ("fp8", K, 0)])
def test_large_m_row_blocks(kind: str, group: int, unpack: int) -> None:
    """M above the decode buckets: several row blocks of BLOCK_M rows, the last one partial."""
    qweight, scales, offsets = _weight(kind, group, seed=10)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    x = x.to(DEVICE)
    cfg = QuantGemvConfig(16, 128, 4, 2, unpack, 16)
    got = quant_gemv(kind, x, qweight, scales, offsets, config=cfg)
    assert_close(got, _expected(kind, x, qweight, scales, offsets), torch.bfloat16)


def test_fp32_activations_one_row() -> None:
    qweight, scales, _ = _weight("int8", K, seed=7)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    got = quant_gemv("int8", x, qweight, scales, config=QuantGemvConfig(8, 128, 4, 2, 1))
    torch.testing.assert_close(
        got, _expected("int8", x, qweight, scales, None), atol=1e-4, rtol=1e-4
    )
    assert not supports("int8", x.expand(2, K), qweight, scales)  # several fp32 rows: refused


@pytest.mark.parametrize("kind,group", [("int4", 128), ("int8", K), ("fp8", K)])
def test_silu_mul_prologue(kind: str, group: int) -> None:
    qweight, scales, offsets = _weight(kind, group, seed=3)
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(1, 2 * K, generator=gen).to(torch.bfloat16).to(DEVICE)
    expected = _expected(kind, silu_and_mul_ref(gate_up), qweight, scales, offsets)
    got = quant_gemv(kind, gate_up, qweight, scales, offsets, silu_mul=True)
    assert_close(got, expected, torch.bfloat16)


def test_refusals() -> None:
    qweight, scales, offsets = _weight("int4", 32)
    x = torch.zeros(1, K + 2, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="does not match"):
        quant_gemv("int4", x, qweight, scales, offsets)
    x = torch.zeros(257, K, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        quant_gemv("int4", x, qweight, scales, offsets)
    unaligned = qweight[:, 1:-1]  # rows not 4-byte aligned
    assert not supports("int4", torch.zeros(1, K - 4, device=DEVICE), unaligned, scales)


@pytest.mark.parametrize("m,k", [(3, 200), (2, 4096)])
def test_fp8_per_token_quantization_matches_torch(m: int, k: int) -> None:
    """Scales exactly; the clamped quotients exactly (fp32 output); on a GPU the e4m3 values
    too (the interpreter's fp8 rounding is not the hardware's: it drops mantissa carries)."""
    from roofline.kernels.fp8_quant import quantize_fp8_per_token

    gen = torch.Generator().manual_seed(9)
    rows = torch.tensor([1.0, 1e-3, 30.0])[:m, None]
    x = (torch.randn(m, k, generator=gen) * rows).to(torch.bfloat16).to(DEVICE)
    x[0, 5] = 0
    x[-1, 7] = 1e4  # one outlier sets its row's scale
    q_ref, scales_ref = formats.quantize_fp8_per_token(x)
    quotients, scales = quantize_fp8_per_token(x, out_dtype=torch.float32)
    assert torch.equal(scales, scales_ref)
    assert torch.equal(quotients, (x.float() / scales_ref).clamp(-448, 448))
    if ON_GPU:
        q, scales = quantize_fp8_per_token(x)
        assert torch.equal(q.float(), q_ref.float())
