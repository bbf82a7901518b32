"""Quantized weight layouts on the CPU: RTN round trips per method, GPTQ / AWQ unpacking
against packers written here from the formats' definitions, and GGUF Q8_0 / Q4_0 / Q4_1 blocks
repacked into the canonical layouts, dequantized bit for bit as the ``gguf`` package does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roofline.quantization import formats
from roofline.quantization.gguf import unpack_blocks
from roofline.quantization.gptq import AWQ_ORDER, PackedIntLinearMethod

gguf = pytest.importorskip("gguf")


def _w(n: int = 24, k: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_int4_pack_roundtrip() -> None:
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = formats.pack_int4(q)
    assert packed.shape == (5, 32)
    assert torch.equal(packed[0, 0], (q[0, 0] | (q[0, 1] << 4)).to(torch.uint8))
    assert torch.equal(formats.unpack_int4(packed), q)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_rtn_roundtrip(group: int, symmetric: bool) -> None:
    w = _w()
    q = formats.quantize_int4(w, group, symmetric, torch.float32)
    deq = formats.dequantize_int4(*q, torch.float32)
    # every element within half a step of its group's scale
    step = q.scales.repeat_interleave(group, dim=1)
    assert bool(((deq - w).abs() <= 0.5 * step + 1e-6).all())
    again = formats.quantize_int4(deq, group, symmetric, torch.float32)
    assert torch.equal(formats.unpack_int4(again.qweight), formats.unpack_int4(q.qweight))


@pytest.mark.parametrize("group", [32, 128])
def test_int8_rtn_roundtrip(group: int) -> None:
    w = _w()
    q = formats.quantize_int8(w, group, torch.float32)
    deq = formats.dequantize_int8(q.qweight, q.scales, torch.float32)
    assert bool(((deq - w).abs() <= 0.5 * q.scales.repeat_interleave(group, 1) + 1e-6).all())
    assert torch.equal(formats.quantize_int8(deq, group, torch.float32).qweight, q.qweight)


def test_fp8_roundtrip() -> None:
    w = _w()
    q, s = formats.quantize_fp8(w)
    deq = formats.dequantize_fp8(q, s, torch.float32)
    assert float(((deq - w).abs() / w.abs().amax(1, keepdim=True)).max()) < 1 / 16
    q2, s2 = formats.quantize_fp8(deq)
    assert torch.equal(q2.float(), q.float())


def _pack_along(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Reference packer: ``32 / bits`` consecutive values along ``axis`` into one int32, value
    ``j`` (or ``order[j]`` of the group) at bits ``j * bits``."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]
    packed = np.zeros(v.shape[:-1], dtype=np.uint32)
    for j in range(per):
        packed |= v[..., j] << np.uint32(j * bits)
    return np.moveaxis(packed.view(np.int32), -1, axis)


class _Layer(torch.nn.Module):
    def __init__(self, k: int, sizes: list[int]) -> None:
        super().__init__()
        self.in_features, self.output_sizes, self.bias = k, sizes, None


@pytest.mark.parametrize("fmt,bits", [("gptq", 4), ("gptq", 8), ("awq", 4)])
def test_gptq_awq_load_matches_definition(fmt: str, bits: int) -> None:
    """Packed checkpoint tensors of two shards -> canonical -> dequantized == (q - z) * s."""
    k, sizes, group = 64, [16, 8], 32
    gen = np.random.default_rng(0)
    method = PackedIntLinearMethod(fmt, bits, group, zero_offset=1 if fmt == "gptq" else 0)
    layer = _Layer(k, sizes)
    method.create_weights(layer, k, sizes, torch.float16)
    expected = []
    for shard, n in enumerate(sizes):
        q = gen.integers(0, 1 << bits, size=(k, n))  # [K, N], the checkpoints' orientation
        # GPTQ v1 stores z - 1, so z = 0 (stored as 15) is outside what it can express
        low = 1 if fmt == "gptq" else 0
        z = np.full((k // group, n), 128) if bits == 8 else gen.integers(low, 16, (k // group, n))
        s = gen.uniform(0.01, 0.1, size=(k // group, n)).astype(np.float16)
        if fmt == "gptq":
            qweight = _pack_along(q, bits, axis=0)
            qzeros = _pack_along(z - 1, bits, axis=1)
        else:
            qweight = _pack_along(q, 4, axis=1, order=AWQ_ORDER)
            qzeros = _pack_along(z, 4, axis=1, order=AWQ_ORDER)
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", s)):
            method.load(layer, shard, name, torch.from_numpy(np.ascontiguousarray(t)))
        zs = np.repeat(z, group, axis=0)
        ss = np.repeat(s.astype(np.float32), group, axis=0)
        expected.append(((q - zs) * ss).T)
    method.process_weights_after_loading(layer)
    expected_w = torch.from_numpy(np.concatenate(expected).astype(np.float32))
    from roofline.quantization.common import dequantize

    got = dequantize(method.kind, layer, torch.float32)
    torch.testing.assert_close(got, expected_w, atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="expected"):
        method.load(layer, 0, "qweight", torch.zeros(3, 3, dtype=torch.int32))


def test_gptq_act_order_refused() -> None:
    method = PackedIntLinearMethod("gptq", 4, 32, 1)
    layer = _Layer(64, [8])
    method.create_weights(layer, 64, [8], torch.float16)
    method.load(layer, 0, "g_idx", torch.arange(64) // 32)  # trivial: accepted
    with pytest.raises(ValueError, match="act-order"):
        method.load(layer, 0, "g_idx", torch.arange(64).flip(0) // 32)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_bit_exact(kind: str) -> None:
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    data = (np.random.default_rng(1).standard_normal((6, 128)) * 0.1).astype(np.float32)
    blocks = gguf.quants.quantize(data, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    tensors = unpack_blocks(kind, blocks, rows=6)
    if kind == "Q8_0":
        got = formats.dequantize_int8(*tensors, torch.float32)
    else:
        got = formats.dequantize_int4(*tensors, torch.float32)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_gguf_k_quants_bit_exact(kind: str) -> None:
    """Random super-blocks (finite fp16 scales) against the gguf package's dequantization."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block_bytes = {"Q4_K": 144, "Q6_K": 210}[kind]
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, size=(4, 2, block_bytes), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, size=(4, 2, 2)).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":
        blocks[..., 0:4] = scales.reshape(4, 2, 4)
    else:
        blocks[..., 208:210] = scales[..., 0:1, :].reshape(4, 2, 2)
    data = blocks.reshape(4, -1)
    expected = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
    tensors = unpack_blocks(kind, data, rows=4)
    if kind == "Q6_K":
        got = formats.dequantize_int8(*tensors, torch.float32)
    else:
        got = formats.dequantize_int4(*tensors, torch.float32)
    assert torch.equal(got, expected.reshape(4, -1))


