"""Skinny GEMM with an RMSNorm prologue (``norm=``) and a residual-add epilogue (``residual=``)
against the unfused kernels (``rms_norm`` then ``skinny_gemm``; ``skinny_gemm`` then an add),
both reduction paths, a K tail, bias; the shape checks; and the fused decoder layer (Llama,
Qwen3 q/k norm) against the unfused one."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels.gemv import skinny_gemm, skinny_gemm_ref
from roofline.kernels.rmsnorm import rms_norm_ref

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(4096, 1024), (1000, 4100)] if ON_GPU else [(40, 200), (24, 128)]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(m, k, generator=gen)).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    residual = torch.randn(m, n, generator=gen).to(dtype).to(DEVICE)
    return x, weight, norm_w, residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("use_dot", [True, False])
def test_norm_prologue(dtype: torch.dtype, m: int, shape: tuple[int, int], use_dot: bool) -> None:
    n, k = shape
    x, weight, norm_w, _ = _inputs(m, n, k, dtype)
    out = skinny_gemm(x, weight, norm=(norm_w, 1e-6), block_n=16, block_k=64, use_dot=use_dot)
    normed = rms_norm_ref(x, norm_w, 1e-6)  # [m, k] in dtype, HF's roundings
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close(out, skinny_gemm_ref(normed, weight), dtype)
    # The normalised x differs from rms_norm's at most in its fp32 statistic's summation order:
    # on this data the products of the unfused kernel pair are met to the GEMM's own tolerance.
    unfused = skinny_gemm(normed, weight, block_n=16, block_k=64, use_dot=use_dot)
    assert_close(out, unfused, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("use_dot", [True, False])
def test_residual_epilogue(dtype: torch.dtype, m: int, use_dot: bool) -> None:
    n, k = SHAPES[0]
    x, weight, _, residual = _inputs(m, n, k, dtype, seed=1)
    bias = torch.randn(n).to(dtype).to(DEVICE)
    out = skinny_gemm(x, weight, bias, residual=residual, block_n=16, block_k=64, use_dot=use_dot)
    plain = skinny_gemm(x, weight, bias, block_n=16, block_k=64, use_dot=use_dot)
    # Same config, same reduction: the fused add has the bits of the separate add.
    assert torch.equal(out, plain + residual)


def test_norm_and_residual_together() -> None:
    n, k = 24, 128
    x, weight, norm_w, residual = _inputs(1, n, k, torch.bfloat16, seed=2)
    out = skinny_gemm(x, weight, norm=(norm_w, 1e-5), residual=residual)
    ref = (skinny_gemm_ref(rms_norm_ref(x, norm_w, 1e-5), weight).float() + residual.float()).to(
        torch.bfloat16
    )
    assert_close(out, ref, torch.bfloat16)


def test_bad_arguments() -> None:
    x, weight, norm_w, residual = _inputs(1, 24, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="norm weight"):
        skinny_gemm(x, weight, norm=(norm_w[:64], 1e-6))
    with pytest.raises(ValueError, match="norm weight"):
        skinny_gemm(x, weight, norm=(norm_w.float(), 1e-6))
    with pytest.raises(ValueError, match="residual"):
        skinny_gemm(x, weight, residual=residual[:, :8])
    with pytest.raises(ValueError, match="residual"):
        skinny_gemm(x, weight, residual=residual.float())


class _EchoBackend:
    """Attention stand-in: returns q (a deterministic function of the layer's input)."""

    name = "echo"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, **_):  # noqa: ANN001, ANN003
        return q * 0.5 + k.repeat_interleave(q.shape[1] // k.shape[1], dim=1) * v.mean()


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decoder_layer(
    monkeypatch: pytest.MonkeyPatch, qk_norm: bool, dtype: torch.dtype
) -> None:
    """Two decoder layers and the final norm, fused (stubbed to apply on the CPU at one row) vs
    unfused: the same stream, and the fused layer hands ``residual=None`` on."""
    from roofline.config import ModelConfig
    from roofline.layers import fused_decode
    from roofline.layers.attention import ForwardContext
    from roofline.layers.norm import RMSNorm
    from roofline.layers.rotary import RotaryEmbedding
    from roofline.models.llama import LlamaDecoderLayer

    cfg = ModelConfig("LlamaForCausalLM", 64, 32, 48, 2, 4, 2, 16, qk_norm=qk_norm)
    gen = torch.Generator().manual_seed(3)
    rotary = RotaryEmbedding(16, 64, 10000.0, None)
    layers = [LlamaDecoderLayer(cfg, i, rotary) for i in range(2)]
    final = RMSNorm(32)
    with torch.no_grad():
        for mod in [*layers, final]:
            for p in mod.parameters():
                p.copy_(1 + torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    layers = [lay.to(dtype).to(DEVICE) for lay in layers]
    final = final.to(dtype).to(DEVICE)
    ctx = ForwardContext(meta=None, kv_caches=[(None, None)] * 2, backend=_EchoBackend())
    x = torch.randn(1, 32, generator=gen).to(dtype).to(DEVICE)
    positions = torch.tensor([5], device=DEVICE)

    def run() -> torch.Tensor:
        h, residual = x, None
        with torch.no_grad():
            for lay in layers:
                h, residual = lay(positions, h, residual, ctx)
            return final(h) if residual is None else final(h, residual)[0]

    unfused = run()
    monkeypatch.setattr(fused_decode, "applies", lambda layer, x: x.shape[0] == 1)
    calls = []
    norm_linear = fused_decode.norm_linear
    monkeypatch.setattr(fused_decode, "norm_linear", lambda *a: calls.append(1) or norm_linear(*a))
    fused = run()
    assert len(calls) == 4  # qkv and gate_up of both layers took the norm prologue
    assert_close(fused, unfused, dtype)
