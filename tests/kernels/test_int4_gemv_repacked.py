"""Quantized linears that keep only the repacked copy (``quantization.repacked``): row tiles of
``kernels.int4_gemv`` above 16 rows, ``dequantize_words`` (bit-exact against
``formats.dequantize_*``) for prefill, and the release rule; each against x times the exactly
dequantized weight."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, assert_close

from roofline.kernels import int4_gemv as ig
from roofline.kernels.int4_gemv_tiles import dequantize_words
from roofline.quantization import common, formats, repacked

N, K = 40, 512


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (4, 256), (8, K), (8, 64)])
def test_dequantize_words_is_formats_dequantize(bits, group, dtype) -> None:
    gen = torch.Generator().manual_seed(bits + group)
    w = torch.randn(N, K, generator=gen) / K**0.5
    scale_dtype = torch.bfloat16 if dtype == torch.float32 else dtype
    if bits == 4:
        q = formats.quantize_int4(w, group, False, scale_dtype)
        words, pairs = ig.repack_int4(q.qweight), ig.pack_scales(q.scales, q.offsets)
        expected = formats.dequantize_int4(q.qweight, q.scales, q.offsets, dtype)
    else:
        q8 = formats.quantize_int8(w, group, scale_dtype)
        words, pairs = ig.repack_int8(q8.qweight), ig.pack_scales(q8.scales, None)
        expected = formats.dequantize_int8(q8.qweight, q8.scales, dtype)
    got = dequantize_words(words.to(DEVICE), pairs.to(DEVICE), bits, dtype)
    assert torch.equal(got.cpu(), expected)


def _layer(kind: str):
    from roofline.layers.linear import MergedLinear
    from roofline.quantization.int4 import Int4LinearMethod
    from roofline.quantization.int8 import Int8LinearMethod

    gen = torch.Generator().manual_seed(3)
    method = Int4LinearMethod(128) if kind == "int4" else Int8LinearMethod()
    layer = MergedLinear(K, [N], bias=True, method=method)
    layer.method.load(layer, 0, "weight", torch.randn(N, K, generator=gen) / K**0.5)
    layer.bias.data = torch.randn(N, generator=gen).to(layer.bias.dtype)
    layer = layer.to(torch.bfloat16).to(DEVICE)
    w = common.dequantize(kind, layer, torch.float32)  # [N, K] before the release
    return layer, w


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_released_layer_serves_every_batch(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layer, w = _layer(kind)
    bytes_before = layer.method.weight_bytes(layer)
    common.prepare_kernel_layout(kind, layer, cuda_only=False)
    fmt, group = (4, 128) if kind == "int4" else (8, K)
    assert not repacked.release_canonical(kind, layer, cuda_only=False)  # no row-tile table
    for bucket in repacked.ROW_TILE_BUCKETS:  # as a sweep that found these not slower
        cfg = (64, 1, 1, 4, 2, 1, 0, 32) if bucket == 32 else (32, 1, 2, 4, 2, 2, 0, 16)
        cfg = None if bucket == 64 else cfg  # 33-64 rows: dequantize the repack + cuBLAS
        monkeypatch.setitem(ig.TUNED_CONFIGS, (fmt, N, K, group, bucket), cfg)
    monkeypatch.setitem(ig.TUNED_CONFIGS, (fmt, N, K, group, 1), None)  # quant_gemv's: gone
    assert repacked.release_canonical(kind, layer, cuda_only=False)
    assert layer.qweight is None and layer.scales is None
    assert layer.method.weight_bytes(layer) >= bytes_before
    gen = torch.Generator().manual_seed(4)
    for m in (1, 3, 20, 40, 300):
        x = torch.randn(m, K, generator=gen).to(torch.bfloat16).to(DEVICE)
        expected = (x.float() @ w.T + layer.bias.float()).to(x.dtype)
        assert_close(repacked.repacked_linear(layer, x, layer.bias), expected, torch.bfloat16)
