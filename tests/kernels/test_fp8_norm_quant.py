"""RMSNorm fused with the per-token fp8 quantization of W8A8 (``kernels.fp8_quant``): the same
quotients, scales and new residual as ``kernels.rmsnorm`` followed by
``quantize_fp8_per_token`` (fp32 quotients under the interpreter, whose fp8 rounding is not the
hardware's; fp8 on a GPU), and torch's values within rounding."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU

from roofline.kernels.fp8_quant import (
    quantize_fp8_per_token,
    rms_norm_quantize_fp8_per_token,
)
from roofline.kernels.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_ref
from roofline.quantization import formats

OUT = formats.FP8_DTYPE if ON_GPU else torch.float32


@pytest.mark.parametrize(
    "m,hidden,with_residual", [(3, 96, False), (5, 4096, True), (1, 200, True)]
)
def test_rms_norm_fp8_equals_norm_then_quantization(m: int, hidden: int, with_residual) -> None:
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(m, hidden, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    residual = (torch.randn(m, hidden, generator=gen)).to(torch.bfloat16).to(DEVICE)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE)
    eps = 1e-5
    q, s, res_out = rms_norm_quantize_fp8_per_token(
        x, weight, eps, residual if with_residual else None, out_dtype=OUT
    )
    if with_residual:
        normed, new_res = fused_add_rms_norm(x, residual, weight, eps)
        assert torch.equal(res_out, new_res)
    else:
        normed = rms_norm(x, weight, eps)
        assert res_out is None
    q2, s2 = quantize_fp8_per_token(normed, out_dtype=OUT)
    assert q.shape == (m, hidden) and s.shape == (m, 1)
    assert torch.equal(s, s2) and torch.equal(q.float(), q2.float())
    src = x.float() + residual.float() if with_residual else x.float()
    ref = rms_norm_ref(src.to(torch.bfloat16), weight, eps).float()
    torch.testing.assert_close(q.float() * s, ref, rtol=7e-2, atol=1e-2)


def test_rms_norm_fp8_refuses_mismatched_shapes() -> None:
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quantize_fp8_per_token(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_quantize_fp8_per_token(
            x, torch.ones(64, device=DEVICE), 1e-6, torch.zeros(3, 64, device=DEVICE)
        )
