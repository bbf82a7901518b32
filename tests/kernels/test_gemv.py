"""Skinny GEMM (decode GEMV) against its fp32 torch reference: both reduction paths, odd N and K
(clamped rows, the masked K tail), bias, M above one row block, strided rows, ``out=``."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels import DEFAULT_NUM_SMS, gemv
from roofline.kernels.gemv import heuristic_config, pick_config, skinny_gemm, skinny_gemm_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (N, K): odd sizes exercise clamped weight rows and the masked K tail.
SHAPES = [(4096, 1024), (1000, 4100)] if ON_GPU else [(72, 200), (40, 128)]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    return x, weight, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("use_dot", [True, False])
def test_skinny_gemm(dtype: torch.dtype, m: int, shape: tuple[int, int], use_dot: bool) -> None:
    n, k = shape
    x, weight, bias = _inputs(m, n, k, dtype)
    has_bias = m != 3  # half the cases with a bias, across M and paths
    b = bias if has_bias else None
    # block_k 64 leaves a K tail for K = 200; block_n 16 pads N = 72 (clamped rows).
    out = skinny_gemm(x, weight, b, block_n=16, block_k=64, use_dot=use_dot)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close(out, skinny_gemm_ref(x, weight, b), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_config(dtype: torch.dtype) -> None:
    x, weight, bias = _inputs(2, 72, 200, dtype, seed=1)
    assert_close(skinny_gemm(x, weight, bias), skinny_gemm_ref(x, weight, bias), dtype)


def test_small_blocks_and_many_rows() -> None:
    """M = 20 takes a second row block; block_n 4 and block_k 256 > K (tail-only loop)."""
    x, weight, bias = _inputs(20, 37, 96, torch.float16, seed=2)
    for use_dot in (True, False):
        out = skinny_gemm(x, weight, bias, block_n=4, block_k=256, use_dot=use_dot)
        assert_close(out, skinny_gemm_ref(x, weight, bias), torch.float16)


def test_strided_rows_and_out() -> None:
    x, weight, _ = _inputs(3, 48, 2 * 128, torch.bfloat16, seed=3)
    x_view, w_view = x[:, :128], weight[:, :128]  # row strides 256, columns contiguous
    out_buf = torch.full((3, 2 * 48), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out = out_buf[:, :48]
    result = skinny_gemm(x_view, w_view, out=out, block_n=8, block_k=64)
    assert result.data_ptr() == out.data_ptr()
    assert_close(out, skinny_gemm_ref(x_view, w_view), torch.bfloat16)
    assert torch.all(out_buf[:, 48:] == 7.0)  # nothing written past N


def test_reference_is_fp32_then_round_once() -> None:
    x, weight, bias = _inputs(2, 16, 64, torch.bfloat16, seed=4)
    expected = (x.double() @ weight.double().T + bias.double()).to(torch.bfloat16)
    torch.testing.assert_close(skinny_gemm_ref(x, weight, bias), expected, atol=1e-2, rtol=1e-2)


def test_heuristic_keeps_sms_busy() -> None:
    sms = DEFAULT_NUM_SMS
    assert heuristic_config(4096, 4096, sms).block_n == 16  # 256 programs on 132 SMs
    assert heuristic_config(1024, 2048, sms).block_n == 4
    assert heuristic_config(128256, 4096, sms).block_n == 64
    assert heuristic_config(16, 64, sms).block_k == 64  # never far beyond K
    assert heuristic_config(4096, 4160, sms).block_k == 64  # divides K: no masked tail step
    assert heuristic_config(72, 200, sms).block_k == 256  # no divisor: one tail step
    for n, k in [(6144, 4096), (1024, 3072), (4096, 14336)]:
        cfg = heuristic_config(n, k, sms)
        assert -(-n // cfg.block_n) >= 1.5 * sms and cfg.block_k % 64 == 0


def test_tuned_table_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """M = 1 and M = 2 take their own entries, M = 16 the largest smaller one (M = 2's); the
    table's config is what runs (a block_k of 64 on K = 200 still gives the right result)."""
    table = {(72, 200, 1): (8, 128, 4, 3, False), (72, 200, 2): (16, 64, 2, 2, True)}
    monkeypatch.setattr(gemv, "TUNED_CONFIGS", table)
    assert pick_config(1, 72, 200, DEVICE) == (8, 128, 4, 3, False)
    assert pick_config(2, 72, 200, DEVICE) == pick_config(16, 72, 200, DEVICE) == table[72, 200, 2]
    assert pick_config(2, 73, 200, DEVICE) == heuristic_config(73, 200, gemv.num_sms(DEVICE))
    x, weight, bias = _inputs(2, 72, 200, torch.bfloat16, seed=5)
    assert_close(skinny_gemm(x, weight, bias), skinny_gemm_ref(x, weight, bias), torch.bfloat16)
