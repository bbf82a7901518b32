"""SiLU-and-mul against ``F.silu(gate) * up``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
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


def _eager_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """HF's ``act_fn(gate) * up`` as torch's eager ops compute it: ``F.silu`` is
    ``g / (1 + exp(-g))`` in fp32 rounded to the dtype, then the product is rounded again. The
    exp is the one the kernel uses: expf on CUDA (what F.silu calls, checked below), numpy's in
    the CPU interpreter (where the kernel's tl.exp is numpy's; it can differ from torch's CPU exp
    by an ulp)."""
    gate, up = x.chunk(2, dim=-1)
    g = gate.float()
    e = torch.exp(-g) if g.is_cuda else torch.from_numpy(np.exp((-g).numpy()))
    act = (g / (1 + e)).to(x.dtype)
    if x.is_cuda:
        assert torch.equal(act, F.silu(gate))
    return act * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bit_exact_with_eager_silu_then_mul(dtype: torch.dtype) -> None:
    x = (3 * torch.randn(7, 2 * 1000, generator=torch.Generator().manual_seed(1))).to(dtype)
    x = x.to(DEVICE)
    assert torch.equal(silu_and_mul(x), _eager_silu_and_mul(x))


def test_empty_batch() -> None:
    x = torch.empty(0, 64, device=DEVICE)
    assert silu_and_mul(x).shape == (0, 32)
