"""CPU quantized GEMMs (roofline.kernels.cpu) against plain-torch references on random blocks:
every block type, every vector path this CPU runs plus the C fallback, one and several rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from roofline.kernels.cpu import build, ops

LIB = build.load_library()
needs_lib = pytest.mark.skipif(LIB is None, reason="no C compiler: the torch fallback only")
ISAS = [n for i, n in enumerate(build.ISA_NAMES) if LIB is not None and i <= LIB.rl_best_isa()]


def random_blocks(fmt: str, rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [rows, k / 32 * block_bytes] of valid GGUF blocks with realistic scales."""
    nb = k // 32
    b = torch.randint(0, 256, (rows, nb, ops.BLOCK_BYTES[fmt]), dtype=torch.uint8, generator=gen)
    b[..., 0:2] = (torch.rand(rows, nb, 1, generator=gen) * 0.02 + 1e-3).half().view(torch.uint8)
    if fmt == "Q4_1":
        b[..., 2:4] = (-torch.rand(rows, nb, 1, generator=gen) * 0.1).half().view(torch.uint8)
    if fmt == "Q8_0":  # int8 quants in -127..127 as llama.cpp writes them
        q = torch.randint(-127, 128, (rows, nb, 32), dtype=torch.int8, generator=gen)
        b[..., 2:] = q.view(torch.uint8)
    return b.reshape(rows, -1).contiguous()


def quantized_activations_ref(x: torch.Tensor, act_bits: int) -> torch.Tensor:
    """The per-block int8/int16 activations the kernels see, dequantized (torch, independent)."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / (2 ** (act_bits - 1) - 1)
    q = torch.where(d > 0, xb / d, torch.zeros_like(xb)).round()
    return (q * d).reshape(m, k)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_reference_dequant_matches_gguf_package(fmt: str) -> None:
    gen = torch.Generator().manual_seed(1)
    blocks = random_blocks(fmt, 8, 128, gen)
    want = gguf_dequantize(blocks.numpy(), GGMLQuantizationType[fmt]).reshape(8, 128)
    w = ops.GGUFRows.from_tensors(fmt, 128, [(blocks, None)])
    np.testing.assert_array_equal(ops._dequantize_ref(fmt, blocks, 128).numpy(), want)
    np.testing.assert_array_equal(ops.gguf_dequantize(w).numpy(), want)  # C (or fallback)
    rows = torch.tensor([5, 0, 5])
    np.testing.assert_array_equal(ops.gguf_dequantize(w, rows).numpy(), want[[5, 0, 5]])


@needs_lib
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 3, 9, 17])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_gguf_gemm_parity(fmt: str, isa: str, m: int, act_bits: int) -> None:
    gen = torch.Generator().manual_seed(2)
    k = 288
    a, b = random_blocks(fmt, 70, k, gen), random_blocks(fmt, 50, k, gen)
    order = torch.randperm(50, generator=gen)
    w = ops.GGUFRows.from_tensors(fmt, k, [(a, None), (b, order)])  # packed + permuted rows
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(120, generator=gen)
    weight = torch.cat([ops._dequantize_ref(fmt, a, k), ops._dequantize_ref(fmt, b[order], k)])
    y = ops.gguf_gemm(x, w, bias, isa=isa, act_bits=act_bits)
    tight = torch.nn.functional.linear(quantized_activations_ref(x, act_bits), weight, bias)
    torch.testing.assert_close(y, tight, rtol=1e-4, atol=1e-4)
    exact = torch.nn.functional.linear(x, weight, bias)
    err = ((y - exact).norm() / exact.norm()).item()
    assert err < (0.02 if act_bits == 8 else 1e-4)  # int8: ~1% of the output; int16: ~1e-5


@needs_lib
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_canonical_gemm_parity(
    isa: str, bits: int, scale_dtype: torch.dtype, act_bits: int
) -> None:
    gen = torch.Generator().manual_seed(3)
    n, k, group = 40, 256, 64
    if bits == 4:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        offsets = (-torch.rand(n, k // group, generator=gen) * 0.1).to(scale_dtype)
    else:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        offsets = None
    scales = (torch.rand(n, k // group, generator=gen) * 0.02).to(scale_dtype)
    x = torch.randn(21, k, generator=gen)  # a 16-row tile and 5 rows
    weight = ops.dequantize_canonical(q, scales, offsets, bits)
    y = ops.canonical_gemm(x, q, scales, offsets, bits, isa=isa, act_bits=act_bits)
    tight = torch.nn.functional.linear(quantized_activations_ref(x, act_bits), weight)
    torch.testing.assert_close(y, tight, rtol=1e-4, atol=1e-4)
    alone = ops.canonical_gemm(x[17:18], q, scales, offsets, bits, isa=isa, act_bits=act_bits)
    assert torch.equal(alone[0], y[17]) and torch.equal(
        ops.canonical_gemm(x[3:4], q, scales, offsets, bits, isa=isa, act_bits=act_bits)[0], y[3]
    )


def test_canonical_int4_nibble_order() -> None:
    """Element k of a row is byte k // 2, low nibble for even k (the shared layout)."""
    q = torch.tensor([[0x21, 0x43]], dtype=torch.uint8)
    w = ops.dequantize_canonical(q, torch.ones(1, 1), None, 4)
    assert w.tolist() == [[1.0, 2.0, 3.0, 4.0]]


