"""The TMA dense GEMM candidate (``kernels/dense_gemm.py``) against its fp32 reference: ragged
M and N edges (descriptor loads past the edge read zeros, stores are clipped) and split-K with
its fixed-order sum."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels.dense_gemm import GemmConfig, dense_gemm, dense_gemm_ref


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("shape", [(40, 48, 64), (16, 32, 96)])
def test_dense_gemm_matches_reference(shape: tuple[int, int, int], split_k: int) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(m + split_k)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    cfg = GemmConfig(64, 64, 64, 4, 3, split_k) if ON_GPU else GemmConfig(16, 32, 16, 4, 1, split_k)
    assert_close(dense_gemm(x, w, cfg), dense_gemm_ref(x, w), torch.bfloat16)


def test_dense_gemm_refuses_mismatched_operands() -> None:
    x = torch.zeros(4, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError):
        dense_gemm(
            x, torch.zeros(8, 16, dtype=torch.bfloat16, device=DEVICE), GemmConfig(16, 16, 16, 4, 1)
        )


def test_dense_gemm_silu_mul_matches_unfused() -> None:
    from roofline.kernels.activation import silu_and_mul_ref

    m, inter, k = 24, 64, 48
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(2 * inter, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    cfg = GemmConfig(64, 64, 64, 4, 3) if ON_GPU else GemmConfig(16, 32, 16, 4, 1)
    out = dense_gemm(x, w, cfg, silu_mul=True)
    assert out.shape == (m, inter)
    assert_close(out, silu_and_mul_ref(dense_gemm_ref(x, w)), torch.bfloat16)


def test_tuned_config_row_ranges(monkeypatch) -> None:
    from roofline.kernels import dense_gemm as dense

    a, b = GemmConfig(64, 64, 64, 4, 3), GemmConfig(128, 128, 64, 8, 4)
    monkeypatch.setattr(dense, "TUNED_CONFIGS", {(4096, 4096): [(9, 128, a), (129, 256, b)]})
    assert dense.tuned_config(4096, 4096, 64) == a and dense.tuned_config(4096, 4096, 200) == b
    assert dense.tuned_config(4096, 4096, 300) is None and dense.tuned_config(4096, 8, 64) is None


@pytest.mark.skipif(not ON_GPU, reason="the engine's dispatch runs the dense GEMM on CUDA only")
def test_linear_and_mlp_dispatch_follow_the_tables(monkeypatch) -> None:
    from roofline.kernels import dense_gemm as dense
    from roofline.kernels.activation import silu_and_mul_ref
    from roofline.layers.linear import MergedLinear, gate_up_silu, linear

    cfg = GemmConfig(64, 64, 64, 4, 3)
    x = torch.randn(32, 128, device=DEVICE).to(torch.bfloat16)
    layer = MergedLinear(128, [64, 64], params_dtype=torch.bfloat16).to(DEVICE)
    torch.nn.init.normal_(layer.weight, std=0.05)
    assert gate_up_silu(layer, x) is None  # empty tables: cuBLAS and the activation kernel
    monkeypatch.setattr(dense, "TUNED_CONFIGS", {(128, 128): [(9, 64, cfg)]})
    monkeypatch.setattr(dense, "TUNED_SILU_CONFIGS", {(128, 128): [(9, 64, cfg)]})
    ref = dense_gemm_ref(x, layer.weight)
    assert_close(linear(x, layer.weight, None), ref, torch.bfloat16)
    assert_close(gate_up_silu(layer, x), silu_and_mul_ref(ref), torch.bfloat16)
