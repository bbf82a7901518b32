"""The fp8 W8A8 descriptor GEMM (``kernels.fp8_gemm``) against its reference: one program per
tile, persistent, split-K (the last slice sums), per-tensor weight scales, a bias, row and
column counts that are not multiples of the tiles."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE

from roofline.kernels import fp8_gemm as fg
from roofline.quantization import formats


def operands(m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / 10).to(DEVICE)
    xq, xs = formats.quantize_fp8_per_token(x)
    qw, ws = formats.quantize_fp8(w)
    return xq, xs, qw, ws


CONFIGS = [
    fg.Fp8GemmConfig(32, 32, 32, 2, 1, 4, 2, 0),
    fg.Fp8GemmConfig(16, 64, 64, 1, 1, 4, 2, 1),
    fg.Fp8GemmConfig(32, 32, 32, 2, 3, 4, 2, 0),  # split-K, uneven slices (5 K tiles)
    fg.Fp8GemmConfig(16, 16, 32, 2, 1, 4, 2, fg.STREAM_K),  # a program per K step
]


@pytest.mark.parametrize("programs", [1, 3, 4, 7])
def test_stream_k_deals_iterations_over_any_program_count(monkeypatch, programs: int) -> None:
    """Ranges that start and end inside tiles, tiles shared by up to four programs, whole
    tiles in between; a second launch finds the arrival counters back at zero."""
    monkeypatch.setattr(fg, "num_sms", lambda device: programs)
    xq, xs, qw, ws = operands(37, 72, 160, seed=programs)
    cfg = fg.Fp8GemmConfig(16, 32, 32, 2, 1, 4, 2, fg.STREAM_K)
    ref = fg.fp8_gemm_ref(xq, xs, qw, ws, None, torch.bfloat16)
    for _ in range(2):
        got = fg.fp8_gemm(xq, xs, qw, ws, None, torch.bfloat16, cfg)
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("m,n,k", [(37, 72, 160), (5, 64, 64)])
def test_fp8_gemm_matches_the_reference(cfg, m: int, n: int, k: int) -> None:
    xq, xs, qw, ws = operands(m, n, k)
    bias = torch.randn(n).to(torch.bfloat16).to(DEVICE)
    for b in (None, bias):
        got = fg.fp8_gemm(xq, xs, qw, ws, b, torch.bfloat16, cfg)
        ref = fg.fp8_gemm_ref(xq, xs, qw, ws, b, torch.bfloat16)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-3)
    if cfg.split_k > 1:  # the arrival counters are back at zero: a second launch agrees
        again = fg.fp8_gemm(xq, xs, qw, ws, None, torch.bfloat16, cfg)
        torch.testing.assert_close(again.float(), ref.float() - bias.float(), rtol=1e-2, atol=2e-2)


def test_fp8_gemm_per_tensor_scale_and_refusals() -> None:
    xq, xs, qw, _ = operands(9, 40, 96, seed=1)
    scale = torch.tensor([0.013], device=DEVICE)
    got = fg.fp8_gemm(xq, xs, qw, scale, None, torch.bfloat16, CONFIGS[0])
    ref = fg.fp8_gemm_ref(xq, xs, qw, scale, None, torch.bfloat16)
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-3)
    with pytest.raises(ValueError, match="e4m3"):
        fg.fp8_gemm(xq.float(), xs, qw, scale, None, torch.bfloat16, CONFIGS[0])
    with pytest.raises(ValueError, match="e4m3"):
        fg.fp8_gemm(xq[:, :90].contiguous(), xs, qw[:, :90].contiguous(), scale, None,
                    torch.bfloat16, CONFIGS[0])  # fmt: skip


def test_w8a8_dispatch_takes_the_tables_descriptor_pick(monkeypatch) -> None:
    """``quantization.fp8.fp8_gemm`` runs the config ``W8A8_GEMMS`` holds for (N, K, M bucket)."""
    from roofline.kernels import mixed_gemm
    from roofline.quantization import fp8

    xq, xs, qw, ws = operands(20, 48, 128, seed=2)
    cfg = fg.Fp8GemmConfig(16, 16, 64, 1, 2, 4, 2, 0)
    monkeypatch.setitem(fp8.W8A8_GEMMS, (48, 128, mixed_gemm.m_bucket(20)), ("tma", *cfg))
    calls = []
    real = fg.fp8_gemm
    monkeypatch.setattr(fg, "fp8_gemm", lambda *a: calls.append(a[-1]) or real(*a))
    bias = torch.randn(48).to(torch.bfloat16).to(DEVICE)
    got = fp8.fp8_gemm(xq, xs, qw, ws, bias, torch.bfloat16)
    assert calls == [cfg]
    ref = fg.fp8_gemm_ref(xq, xs, qw, ws, bias, torch.bfloat16)
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-3)
