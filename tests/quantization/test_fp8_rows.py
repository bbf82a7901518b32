"""W8A8 decoder layers let their RMSNorms quantize the activations (``quantization.fp8.Fp8Rows``,
one fused launch on CUDA): which norms qualify, and a W8A8 layer fed ``Fp8Rows`` computes what
it computes from the 16-bit rows (the same per-token quantization, the same GEMM)."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM
from roofline.layers.norm import RMSNorm
from roofline.quantization import formats
from roofline.quantization.fp8 import Fp8Rows, fp8_norms, w8a8_ref
from tests.e2e.hf_reference import tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_fp8_rows")
    tiny_hf_model("llama", path)
    return path


@pytest.mark.parametrize("method,expected", [("fp8-w8a8", True), ("fp8", False), ("int8", False)])
def test_norms_quantize_only_for_w8a8_gemms(tiny, method: str, expected: bool) -> None:
    llm = LLM(str(tiny), dtype="float32", device="cpu", quantization=method)
    model = llm.llm_engine.runner.model
    for layer in model.layers:
        assert fp8_norms(layer) == (expected, expected)
    if expected:
        layer = model.layers[0].mlp.gate_up_proj
        x = torch.randn(20, layer.in_features, generator=torch.Generator().manual_seed(1))
        q, s = formats.quantize_fp8_per_token(x)
        with torch.no_grad():
            got = layer(Fp8Rows(q, s, x.dtype))
            expect = w8a8_ref(x, layer.qweight, layer.scales, layer.bias)
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_norm_fp8_flag_keeps_cpu_and_small_batches_16_bit() -> None:
    norm = RMSNorm(64)
    x = torch.randn(20, 64)
    assert isinstance(norm(x, fp8=True), torch.Tensor)  # the CPU path: 16/32-bit rows
    out, res = norm(x, x, fp8=True)
    assert isinstance(out, torch.Tensor) and torch.equal(res, x + x)