def test_fallback_without_library(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(4)
    blocks = random_blocks("Q4_1", 16, 64, gen)
    w = ops.GGUFRows.from_tensors("Q4_1", 64, [(blocks, None)])
    x = torch.randn(2, 64, generator=gen)
    monkeypatch.setattr(ops, "load_library", lambda: None)
    want = x @ ops._dequantize_ref("Q4_1", blocks, 64).T
    torch.testing.assert_close(ops.gguf_gemm(x, w), want)
    q = torch.randint(0, 256, (4, 32), dtype=torch.uint8, generator=gen)
    s = torch.rand(4, 2, generator=gen)
    want = x @ ops.dequantize_canonical(q, s, None, 4).T
    torch.testing.assert_close(ops.canonical_gemm(x, q, s, None, 4), want)


@needs_lib
def test_library_cache_key_follows_source(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = build._compiler()
    first = build.library_path(compiler)
    assert first.is_file()  # built by load_library() above
    src = tmp_path / "quant_gemm.c"
    src.write_text(build.SOURCES[0].read_text() + "\n/* changed */\n")
    monkeypatch.setattr(build, "SOURCES", (src, *build.SOURCES[1:]))
    assert build.library_path(compiler) != first


@needs_lib
def test_threaded_large_gemm_matches_single_chunk() -> None:
    """Enough rows for the thread pool: chunks claimed by any thread give the same rows."""
    gen = torch.Generator().manual_seed(5)
    blocks = random_blocks("Q8_0", 1000, 512, gen)
    w = ops.GGUFRows.from_tensors("Q8_0", 512, [(blocks, None)])
    x = torch.randn(1, 512, generator=gen)
    y = ops.gguf_gemm(x, w)
    ref = torch.nn.functional.linear(
        quantized_activations_ref(x, ops.ACT_BITS), ops._dequantize_ref("Q8_0", blocks, 512)
    )
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-3)  # |y| ~ 30: fp32 sum order


@needs_lib
def test_silu_mul_fused_into_the_input() -> None:
    gen = torch.Generator().manual_seed(6)
    blocks = random_blocks("Q4_1", 48, 96, gen)
    w = ops.GGUFRows.from_tensors("Q4_1", 96, [(blocks, None)])
    gate_up = torch.randn(3, 192, generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    want = ops.gguf_gemm((torch.nn.functional.silu(gate) * up).contiguous(), w)
    torch.testing.assert_close(ops.gguf_gemm(gate_up, w, silu_mul=True), want)


@needs_lib
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_gguf_gemm_rows_are_batch_invariant(fmt: str, isa: str, act_bits: int) -> None:
    """Each output row is bit-identical whether its activation row is multiplied alone or in a
    batch of any size: on the AVX-512 int16 path, up to 3 rows run the 16-weight-row kernel
    and more the 16-row tiles (37 rows: three tiles, the last padded), and the thread pool's
    chunks (600 weight rows: a tail of 8 after 16-row groups)."""
    gen = torch.Generator().manual_seed(11)
    k = 96 if fmt == "Q8_0" else 160  # an odd number of blocks: the pair path's tail block
    w = ops.GGUFRows.from_tensors(fmt, k, [(random_blocks(fmt, 600, k, gen), None)])
    x = torch.randn(37, k, generator=gen)
    batched = ops.gguf_gemm(x, w, isa=isa, act_bits=act_bits)
    for size in (1, 2, 3, 4, 5, 16, 17):
        for start in range(0, 37 - size + 1, 7):
            part = ops.gguf_gemm(x[start : start + size], w, isa=isa, act_bits=act_bits)
            assert torch.equal(part, batched[start : start + size]), (size, start)


@needs_lib
def test_long_rows_run_tiles_in_several_cache_blocks() -> None:
    """K = 8192 (256 blocks): the tile kernel runs one 16-row tile per cache block; the rows
    still equal the reference and their single-row results."""
    gen = torch.Generator().manual_seed(13)
    k = 8192
    blocks = random_blocks("Q4_1", 24, k, gen)
    w = ops.GGUFRows.from_tensors("Q4_1", k, [(blocks, None)])
    x = torch.randn(37, k, generator=gen)
    y = ops.gguf_gemm(x, w)
    ref = torch.nn.functional.linear(
        quantized_activations_ref(x, ops.ACT_BITS), ops._dequantize_ref("Q4_1", blocks, k)
    )
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-3)
    for i in (0, 16, 36):
        assert torch.equal(ops.gguf_gemm(x[i : i + 1], w)[0], y[i])


@needs_lib
def test_pool_runs_back_to_back_jobs() -> None:
    """Hundreds of short pool jobs in a row (activation prep, then the GEMM, each on the pool):
    a worker late for one job never computes a chunk of the next with the wrong fields."""
    gen = torch.Generator().manual_seed(17)
    blocks = random_blocks("Q4_1", 256, 256, gen)
    w = ops.GGUFRows.from_tensors("Q4_1", 256, [(blocks, None)])
    x = torch.randn(8, 256, generator=gen)
    first = ops.gguf_gemm(x, w)
    for _ in range(400):
        assert torch.equal(ops.gguf_gemm(x, w), first)


@needs_lib
def test_argmax_rows_matches_torch() -> None:
    """The pool's greedy argmax: torch's first index of the max, ties and NaN included."""
    gen = torch.Generator().manual_seed(19)
    logits = torch.randn(37, 5000, generator=gen)
    logits[3, [7, 4000]] = 50.0  # a tie: the first wins
    logits[5, 4999] = 60.0  # in the scalar tail
    logits[9, [10, 20]] = float("nan")  # NaN counts as the max
    logits[11] = -float("inf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the pool owns the cores (as take_cores leaves them)
    try:
        got = ops.argmax_rows(logits)
        strided = ops.argmax_rows(logits[:, :4096])
    finally:
        torch.set_num_threads(threads)
    assert got is not None and strided is not None
    assert torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(strided, logits[:, :4096].argmax(dim=-1))
