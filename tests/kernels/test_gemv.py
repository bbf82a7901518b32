"""Skinny GEMM (decode GEMV) against its fp32 torch reference: both reduction paths, odd N and K
(clamped rows, the masked K tail), bias, M above one row block, strided rows, ``out=``. The
SiLU-and-mul prologue (``silu_mul=True``) bit for bit against ``silu_and_mul`` then the skinny
GEMM, its shape checks, and its wiring into ``LlamaMLP``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels import DEFAULT_NUM_SMS, gemv
from roofline.kernels.activation import silu_and_mul
from roofline.kernels.gemv import (
    heuristic_config,
    pick_config,
    silu_mul_skinny_gemm_ref,
    skinny_gemm,
    skinny_gemm_ref,
)
from roofline.layers import linear as linear_mod
from roofline.models.llama import LlamaMLP

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


def _gate_up(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[M, 2K] gate | up, gates spread over SiLU's curved range and its tails."""
    gen = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(m, 2 * k, generator=gen)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("use_dot", [True, False])
def test_silu_mul_bit_exact(dtype: torch.dtype, m: int, use_dot: bool) -> None:
    """Fused == silu_and_mul then skinny_gemm with the same config, bit for bit: K = 200 with
    block_k 64 has a masked tail step, N = 40 with block_n 16 clamped weight rows."""
    n, k = SHAPES[-1] if ON_GPU else (40, 200)
    gate_up = _gate_up(m, k, dtype, seed=10 + m)
    _, weight, bias = _inputs(m, n, k, dtype, seed=m)
    b = bias if m % 2 else None
    cfg = dict(block_n=16, block_k=64, use_dot=use_dot)
    fused = skinny_gemm(gate_up, weight, b, silu_mul=True, **cfg)
    assert fused.shape == (m, n) and fused.dtype == dtype
    assert torch.equal(fused, skinny_gemm(silu_and_mul(gate_up), weight, b, **cfg))
    assert_close(fused, silu_mul_skinny_gemm_ref(gate_up, weight, b), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_default_config_strided_and_out(dtype: torch.dtype) -> None:
    """Picked config (K = 128: no tail), gate_up rows further apart than 2K, ``out=``."""
    m, n, k = 3, 24, 128
    buf = _gate_up(m, 2 * k, dtype, seed=20)  # [M, 4K]; gate_up = its first 2K columns
    gate_up = buf[:, : 2 * k]
    _, weight, bias = _inputs(m, n, k, dtype, seed=21)
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    result = skinny_gemm(gate_up, weight, bias, out, silu_mul=True)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out, skinny_gemm(silu_and_mul(gate_up), weight, bias))
    assert_close(out, silu_mul_skinny_gemm_ref(gate_up, weight, bias), dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's exp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_every_gate_value(dtype: torch.dtype) -> None:
    """Every finite 16-bit gate value (the SiLU's rounding depends on the gate alone), through an
    identity weight so that each output is one rounded ``silu(gate) * up`` (|up| <= 1: no
    overflow), on the tensor-core and the CUDA-core paths at M = 8; one value in four on the
    CPU. (The interpreter widens subnormal bf16 wrongly outside tl.dot, in the unfused GEMM
    alike: there the outputs are only compared with each other.)"""
    k = 512
    bits = torch.arange(-(2**15), 2**15, 1 if ON_GPU else 4, dtype=torch.int32).to(torch.int16)
    gates = bits.view(dtype).clone()
    gates[~torch.isfinite(gates)] = 0
    up = (2 * torch.rand(gates.numel(), generator=torch.Generator().manual_seed(30)) - 1).to(dtype)
    weight = torch.eye(k, dtype=dtype, device=DEVICE)
    # big blocks: few programs in the interpreter; on the GPU, tiles that fit registers and smem
    blocks = dict(block_n=8, block_k=128) if ON_GPU else dict(block_n=128, block_k=512)
    for chunk in range(gates.numel() // (8 * k)):
        rows = slice(chunk * 8 * k, (chunk + 1) * 8 * k)
        gate_up = torch.cat([gates[rows].view(8, k), up[rows].view(8, k)], dim=1).to(DEVICE)
        unfused = silu_and_mul(gate_up)
        for use_dot in (True, False):
            cfg = dict(blocks, use_dot=use_dot)
            fused = skinny_gemm(gate_up, weight, silu_mul=True, **cfg)
            assert torch.equal(fused, skinny_gemm(unfused, weight, **cfg))
            if ON_GPU or use_dot or dtype != torch.bfloat16:  # zeros may lose their sign
                assert torch.equal(fused.abs(), unfused.abs())


def test_silu_mul_refuses_bad_shapes() -> None:
    m, n, k = 2, 16, 64
    gate_up = _gate_up(m, k, torch.float32, seed=40)
    _, weight, bias = _inputs(m, n, k, torch.float32, seed=41)
    bad = {
        "needs gate_up": (gate_up[:, :k], weight, None, None),  # [M, K]: no up half
        "2-D": (gate_up[0], weight, None, None),
        "is torch.float16": (gate_up.half(), weight, None, None),
        "contiguous": (gate_up.T.contiguous().T, weight, None, None),  # column stride M
        "bias": (gate_up, weight, bias[:-1], None),
        "out": (gate_up, weight, None, torch.empty(m, n + 1, device=DEVICE)),
    }
    for message, (x, w, b, out) in bad.items():
        with pytest.raises(ValueError, match=message):
            skinny_gemm(x, w, b, out, silu_mul=True)
    with pytest.raises(ValueError, match="needs gate_up"):
        skinny_gemm(gate_up, weight[:, : k - 1], silu_mul=True)  # K mismatch
    with pytest.raises(ValueError, match=r"needs x \[M, 64\]"):
        skinny_gemm(gate_up, weight)  # [M, 2K] without silu_mul


def test_llama_mlp_fuses_silu_into_down_proj(monkeypatch: pytest.MonkeyPatch) -> None:
    """LlamaMLP takes the fused path where its down projection would run the skinny GEMM (that
    condition stubbed here to "at most 8 rows", since it needs CUDA) on a single row, with the
    bits of the unfused path; more rows keep ``down_proj(act(gate_up(x)))``."""
    mlp = LlamaMLP(SimpleNamespace(hidden_size=32, intermediate_size=80)).to(DEVICE)
    gen = torch.Generator().manual_seed(50)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    mlp = mlp.to(torch.bfloat16)
    x = torch.randn(12, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    # The real condition: CPU, or on CUDA an (N, K) without a tuned config: not fused.
    assert not mlp.down_proj.fuses_silu_mul(mlp.gate_up_proj(x[:1]))

    monkeypatch.setattr(linear_mod, "skinny_gemm_applies", lambda x, w: x.shape[0] <= 8)
    big_blocks = (32, 64, 4, 3, True)  # few programs in the interpreter
    table = {(n, k, 1): big_blocks for n, k in [(32, 80), (160, 32)]}
    monkeypatch.setattr(gemv, "TUNED_CONFIGS", table)
    calls = []
    fused_forward = linear_mod.MergedLinear.forward_silu_mul
    monkeypatch.setattr(
        linear_mod.MergedLinear,
        "forward_silu_mul",
        lambda self, gate_up: calls.append(gate_up.shape[0]) or fused_forward(self, gate_up),
    )
    with torch.no_grad():
        for rows in (1, 2, 12):
            gate_up = mlp.gate_up_proj(x[:rows])
            if rows == 1:  # what down_proj(act(gate_up)) runs on CUDA
                expected = skinny_gemm(silu_and_mul(gate_up), mlp.down_proj.weight)
            else:
                expected = mlp.down_proj(mlp.act(gate_up))
            assert torch.equal(mlp(x[:rows]), expected)
        assert calls == [1]  # SILU_MUL_MAX_ROWS
        monkeypatch.setattr(linear_mod, "SILU_MUL_MAX_ROWS", 8)
        gate_up = mlp.gate_up_proj(x[:5])
        expected = skinny_gemm(silu_and_mul(gate_up), mlp.down_proj.weight)
        assert torch.equal(mlp(x[:5]), expected) and calls == [1, 5]
        mlp.down_proj.float()  # weight dtype != activations: never fused
        assert not mlp.down_proj.fuses_silu_mul(mlp.gate_up_proj(x[:1]))