def test_embedded_smollm2_blocks_bit_exact() -> None:
    from roofline.models.gguf_loader import dequantize_tensor, open_gguf
    from roofline.models.weights import gguf_path

    tensors = {t.name: t for t in open_gguf(str(gguf_path())).tensors}
    for name, kind in (("blk.0.attn_q.weight", "Q4_1"), ("blk.3.ffn_down.weight", "Q4_1")):
        t = tensors[name]
        assert t.tensor_type.name == kind
        parts = unpack_blocks(kind, t.data, rows=int(t.shape[-1]))
        got = formats.dequantize_int4(*parts, torch.float32)
        assert torch.equal(got, dequantize_tensor(t))


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("axis,start,size", [("out", 8, 8), ("in", 32, 32)])
def test_packed_shard_slice_matches_full_layer(fmt: str, axis: str, start: int, size: int) -> None:
    """A tensor-parallel rank's slice of the checkpoint tensors loads into the same values as the
    matching block of the whole layer."""
    from roofline.quantization.common import dequantize

    k, n, group = 64, 16, 32
    gen = np.random.default_rng(3)
    q = gen.integers(0, 16, size=(k, n))
    z = gen.integers(1, 16, (k // group, n))
    s = gen.uniform(0.01, 0.1, size=(k // group, n)).astype(np.float16)
    if fmt == "gptq":
        tensors = {"qweight": _pack_along(q, 4, 0), "qzeros": _pack_along(z - 1, 4, 1)}
    else:
        tensors = {
            "qweight": _pack_along(q, 4, 1, AWQ_ORDER),
            "qzeros": _pack_along(z, 4, 1, AWQ_ORDER),
        }
    tensors["scales"] = s
    tensors = {name: torch.from_numpy(np.ascontiguousarray(t)) for name, t in tensors.items()}
    tensors["g_idx"] = torch.arange(k, dtype=torch.int32) // group

    def build(in_features: int, out_features: int, slicer) -> torch.Tensor:
        method = PackedIntLinearMethod(fmt, 4, group, 1 if fmt == "gptq" else 0)
        layer = _Layer(in_features, [out_features])
        method.create_weights(layer, in_features, [out_features], torch.float16)
        for name, t in tensors.items():
            if fmt == "awq" and name == "g_idx":
                continue
            method.load(layer, 0, name, slicer(method, name, t))
        method.process_weights_after_loading(layer)
        return dequantize("int4", layer, torch.float32)

    full = build(k, n, lambda m, name, t: t)
    local_k, local_n = (size, n) if axis == "in" else (k, size)
    part = build(local_k, local_n, lambda m, name, t: m.shard_slice(name, t, axis, start, size))
    expected = full[:, start : start + size] if axis == "in" else full[start : start + size]
    assert torch.equal(part, expected)
