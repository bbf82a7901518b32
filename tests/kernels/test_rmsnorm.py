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


def _exact_sum_inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    """x = k / 16 for small integers k, so every square and every partial sum of squares is exact
    in fp32: the statistic cannot depend on the summation order, and a bit-exact comparison tests
    exactly the rounding points. The weight is arbitrary (its product rounds)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randint(-48, 49, shape, generator=gen) / 16).to(dtype).to(DEVICE)
    residual = (torch.randint(-48, 49, shape, generator=gen) / 16).to(dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(dtype).to(DEVICE)
    return x, residual, weight


def _cuda_mean(t: torch.Tensor) -> torch.Tensor:
    """``t.mean(-1, keepdim=True)`` as torch computes it on CUDA, where HF runs next to the kernel:
    ``sum * fp32(1 / n)``. (On the CPU torch divides the sum by n, which can differ by an ulp.)"""
    factor = torch.tensor(1.0, dtype=torch.float32) / t.shape[-1]
    cuda_mean = t.sum(-1, keepdim=True) * factor.to(t.device)
    if t.is_cuda:
        assert torch.equal(cuda_mean, t.mean(-1, keepdim=True))
    return cuda_mean


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [256, 576])
def test_bit_exact_with_hf_rounding(dtype: torch.dtype, hidden: int) -> None:
    """HF's LlamaRMSNorm op sequence (x.float(), x * rsqrt(mean(x^2) + eps), .to(dtype), then
    weight * that in dtype) and its bf16/fp16 residual add, bit for bit (torch.equal)."""
    x, residual, weight = _exact_sum_inputs((9, hidden), dtype, seed=5)
    eps = 1e-5

    def hf_norm(h: torch.Tensor) -> torch.Tensor:
        hf32 = h.to(torch.float32)
        variance = _cuda_mean(hf32.pow(2))
        return weight * (hf32 * torch.rsqrt(variance + eps)).to(dtype)

    assert torch.equal(rms_norm(x, weight, eps), hf_norm(x))
    out, new_residual = fused_add_rms_norm(x, residual, weight, eps)
    hf_residual = residual + x  # HF: hidden_states = residual + hidden_states, in dtype
    assert torch.equal(new_residual, hf_residual)
    assert torch.equal(out, hf_norm(hf_residual))


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


def test_pdl_variant_compiles_for_hopper() -> None:
    """As a programmatic dependent the norm weight is read before ``griddepcontrol.wait`` and the
    rows (the previous kernel's output) only after it."""
    from hopper_variants import compile_for_hopper

    pointers = dict.fromkeys(("x_ptr", "residual_ptr", "weight_ptr", "out_ptr",
                              "residual_out_ptr"), "bf16")  # fmt: skip
    variants = [dict(HAS_RESIDUAL=h, BLOCK=1024, PDL=True) for h in (False, True)]
    options = dict(num_warps=2, enable_fp_fusion=False)
    ptxs = compile_for_hopper("roofline.kernels.rmsnorm", "_rms_norm_kernel", variants, pointers,
                              ("inv_hidden", "eps"), options)  # fmt: skip
    for has_residual, ptx in zip((False, True), ptxs):
        wait = ptx.index("griddepcontrol.wait")
        before, after = ptx[:wait], ptx[wait:]
        loads = before.count("ld.global")  # the weight's, one row of loads
        assert loads > 0 and "st.global" not in before
        assert after.count("ld.global") == loads * (1 + has_residual)  # x (and the residual)
