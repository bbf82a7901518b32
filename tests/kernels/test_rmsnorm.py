"""RMSNorm and fused residual-add + RMSNorm against their torch references (HF numerics)."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(7, 4096), (3, 5, 1000)] if ON_GPU else [(7, 256), (3, 5, 100)]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(DEVICE)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, _, weight = _inputs(shape, dtype)
    out = rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, rms_norm_ref(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, residual, weight = _inputs(shape, dtype, seed=1)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)
    assert_close(out, ref_out, dtype)


def test_reference_matches_hf_formula() -> None:
    x, _, weight = _inputs((4, 64), torch.bfloat16, seed=2)
    xf = x.float()
    hf = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-6), hf, atol=0, rtol=0)


def test_fp32_weight_promotes_output() -> None:
    x, _, weight = _inputs((5, 96), torch.bfloat16, seed=3)
    out = rms_norm(x, weight.float(), 1e-6)
    assert out.dtype == torch.float32
    assert_close(out, rms_norm_ref(x, weight.float(), 1e-6), torch.bfloat16)


def test_strided_rows() -> None:
    x, _, weight = _inputs((6, 2 * 128), torch.float16, seed=4)
    view = x[:, :128]  # row stride 256, features contiguous
    assert_close(rms_norm(view, weight[:128], 1e-6), rms_norm_ref(view, weight[:128], 1e-6),
                 torch.float16)  # fmt: skip
