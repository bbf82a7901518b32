"""SiLU-and-mul against ``F.silu(gate) * up``."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels.activation import silu_and_mul, silu_and_mul_ref

SHAPES = [(5, 2 * 3000), (2, 3, 2 * 1500)] if ON_GPU else [(5, 2 * 300), (2, 3, 2 * 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype).to(DEVICE)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close(out, silu_and_mul_ref(x), dtype)


def test_empty_batch() -> None:
    x = torch.empty(0, 64, device=DEVICE)
    assert silu_and_mul(x).shape == (0, 32)
