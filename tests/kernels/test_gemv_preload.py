"""The one-row GEMV with its weight preloaded before the PDL wait, against ``skinny_gemm`` with
the same prologue / epilogue (norm, SiLU-and-mul, bias, residual) and the torch references."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE

from roofline.kernels import gemv_preload
from roofline.kernels.gemv import silu_mul_skinny_gemm_ref, skinny_gemm, skinny_gemm_ref
from roofline.kernels.rmsnorm import rms_norm_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(40, 96), (64, 128)])
@pytest.mark.parametrize("kind", ["norm", "silu+residual", "bias+residual"])
def test_matches_skinny_gemm(dtype, n, k, kind) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    kw: dict = {}
    if kind == "norm":
        x = (2 * torch.randn(1, k, generator=gen)).to(dtype).to(DEVICE)
        nw = (1 + 0.2 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
        kw["norm"] = (nw, 1e-6)
        ref = skinny_gemm_ref(rms_norm_ref(x, nw, 1e-6), w)
    else:
        res = torch.randn(1, n, generator=gen).to(dtype).to(DEVICE)
        kw["residual"] = res
        if kind == "silu+residual":
            x = torch.randn(1, 2 * k, generator=gen).to(dtype).to(DEVICE)
            kw["silu_mul"] = True
            ref = (silu_mul_skinny_gemm_ref(x, w).float() + res.float()).to(dtype)
        else:
            x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
            kw["bias"] = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
            ref = (skinny_gemm_ref(x, w, kw["bias"]).float() + res.float()).to(dtype)
    bias = kw.pop("bias", None)
    got = gemv_preload.gemv_preload(x, w, bias, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, skinny_gemm(x, w, bias, **kw), atol=tol, rtol=tol)
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def test_applies_only_when_switched_on_and_small() -> None:
    x = torch.zeros(1, 1024, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(4096, 1024, dtype=torch.bfloat16, device=DEVICE)
    was = gemv_preload._ENABLED
    gemv_preload.set_enabled(False)
    assert not gemv_preload.applies(x, w)
    gemv_preload.set_enabled(True)
    try:
        assert gemv_preload.applies(x, w)  # Qwen3-0.6B's qkv: 8 x 1024 per program
        down = torch.zeros(1024, 3072, dtype=torch.bfloat16, device=DEVICE)
        assert gemv_preload.applies(torch.zeros(1, 3072, dtype=torch.bfloat16), down)
        assert gemv_preload.k_tiles(3072) == (2048, 1024)  # not a padded 4096
        big = torch.zeros(4096, 4096, dtype=torch.bfloat16, device=DEVICE)  # the 8B's o_proj
        assert not gemv_preload.applies(torch.zeros(1, 4096, dtype=torch.bfloat16), big)
        moe_qkv = torch.zeros(5120, 2048, dtype=torch.bfloat16, device=DEVICE)  # 30B-A3B: slower
        assert not gemv_preload.applies(torch.zeros(1, 2048, dtype=torch.bfloat16), moe_qkv)
        assert not gemv_preload.applies(torch.zeros(2, 1024, dtype=torch.bfloat16), w)
    finally:
        gemv_preload.set_enabled(was)


def test_compiles_for_hopper() -> None:
    from hopper_variants import compile_for_hopper

    pointers = dict.fromkeys(("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "norm_w_ptr",
                              "residual_ptr"), "bf16")  # fmt: skip
    base = dict(HAS_BIAS=False, BLOCK_N=8, BLOCK_K=1024, BLOCK_K2=0, SILU_MUL=False,
                LIBDEVICE=True, RMS_NORM=True, ADD_RESIDUAL=False, PDL=True)  # fmt: skip
    # Qwen3-0.6B's down projection: K = 3072 as 2048 + 1024 columns
    down = dict(base, BLOCK_N=4, BLOCK_K=2048, BLOCK_K2=1024, SILU_MUL=True, RMS_NORM=False,
                ADD_RESIDUAL=True)  # fmt: skip
    module, kernel = "roofline.kernels.gemv_preload", "_gemv_preload_kernel"
    ptxs = compile_for_hopper(module, kernel, [base, down], pointers, ("inv_k", "eps"))
    for ptx in ptxs:
        wait = ptx.index("griddepcontrol.wait")
        assert "ld.global" in ptx[:wait]  # the weight is loaded before the wait
