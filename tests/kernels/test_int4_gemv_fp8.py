"""``kernels.int4_gemv`` over fp8 e4m3 weights (the canonical ``[N, K]`` weight read as int32
words, one fp32 scale per row) and over the canonical int4 / int8 bytes, the ``preload``
configs (the first tile loaded before the PDL wait) and the ``silu_out`` epilogue of a gate | up
weight: against x times the exactly dequantized weight in plain torch, every e4m3 code decoded
exactly, the prologues and epilogues against the unfused kernels, the refusals, and the fused
decode layer's calls (its MLP with and without the SiLU epilogue) on fp8 linears."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, assert_close

from roofline.kernels import int4_gemv as ig
from roofline.kernels.activation import silu_and_mul
from roofline.kernels.rmsnorm import rms_norm
from roofline.quantization import formats

N, K = 40, 512


def _fp8_weight(seed: int = 0, n: int = N, k: int = K):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    q, s = formats.quantize_fp8(w)
    q.view(torch.uint8)[1, :16] = torch.arange(16, dtype=torch.uint8) | 0x80  # negative subnormals
    return q.to(DEVICE), s.float().to(DEVICE)


def _reference(x, q, s, bias=None):
    out = x.float() @ (q.float() * s.float().reshape(-1)[:, None]).T  # per-row scales
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@pytest.mark.parametrize(
    "dtype,m,cfg",
    [
        (torch.bfloat16, 1, ig.Int4GemvConfig(64, 4, 1, 4, 2)),
        (torch.bfloat16, 1, ig.Int4GemvConfig(64, 2, 1, 4, 2, 2, 1)),  # K on the grid, preload
        (torch.bfloat16, 3, None),
        (torch.float16, 1, ig.Int4GemvConfig(32, 2, 2, 2, 2)),
        (torch.float16, 16, None),
    ],
)
def test_fp8_matches_reference(dtype, m, cfg) -> None:
    q, s = _fp8_weight()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, K, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(dtype).to(DEVICE)
    got = ig.int4_gemv(x, q, s, bias, bits=8, config=cfg)
    assert_close(got, _reference(x, q, s, bias), dtype)


def test_every_e4m3_code_decodes_exactly() -> None:
    """Row r holds code r (NaN codes replaced by zero), scale 1, x = e_0: out[r] = value."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    q = codes[:, None].expand(256, 128).contiguous().view(formats.FP8_DTYPE).to(DEVICE)
    s = torch.ones(256, device=DEVICE)
    x = torch.zeros(1, 128, dtype=torch.bfloat16, device=DEVICE)
    x[0, 0] = 1.0
    got = ig.int4_gemv(x, q, s, bits=8, config=ig.Int4GemvConfig(64, 1, 1, 4, 2))
    assert torch.equal(got[0].float(), q[:, 0].float())


