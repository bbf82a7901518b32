"""The tensor-core int4 decode GEMV (``kernels.int4_gemv``) against x times the exactly
dequantized weight in fp32 (plain torch): symmetric and asymmetric int4, groups of 32, 64, 128
and 256, odd M, K-slices inside the MMA, bf16 and fp16, bias, the SiLU-and-mul prologue; the
repack round trip and its nibble placement; the configs and inputs it must refuse; and the
quantized linear layer taking it after ``prepare_kernel_layout``."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels import int4_gemv as ig
from roofline.kernels.activation import silu_and_mul_ref
from roofline.quantization import formats

N, K = (4096, 4096) if ON_GPU else (40, 1024)


def _weight(group: int, symmetric: bool, scale_dtype=torch.bfloat16, seed: int = 0, k: int = K):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, k, generator=gen) / k**0.5
    q = formats.quantize_int4(w, group, symmetric=symmetric, scale_dtype=scale_dtype)
    q = formats.Int4Weight(*(t.to(DEVICE) for t in q))
    return q, ig.repack_int4(q.qweight), ig.pack_scales(q.scales, q.offsets)


def _reference(x, q, bias=None):
    """x (fp32) @ the dequantized weight (fp32), written here independently of the module."""
    w = formats.dequantize_int4(q.qweight, q.scales, q.offsets, torch.float32)  # [N, K]
    out = x.float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def test_repack_round_trip_and_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (3, 256), generator=gen, dtype=torch.uint8)
    packed = formats.pack_int4(q)
    words = ig.repack_int4(packed)
    from roofline.kernels import int4_layout

    monkeypatch.setattr(int4_layout, "REPACK_ROWS", 2)  # two rows at a time: the same words
    assert torch.equal(ig.repack_int4(packed), words)
    assert words.dtype == torch.int32 and words.shape == (3, 32)
    assert torch.equal(ig.unrepack_int4(words), packed)
    # nibble 4h + i of word w of tile t holds element 128 t + 32 i + 2 w + h
    for t, w, h, i in [(0, 0, 0, 0), (0, 5, 1, 2), (1, 15, 1, 3), (1, 7, 0, 1)]:
        nibble = (int(words[1, 16 * t + w]) >> (4 * (4 * h + i))) & 0xF
        assert nibble == int(q[1, 128 * t + 32 * i + 2 * w + h])


# (group, symmetric, m, config or None for the picked one)
CASES = [
    (128, False, 1, None),
    (128, True, 1, ig.Int4GemvConfig(64, 8, 1, 4, 2)),  # 8 K-slices of 8 rows
    (128, False, 3, ig.Int4GemvConfig(32, 2, 1, 2, 2)),
    (64, False, 1, ig.Int4GemvConfig(64, 4, 1, 4, 3)),
    (64, True, 5, None),
    (32, True, 1, None),
    (32, False, 16, ig.Int4GemvConfig(32, 1, 2, 2, 2)),
    (256, False, 2, ig.Int4GemvConfig(64, 2, 2, 4, 2)),  # a group spans two tiles
    (128, False, 1, ig.Int4GemvConfig(64, 4, 1, 4, 2, 2)),  # two K parts on the grid
    (256, True, 3, ig.Int4GemvConfig(32, 2, 1, 2, 2, 2)),  # K parts that cut no group of 256
]


@pytest.mark.parametrize("group,symmetric,m,cfg", CASES)
def test_int4_gemv_matches_reference(group, symmetric, m, cfg) -> None:
    q, words, pairs = _weight(group, symmetric)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).to(DEVICE)
    got = ig.int4_gemv(x, words, pairs, bias, config=cfg)
    assert got.shape == (m, N) and got.dtype == torch.bfloat16
    assert_close(got, _reference(x, q, bias), torch.bfloat16)
    assert_close(got, ig.int4_gemv_ref(x, q.qweight, q.scales, q.offsets, bias), torch.bfloat16)


def test_fp16_activations_and_scales() -> None:
    q, words, pairs = _weight(128, False, torch.float16, seed=2)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    got = ig.int4_gemv(x, words, pairs, config=ig.Int4GemvConfig(64, 4, 1, 4, 2))
    assert_close(got, _reference(x, q), torch.float16)


def test_silu_mul_prologue() -> None:
    q, words, pairs = _weight(128, False, seed=4)
    gate_up = torch.randn(1, 2 * K, generator=torch.Generator().manual_seed(5))
    gate_up = gate_up.to(torch.bfloat16).to(DEVICE)
    cfg = ig.Int4GemvConfig(64, 4, 1, 4, 2)
    got = ig.int4_gemv(gate_up, words, pairs, silu_mul=True, config=cfg)
    assert_close(got, _reference(silu_and_mul_ref(gate_up), q), torch.bfloat16)


def test_heuristic_fills_the_gpu_and_resolves() -> None:
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        for m in (1, 2, 3, 4, 8, 16):
            cfg = ig.heuristic_config(n, k, 128, m, 132)
            assert ig._resolve(cfg, k, 128) is not None, (n, k, m, cfg)
            assert cfg.ksplit * ig.m_bucket(m) <= 32
            wider = cfg._replace(ksplit=2 * cfg.ksplit, tiles=1)
            assert n // (cfg.block_n // cfg.ksplit) >= 2 * 132 or (
                wider.ksplit * ig.m_bucket(m) > 32 or ig._resolve(wider, k, 128) is None
            )


def test_every_table_entry_runs_its_shape() -> None:
    """Each measured config resolves for its key's K and group (else the kernel would refuse it
    at run time), and the norm-prologue configs of an even N can split a gate | up weight (the
    fused decode MLP's SiLU epilogue needs it, else it falls back to two launches)."""
    for key, fields in ig.TUNED_CONFIGS.items():
        if fields is not None:
            _, n, k, group, _ = key
            assert ig._resolve(ig.Int4GemvConfig(*fields), k, group) is not None, key
    for key, fields in ig.PROLOGUE_TUNED_CONFIGS.items():
        prologue, _, n, k, group, _ = key
        cfg = ig.Int4GemvConfig(*fields)
        assert ig._resolve(cfg, k, group) is not None, key
        if prologue == "norm" and n == 28672:  # Llama-3.1-8B's gate | up
            assert ig.splits_gate_up(n, cfg), key


def test_refusals() -> None:
    q, words, pairs = _weight(128, False)
    x = torch.zeros(1, K + 8, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="does not match"):
        ig.int4_gemv(x, words, pairs)
    with pytest.raises(ValueError, match="rows"):
        ig.int4_gemv(torch.zeros(257, K, dtype=torch.bfloat16, device=DEVICE), words, pairs)
    with pytest.raises(ValueError, match="not taken"):  # row tiles only where measured
        ig.int4_gemv(torch.zeros(17, K, dtype=torch.bfloat16, device=DEVICE), words, pairs)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        ig.int4_gemv(torch.zeros(1, K, device=DEVICE), words, pairs)
    bad = ig.Int4GemvConfig(64, 8, 4, 4, 2)  # K / 8 slices is not a whole number of 4 tiles
    x = torch.zeros(1, K, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="cannot run"):
        ig.int4_gemv(x, words, pairs, config=bad)
    assert not ig.can_repack(200, 40) and not ig.can_repack(384, 96) and ig.can_repack(384, 128)
    with pytest.raises(ValueError, match="multiple of 128"):
        ig.repack_int4(torch.zeros(2, 100, dtype=torch.uint8))
    assert not ig.supports(torch.zeros(1, K, device=DEVICE), words, 128)  # fp32 x


@pytest.mark.skipif(not ON_GPU, reason="the repacked path is taken on CUDA only")
def test_linear_layer_takes_int4_gemv() -> None:
    from roofline.layers.linear import MergedLinear
    from roofline.quantization.int4 import Int4LinearMethod

    layer = MergedLinear(K, [N // 2, N // 2], bias=False, method=Int4LinearMethod(128)).to(DEVICE)
    w = torch.randn(N, K, device=DEVICE) / K**0.5
    for shard in range(2):
        layer.method.load(layer, shard, "weight", w[shard * N // 2 : (shard + 1) * N // 2])
    layer.method.process_weights_after_loading(layer)
    assert layer.gemv_words is not None and layer.gemv_bits == 4
    x = torch.randn(1, K, device=DEVICE, dtype=torch.bfloat16)
    q = formats.Int4Weight(layer.qweight, layer.scales, layer.offsets)
    assert_close(layer(x), _reference(x, q), torch.bfloat16)


def test_int8_repack_round_trip() -> None:
    gen = torch.Generator().manual_seed(6)
    q = torch.randint(-128, 128, (3, 256), generator=gen, dtype=torch.int8)
    words = ig.repack_int8(q)
    assert words.dtype == torch.int32 and words.shape == (3, 64)
    assert torch.equal(ig.unrepack_int8(words), q)
    u = int(q[2, 128 + 32 * 1 + 2 * 3 + 1]) + 128  # tile 1, i 1, w 3, h 1: nibble 4 + 1 = 5
    assert (int(words[2, 32 + 3]) >> 20) & 0xF == u & 15
    assert (int(words[2, 32 + 16 + 3]) >> 20) & 0xF == u >> 4


@pytest.mark.parametrize(
    "group,dtype,m,cfg",
    [
        (K, torch.bfloat16, 1, ig.Int4GemvConfig(64, 8, 1, 4, 2)),  # per channel, 8 K-slices
        (K, torch.bfloat16, 3, None),
        (32, torch.float16, 1, None),
        (128, torch.bfloat16, 16, ig.Int4GemvConfig(32, 1, 2, 2, 2)),
    ],
)
def test_int8_planes_match_reference(group, dtype, m, cfg) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(N, K, generator=gen) / K**0.5
    q = formats.quantize_int8(w, group, dtype)
    qweight, scales = q.qweight.to(DEVICE), q.scales.to(DEVICE)
    words, pairs = ig.repack_int8(qweight), ig.pack_scales(scales, None)
    x = torch.randn(m, K, generator=gen).to(dtype).to(DEVICE)
    got = ig.int4_gemv(x, words, pairs, bits=8, config=cfg)
    expected = (x.float() @ formats.dequantize_int8(qweight, scales, torch.float32).T).to(dtype)
    assert_close(got, expected, dtype)


def test_tuned_none_leaves_the_shape_to_quant_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    _, words, pairs = _weight(128, False)
    x = torch.zeros(1, K, dtype=torch.bfloat16, device=DEVICE)
    assert ig.supports(x, words, 128)
    monkeypatch.setitem(ig.TUNED_CONFIGS, (4, N, K, 128, 1), None)
    assert not ig.supports(x, words, 128)
    assert ig.supports(torch.zeros(2, K, dtype=torch.bfloat16, device=DEVICE), words, 128)
    with pytest.raises(ValueError, match="not taken"):
        ig.int4_gemv(x, words, pairs)


@pytest.mark.parametrize("bits", [4, 8])
def test_norm_prologue_and_residual_epilogue(bits: int) -> None:
    """rms_norm inside the GEMV and the residual add after it: the bits of rms_norm, the GEMV
    and the add run apart (on the GPU each program sums the statistic in its own order)."""
    from roofline.kernels.rmsnorm import rms_norm

    gen = torch.Generator().manual_seed(8)
    w = torch.randn(N, K, generator=gen) / K**0.5
    if bits == 4:
        q = formats.quantize_int4(w, 128, False, torch.bfloat16)
        words, pairs = ig.repack_int4(q.qweight), ig.pack_scales(q.scales, q.offsets)
    else:
        q8 = formats.quantize_int8(w, K, torch.bfloat16)
        words, pairs = ig.repack_int8(q8.qweight), ig.pack_scales(q8.scales, None)
    words, pairs = words.to(DEVICE), pairs.to(DEVICE)
    h = (torch.randn(1, K, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    norm_w = (torch.rand(K, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(1, N, generator=gen).to(torch.bfloat16).to(DEVICE)
    cfg = ig.Int4GemvConfig(64, 8, 1, 4, 2)
    got = ig.int4_gemv(h, words, pairs, norm=(norm_w, 1e-5), residual=residual, bits=bits,
                       config=cfg)  # fmt: skip
    plain = ig.int4_gemv(rms_norm(h, norm_w, 1e-5), words, pairs, bits=bits, config=cfg)
    expected = (plain.float() + residual.float()).to(torch.bfloat16)
    if ON_GPU:
        assert_close(got, expected, torch.bfloat16)
    else:
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="one row"):
        ig.int4_gemv(h.expand(2, K).contiguous(), words, pairs, norm=(norm_w, 1e-5), bits=bits)


@pytest.mark.parametrize("fuse_silu", [False, True])
def test_fused_decode_layer_calls_take_int4_gemv(fuse_silu: bool, monkeypatch) -> None:
    """layers.fused_decode's two GEMM entry points on a repacked quantized linear: the norm
    prologue GEMM and the SiLU + residual GEMM equal the unfused kernels' composition."""
    from torch import nn

    from roofline.kernels.activation import silu_and_mul
    from roofline.kernels.rmsnorm import rms_norm
    from roofline.layers import fused_decode
    from roofline.layers.linear import MergedLinear
    from roofline.quantization import common
    from roofline.quantization.int4 import Int4LinearMethod

    monkeypatch.setitem(common.GEMV_FUSE_SILU, 4, fuse_silu)
    gen = torch.Generator().manual_seed(9)
    layer = MergedLinear(K, [N], bias=False, method=Int4LinearMethod(128))
    layer.method.load(layer, 0, "weight", torch.randn(N, K, generator=gen) / K**0.5)
    layer = layer.to(DEVICE)
    layer.gemv_words = ig.repack_int4(layer.qweight)  # what prepare_kernel_layout makes on CUDA
    layer.gemv_pairs = ig.pack_scales(layer.scales, layer.offsets)
    layer.gemv_bits, layer.gemv_group = 4, 128
    assert fused_decode._gemv_linear(layer)
    norm = nn.Module()
    norm.weight = nn.Parameter((torch.rand(K, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE))
    norm.eps = 1e-5
    h = torch.randn(1, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    got = fused_decode.norm_linear(layer, norm, h)
    expected = ig.int4_gemv(rms_norm(h, norm.weight, norm.eps), layer.gemv_words, layer.gemv_pairs)
    assert_close(got, expected, torch.bfloat16)
    gate_up = torch.randn(1, 2 * K, generator=gen).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(1, N, generator=gen).to(torch.bfloat16).to(DEVICE)
    got = fused_decode.linear_add(layer, gate_up, residual, silu_mul=True)
    plain = ig.int4_gemv(silu_and_mul(gate_up), layer.gemv_words, layer.gemv_pairs)
    assert_close(got, (plain.float() + residual.float()).to(torch.bfloat16), torch.bfloat16)


def test_split_k_over_the_grid_leaves_counters_zero() -> None:
    """K parts on the grid: the last program of each row block adds the partials (bias and
    residual once), and every arrival counter is zero again for the next launch."""
    from roofline.kernels.last_program import counters

    q, words, pairs = _weight(128, False, seed=11)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(2, N, generator=gen).to(torch.bfloat16).to(DEVICE)
    expected = (_reference(x, q, bias).float() + residual.float()).to(torch.bfloat16)
    for kgrid in (2, 4, 2):
        cfg = ig.Int4GemvConfig(32, 2, 1, 2, 2, kgrid)
        got = ig.int4_gemv(x, words, pairs, bias, residual=residual, config=cfg)
        assert_close(got, expected, torch.bfloat16)
        assert int(counters(x.device, 1, "int4_gemv").abs().sum()) == 0  # the kernel's buffer


@pytest.mark.parametrize("canonical", [False, True])
def test_symmetric_layers_pass_their_scales_alone(canonical: bool, monkeypatch) -> None:
    """A symmetric int4 layer's kernel operand is its ``[N, groups]`` scales themselves (offset
    ``-8 s`` in the kernel: the same result as the pairs, no copy); an asymmetric layer's is
    the pairs; the norm and SiLU prologues and the residual read the scales alone too."""
    from roofline.layers.linear import MergedLinear
    from roofline.quantization import common
    from roofline.quantization.int4 import Int4LinearMethod

    monkeypatch.setattr(common, "INT4_GEMV_CANONICAL", canonical)
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(N, K, generator=gen) / K**0.5
    for symmetric in (True, False):
        layer = MergedLinear(K, [N], bias=False, method=Int4LinearMethod(128, symmetric))
        layer.method.load(layer, 0, "weight", w)
        layer = layer.to(DEVICE)
        common.prepare_kernel_layout("int4", layer, cuda_only=False)
        if not symmetric:
            assert layer.gemv_pairs.shape == (N, K // 128, 2)
            continue
        assert layer.gemv_pairs.data_ptr() == layer.scales.data_ptr()
        q = formats.Int4Weight(layer.qweight, layer.scales, layer.offsets)
        pairs = ig.pack_scales(layer.scales, layer.offsets)
        words, scales = layer.gemv_words, layer.gemv_pairs
        x = torch.randn(3, K, generator=gen).to(torch.bfloat16).to(DEVICE)
        got = ig.int4_gemv(x, words, scales)
        assert torch.equal(got, ig.int4_gemv(x, words, pairs))  # -8 s is the stored offset
        assert_close(got, _reference(x, q), torch.bfloat16)
        h = x[:1]
        nw = (torch.rand(K, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE)
        got = ig.int4_gemv(h, words, scales, norm=(nw, 1e-5))
        assert torch.equal(got, ig.int4_gemv(h, words, pairs, norm=(nw, 1e-5)))
        gu = torch.randn(2, 2 * K, generator=gen).to(torch.bfloat16).to(DEVICE)
        res = torch.randn(2, N, generator=gen).to(torch.bfloat16).to(DEVICE)
        got = ig.int4_gemv(gu, words, scales, silu_mul=True, residual=res)
        assert torch.equal(got, ig.int4_gemv(gu, words, pairs, silu_mul=True, residual=res))
        monkeypatch.setattr(common, "INT4_GEMV_PAIRS", True)
        common.prepare_kernel_layout("int4", layer, cuda_only=False)
        assert layer.gemv_pairs.shape == (N, K // 128, 2)
        monkeypatch.setattr(common, "INT4_GEMV_PAIRS", False)
    with pytest.raises(ValueError, match="do not fit"):
        ig.int4_gemv(x, words, scales[:, :-1].contiguous())
