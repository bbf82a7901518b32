"""The persistent per-token fp8 quantization kernel (``kernels.fp8_quant._fp8_rows_kernel``):
a program walks rows ``p, p + P, ...`` with the next row's loads issued early, each row held as
three power-of-two parts. It must compute what the per-row kernel and torch compute: the same
scales and clamped quotients (fp32 output: the interpreter's fp8 rounding is not the
hardware's), for plain rows and for ``silu(gate) * up``, whatever the number of programs."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE

from roofline.kernels import fp8_quant as fq
from roofline.kernels.activation import silu_and_mul
from roofline.quantization import formats


@pytest.mark.parametrize("k", [1, 16, 96, 200, 2112, 4096, 5120, 11008, 14336, 16384])
def test_row_parts_cover_k_with_little_padding(k: int) -> None:
    parts = fq.row_parts(k)
    assert len(parts) == 3 and all(p >= 16 and p & (p - 1) == 0 for p in parts)
    assert list(parts) == sorted(parts, reverse=True)
    assert sum(parts) >= k
    if k >= 2048:
        assert sum(parts) - k <= k // 16, parts  # (the one-block pad was up to 2x)


@pytest.mark.parametrize("programs", [1, 2, 3])
@pytest.mark.parametrize("m,k", [(5, 96), (4, 200), (3, 2112)])
def test_rows_kernel_equals_torch_for_any_program_count(monkeypatch, programs, m, k) -> None:
    monkeypatch.setattr(fq, "num_sms", lambda device: 1)
    monkeypatch.setattr(fq, "ROWS_PROGRAMS_PER_SM", programs)
    gen = torch.Generator().manual_seed(programs * 100 + k)
    x = torch.randn(m, k, generator=gen) * torch.tensor([1.0, 1e-3, 30.0, 2.0, 0.5])[:m, None]
    x = x.to(torch.bfloat16).to(DEVICE)
    x[-1, 3] = 900.0  # an outlier sets its row's scale
    x[0] = 0  # an all-zero row: the scale's floor
    _, s_ref = formats.quantize_fp8_per_token(x)
    quotients, scales = fq.quantize_fp8_per_token(x, out_dtype=torch.float32, kernel="rows")
    assert torch.equal(scales, s_ref)
    assert torch.equal(quotients, (x.float() / s_ref).clamp(-448, 448))


@pytest.mark.parametrize("programs", [1, 2])
@pytest.mark.parametrize("m,inter", [(3, 96), (5, 2048 + 64)])
def test_rows_kernel_silu_mul_equals_the_per_row_kernel(monkeypatch, programs, m, inter) -> None:
    monkeypatch.setattr(fq, "num_sms", lambda device: 1)
    monkeypatch.setattr(fq, "ROWS_PROGRAMS_PER_SM", programs)
    gen = torch.Generator().manual_seed(inter + programs)
    gate_up = (torch.randn(m, 2 * inter, generator=gen) * 4).to(torch.bfloat16).to(DEVICE)
    got_q, got_s = fq.silu_mul_quantize_fp8_per_token(gate_up, torch.float32, kernel="rows")
    row_q, row_s = fq.silu_mul_quantize_fp8_per_token(gate_up, torch.float32, kernel="row")
    two_q, two_s = fq.quantize_fp8_per_token(silu_and_mul(gate_up), torch.float32, kernel="row")
    assert got_q.shape == (m, inter) and got_s.shape == (m, 1)
    assert torch.equal(got_s, row_s) and torch.equal(got_q, row_q)
    assert torch.equal(got_s, two_s) and torch.equal(got_q, two_q)


def test_rows_kernel_takes_strided_rows() -> None:
    """A view whose rows are further apart than K (a slice of a wider buffer)."""
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(6, 160, generator=gen).to(torch.bfloat16).to(DEVICE)
    x = wide[:, :96]
    q, s = fq.quantize_fp8_per_token(x, out_dtype=torch.float32, kernel="rows")
    _, s_ref = formats.quantize_fp8_per_token(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q, (x.float() / s_ref).clamp(-448, 448))


@pytest.mark.parametrize("programs", [1, 2])
@pytest.mark.parametrize("m,inter", [(3, 96), (4, 2048 + 64)])
def test_rows_fast_is_the_default_for_silu_rows_and_within_an_ulp(monkeypatch, programs, m, inter):
    """The default SiLU-and-mul launch (``rows-fast``): the exact kernels' scales (the
    interpreter's approximate division is exact) and quotients within an fp32 ulp or so (a
    product with the reciprocal scale instead of a quotient)."""
    monkeypatch.setattr(fq, "num_sms", lambda device: 1)
    monkeypatch.setattr(fq, "ROWS_PROGRAMS_PER_SM", programs)
    monkeypatch.setattr(fq, "KERNEL", "")
    gen = torch.Generator().manual_seed(inter * 3 + programs)
    gate_up = (torch.randn(m, 2 * inter, generator=gen) * 4).to(torch.bfloat16).to(DEVICE)
    calls = []
    real = fq._fp8_rows_kernel
    monkeypatch.setattr(fq, "_fp8_rows_kernel", SpyKernel(real, calls))
    got_q, got_s = fq.silu_mul_quantize_fp8_per_token(gate_up, torch.float32)
    assert calls == [True]  # FAST
    ref_q, ref_s = fq.silu_mul_quantize_fp8_per_token(gate_up, torch.float32, kernel="row")
    assert torch.equal(got_s, ref_s)
    torch.testing.assert_close(got_q, ref_q, rtol=2.5e-7, atol=0)
    assert got_q.abs().max() <= 448


class SpyKernel:
    """Records the FAST constexpr of each launch of a Triton kernel."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(kwargs["FAST"])
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_plain_rows_take_the_exact_per_row_kernel_by_default(monkeypatch) -> None:
    monkeypatch.setattr(fq, "KERNEL", "")
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x = x.to(DEVICE)
    calls = []
    monkeypatch.setattr(fq, "_fp8_rows_kernel", SpyKernel(fq._fp8_rows_kernel, calls))
    q, s = fq.quantize_fp8_per_token(x, out_dtype=torch.float32)
    assert calls == []
    _, s_ref = formats.quantize_fp8_per_token(x)
    assert torch.equal(s, s_ref) and torch.equal(q, (x.float() / s_ref).clamp(-448, 448))