def test_fp8_prologues_and_residual() -> None:
    q, s = _fp8_weight(seed=2)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(1, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    norm_w = (torch.rand(K, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE)
    got = ig.int4_gemv(h, q, s, norm=(norm_w, 1e-5), bits=8)
    assert_close(got, ig.int4_gemv(rms_norm(h, norm_w, 1e-5), q, s, bits=8), torch.bfloat16)
    gate_up = torch.randn(1, 2 * K, generator=gen).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(1, N, generator=gen).to(torch.bfloat16).to(DEVICE)
    got = ig.int4_gemv(gate_up, q, s, silu_mul=True, residual=residual, bits=8)
    plain = ig.int4_gemv(silu_and_mul(gate_up), q, s, bits=8)
    assert_close(got, (plain.float() + residual.float()).to(torch.bfloat16), torch.bfloat16)


def test_fp8_refusals() -> None:
    q, s = _fp8_weight()
    x = torch.zeros(1, K, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        ig.int4_gemv(x, q, s, bits=4)
    with pytest.raises(ValueError, match="fp32"):
        ig.int4_gemv(x, q, s.to(torch.bfloat16), bits=8)
    with pytest.raises(ValueError, match="does not match"):
        ig.int4_gemv(torch.zeros(1, K // 2, dtype=torch.bfloat16, device=DEVICE), q, s, bits=8)
    assert ig.weight_k(q, 8) == K and ig.supports(x, q, K, bits=8)
    with pytest.raises(ValueError, match="cannot run"):  # preload needs one tile a step
        ig.int4_gemv(x, q, s, bits=8, config=ig.Int4GemvConfig(64, 2, 2, 4, 2, 1, 1))
    with pytest.raises(ValueError, match="cannot run"):  # two tiles preloaded: 128 per slice
        ig.int4_gemv(x, q, s, bits=8, config=ig.Int4GemvConfig(64, 4, 1, 4, 2, 1, 2))


@pytest.mark.parametrize("preload,ksplit", [(1, 4), (2, 2)])
def test_int4_and_int8_preload_match(preload: int, ksplit: int) -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(N, K, generator=gen) / K**0.5
    q4 = formats.quantize_int4(w, 64, False, torch.bfloat16)
    q8 = formats.quantize_int8(w, K, torch.bfloat16)
    x = torch.randn(2, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    cfg = ig.Int4GemvConfig(64, ksplit, 1, 4, 3, 1, preload)  # the first tile(s) preloaded
    words4 = ig.repack_int4(q4.qweight.to(DEVICE))
    pairs4 = ig.pack_scales(q4.scales.to(DEVICE), q4.offsets.to(DEVICE))
    w4 = formats.dequantize_int4(*q4, torch.float32).to(DEVICE)
    got = ig.int4_gemv(x, words4, pairs4, config=cfg)
    assert_close(got, (x.float() @ w4.T).to(x.dtype), torch.bfloat16)
    words8 = ig.repack_int8(q8.qweight.to(DEVICE))
    pairs8 = ig.pack_scales(q8.scales.to(DEVICE), None)
    w8 = formats.dequantize_int8(q8.qweight, q8.scales, torch.float32).to(DEVICE)
    got = ig.int4_gemv(x, words8, pairs8, bits=8, config=cfg)
    assert_close(got, (x.float() @ w8.T).to(x.dtype), torch.bfloat16)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_fused_decode_layer_calls_on_a_byte_linear(kind: str, monkeypatch) -> None:
    """An fp8 or per-channel int8 linear's kernel layout is its own qweight and scales (no copy);
    the fused decode layer's norm-prologue and SiLU + residual GEMMs equal the unfused
    composition."""
    from torch import nn

    from roofline.layers import fused_decode
    from roofline.layers.linear import MergedLinear
    from roofline.quantization import common
    from roofline.quantization.fp8 import Fp8LinearMethod
    from roofline.quantization.int8 import Int8LinearMethod

    method_cls = Fp8LinearMethod if kind == "fp8" else Int8LinearMethod
    gen = torch.Generator().manual_seed(5)
    layer = MergedLinear(K, [N // 2, N // 2], bias=False, method=method_cls())
    w = torch.randn(N, K, generator=gen) / K**0.5
    for shard in range(2):
        layer.method.load(layer, shard, "weight", w[shard * N // 2 : (shard + 1) * N // 2])
    layer = layer.to(DEVICE)
    common.prepare_kernel_layout(kind, layer, cuda_only=False)
    assert layer.gemv_words.data_ptr() == layer.qweight.data_ptr()
    assert layer.gemv_pairs.data_ptr() == layer.scales.data_ptr()
    assert layer.gemv_bits == 8 and layer.gemv_group == K
    assert fused_decode._gemv_linear(layer)
    fmt = "fp8" if kind == "fp8" else "i8"
    for fuse, epilogue in ((True, False), (False, False), (False, True)):
        monkeypatch.setitem(common.GEMV_FUSE_SILU, fmt, fuse)
        monkeypatch.setattr(fused_decode, "SILU_EPILOGUE", epilogue)
        norm = nn.Module()
        norm.weight = nn.Parameter((torch.rand(K, generator=gen) + 0.5).to(torch.bfloat16))
        norm.weight.data = norm.weight.data.to(DEVICE)
        norm.eps = 1e-5
        h = torch.randn(1, K, generator=gen).to(torch.bfloat16).to(DEVICE)
        got = fused_decode.norm_linear(layer, norm, h)
        plain = _reference(rms_norm(h, norm.weight, 1e-5), layer.qweight, layer.scales)
        assert_close(got, plain, torch.bfloat16)
        gate_up = torch.randn(1, 2 * K, generator=gen).to(torch.bfloat16).to(DEVICE)
        residual = torch.randn(1, N, generator=gen).to(torch.bfloat16).to(DEVICE)
        got = fused_decode.linear_add(layer, gate_up, residual, silu_mul=True)
        plain = _reference(silu_and_mul(gate_up), layer.qweight, layer.scales)
        assert_close(got, (plain.float() + residual.float()).to(torch.bfloat16), torch.bfloat16)
        gu = MergedLinear(K, [128, 128], bias=False, method=method_cls())
        down = MergedLinear(128, [K], bias=False, method=method_cls())
        for lin, (n_out, k_in) in ((gu, (256, K)), (down, (K, 128))):
            w_l = torch.randn(n_out, k_in, generator=gen) / k_in**0.5
            if lin is gu:
                lin.method.load(lin, 0, "weight", w_l[:128])
                lin.method.load(lin, 1, "weight", w_l[128:])
            else:
                lin.method.load(lin, 0, "weight", w_l)
        gu, down = gu.to(DEVICE), down.to(DEVICE)
        for lin in (gu, down):
            common.prepare_kernel_layout(kind, lin, cuda_only=False)
        res_h = torch.randn(1, K, generator=gen).to(torch.bfloat16).to(DEVICE)
        got = fused_decode.mlp_norm_add(gu, down, norm, h, res_h)
        act = silu_and_mul(_reference(rms_norm(h, norm.weight, 1e-5), gu.qweight, gu.scales))
        plain = _reference(act, down.qweight, down.scales)
        assert_close(got, (plain.float() + res_h.float()).to(torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_silu_out_epilogue(fmt: str) -> None:
    """A gate | up GEMV writing ``silu(gate) * up``: silu_and_mul of its plain output (one row
    with the norm prologue, three rows plain, K over the grid)."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(64, K, generator=gen) / K**0.5
    if fmt == "int4":
        q = formats.quantize_int4(w, 128, False, torch.bfloat16)
        words, pairs, bits = ig.repack_int4(q.qweight), ig.pack_scales(q.scales, q.offsets), 4
    elif fmt == "int8":
        q8 = formats.quantize_int8(w, K, torch.bfloat16)
        words, pairs, bits = ig.repack_int8(q8.qweight), ig.pack_scales(q8.scales, None), 8
    else:
        words, pairs = formats.quantize_fp8(w)
        bits = 8
    words, pairs = words.to(DEVICE), pairs.to(DEVICE)
    h = torch.randn(1, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    norm = ((torch.rand(K, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE), 1e-5)
    bias = torch.randn(64, generator=gen).to(torch.bfloat16).to(DEVICE)
    for cfg in (ig.Int4GemvConfig(64, 4, 1, 4, 2), ig.Int4GemvConfig(32, 2, 1, 4, 2, 2, 1)):
        full = ig.int4_gemv(h, words, pairs, bias, norm=norm, bits=bits, config=cfg)
        got = ig.int4_gemv(h, words, pairs, bias, norm=norm, bits=bits, config=cfg, silu_out=True)
        assert got.shape == (1, 32)
        assert_close(got, silu_and_mul(full), torch.bfloat16)
    x = torch.randn(3, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    cfg = ig.Int4GemvConfig(64, 2, 1, 4, 2)
    got = ig.int4_gemv(x, words, pairs, bits=bits, config=cfg, silu_out=True)
    plain = ig.int4_gemv(x, words, pairs, bits=bits, config=cfg)
    assert_close(got, silu_and_mul(plain), torch.bfloat16)
    assert not ig.splits_gate_up(64, ig.Int4GemvConfig(64, 64, 1, 4, 2))  # one row a program
    with pytest.raises(ValueError, match="silu_out"):
        residual = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEVICE)
        ig.int4_gemv(x, words, pairs, bits=bits, silu_out=True, residual=residual)


@pytest.mark.parametrize(
    "dtype,m,cfg",
    [
        (torch.bfloat16, 1, ig.Int4GemvConfig(64, 4, 1, 4, 2)),
        (torch.bfloat16, 1, ig.Int4GemvConfig(64, 2, 1, 4, 2, 2, 1)),  # K on the grid, preload
        (torch.bfloat16, 3, None),
        (torch.bfloat16, 1, ig.Int4GemvConfig(64, 2, 1, 4, 3, 1, 2)),  # two tiles preloaded
        (torch.float16, 1, ig.Int4GemvConfig(32, 2, 2, 2, 2)),
        (torch.float16, 16, None),
    ],
)
def test_int8_rows_match_reference(dtype, m, cfg) -> None:
    """Per-channel int8 bytes read as they are (fp8's loop), every code -128..127 present, with
    bf16 / fp16 / fp32 scales and the norm and SiLU prologues."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(N, K, generator=gen) / K**0.5
    q = formats.quantize_int8(w, K, dtype)
    qweight = q.qweight.clone()
    qweight[2, :256] = torch.arange(-128, 128, dtype=torch.int8)
    qweight, scales = qweight.to(DEVICE), q.scales.reshape(-1).to(DEVICE)
    dense = qweight.float() * scales.float()[:, None]
    x = torch.randn(m, K, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(dtype).to(DEVICE)
    assert ig.table_format(qweight, 8, K) == "i8" and ig.supports(x, qweight, K, bits=8)
    for s in (scales, scales.float()):
        got = ig.int4_gemv(x, qweight, s, bias, bits=8, config=cfg)
        assert_close(got, ((x.float() @ dense.T) + bias.float()).to(dtype), dtype)
    h = x[:1]
    norm_w = (torch.rand(K, generator=gen) + 0.5).to(dtype).to(DEVICE)
    got = ig.int4_gemv(h, qweight, scales, norm=(norm_w, 1e-5), bits=8)
    assert_close(got, ig.int4_gemv(rms_norm(h, norm_w, 1e-5), qweight, scales, bits=8), dtype)
    gate_up = torch.randn(m, 2 * K, generator=gen).to(dtype).to(DEVICE)
    got = ig.int4_gemv(gate_up, qweight, scales, silu_mul=True, bits=8, config=cfg)
    assert_close(got, (silu_and_mul(gate_up).float() @ dense.T).to(dtype), dtype)


def test_every_int8_code_decodes_exactly() -> None:
    """Row r holds code r - 128, scale 1, x = e_j for each of a word's four bytes: out = q."""
    codes = torch.arange(-128, 128, dtype=torch.int8)
    q = codes[:, None].expand(256, 128).contiguous().to(DEVICE)
    s = torch.ones(256, device=DEVICE)
    for j in range(4):
        x = torch.zeros(1, 128, dtype=torch.bfloat16, device=DEVICE)
        x[0, j] = 1.0
        got = ig.int4_gemv(x, q, s, bits=8, config=ig.Int4GemvConfig(64, 1, 1, 4, 2))
        assert torch.equal(got[0].float(), q[:, 0].float())


@pytest.mark.parametrize("kind,group", [("int4", 128), ("int4", 256), ("int8", K), ("int8", 128)])
def test_canonical_layouts_read_as_they_are(kind: str, group: int, monkeypatch) -> None:
    """int4 / int8 canonical bytes (no repack) against the dequantized weight; the layer's kernel
    layout is its own qweight with ``common.CANONICAL_GEMV``; groups of 64 are refused."""
    from roofline.quantization import common

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(N, K, generator=gen) / K**0.5
    if kind == "int4":
        q = formats.quantize_int4(w, group, False, torch.bfloat16)
        qweight, pairs, bits = q.qweight, ig.pack_scales(q.scales, q.offsets), 4
        dense = formats.dequantize_int4(q.qweight, q.scales, q.offsets, torch.float32)
    else:  # per channel: the [N] scales themselves (pairs refused)
        q8 = formats.quantize_int8(w, group, torch.bfloat16)
        qweight, pairs, bits = q8.qweight, ig.pack_scales(q8.scales, None), 8
        dense = formats.dequantize_int8(q8.qweight, q8.scales, torch.float32)
        if group == K:
            x = torch.zeros(1, K, dtype=torch.bfloat16, device=DEVICE)
            with pytest.raises(ValueError, match="per-channel"):
                ig.int4_gemv(x, qweight.to(DEVICE), pairs.to(DEVICE), bits=8)
            pairs = q8.scales.reshape(-1)
    qweight, pairs, dense = qweight.to(DEVICE), pairs.to(DEVICE), dense.to(DEVICE)
    for xperm in (True, False) if kind == "int4" else (True,):  # x permuted / halves moved
        monkeypatch.setattr(ig, "CANON4_XPERM", xperm)
        for m, cfg in ((1, ig.Int4GemvConfig(64, 4, 1, 4, 2, 1, 1)), (3, None), (16, None)):
            x = torch.randn(m, K, generator=gen).to(torch.bfloat16).to(DEVICE)
            got = ig.int4_gemv(x, qweight, pairs, bits=bits, config=cfg)
            assert_close(got, (x.float() @ dense.T).to(x.dtype), torch.bfloat16)
    if kind == "int4":  # the prologues and the residual, x permuted
        h = torch.randn(1, K, generator=gen).to(torch.bfloat16).to(DEVICE)
        nw = (torch.rand(K, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE)
        got = ig.int4_gemv(h, qweight, pairs, norm=(nw, 1e-5), bits=4)
        normed = rms_norm(h, nw, 1e-5)
        assert_close(got, (normed.float() @ dense.T).to(h.dtype), torch.bfloat16)
        gu = torch.randn(2, 2 * K, generator=gen).to(torch.bfloat16).to(DEVICE)
        res = torch.randn(2, N, generator=gen).to(torch.bfloat16).to(DEVICE)
        got = ig.int4_gemv(gu, qweight, pairs, silu_mul=True, residual=res, bits=4)
        ref = (silu_and_mul(gu).float() @ dense.T).to(h.dtype).float() + res.float()
        assert_close(got, ref.to(h.dtype), torch.bfloat16)
    q64 = formats.quantize_int4(w, 64, False, torch.bfloat16)
    with pytest.raises(ValueError, match="canonical"):
        ig.int4_gemv(x, q64.qweight.to(DEVICE), ig.pack_scales(q64.scales, q64.offsets).to(DEVICE))

    from roofline.layers.linear import MergedLinear
    from roofline.quantization.int4 import Int4LinearMethod
    from roofline.quantization.int8 import Int8LinearMethod

    method = Int4LinearMethod(group) if kind == "int4" else Int8LinearMethod(group)
    layer = MergedLinear(K, [N], bias=False, method=method)
    layer.method.load(layer, 0, "weight", w)
    if kind == "int4":
        monkeypatch.setattr(common, "INT4_GEMV_CANONICAL", True)
    else:
        monkeypatch.setattr(common, "CANONICAL_GEMV", group != K)  # per channel: by default
    common.prepare_kernel_layout(kind, layer, cuda_only=False)
    assert layer.gemv_bits == bits
    assert layer.gemv_words.data_ptr() == layer.qweight.data_ptr()  # read as it is
    if kind == "int8":
        if group == K:  # the scales' own storage, as [N]
            assert layer.gemv_pairs.shape == (N,)
            assert layer.gemv_pairs.data_ptr() == layer.scales.data_ptr()
            monkeypatch.setattr(common, "INT8_GEMV_PLANES", True)
            common.prepare_kernel_layout(kind, layer, cuda_only=False)
            assert layer.gemv_words.dtype == torch.int32  # the repacked planes
