"""Quantized KV cache (fp8 e4m3 / int8 pages with per-token, per-head scales): the store
kernels against ``kv_cache.quantize``, and the decode / prefill attention kernels reading
quantized pages against the torch references over the dequantized cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_utils import DEVICE, make_paged
from test_rotary import make_cos_sin_cache

from roofline.kernels.decode_attention import decode_attention, decode_attention_ref
from roofline.kernels.kv_store import rotary_kv_store, rotary_kv_store_ref, store_kv, store_kv_ref
from roofline.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from roofline.quantization.kv_cache import KVCacheSpec, dequantize, quantize

PAGE_DTYPES = [torch.float8_e4m3fn, torch.int8]


def _caches(page_dtype: torch.dtype, num_pages: int, page_size: int, heads: int, dim: int):
    spec = KVCacheSpec.create("fp8" if page_dtype == torch.float8_e4m3fn else "int8", torch.float32)
    data, scales = spec.allocate(1, num_pages, page_size, heads, dim, DEVICE)
    return data[0, 0], data[0, 1], scales[0, 0], scales[0, 1]


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
def test_quantize_round_trip(page_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=gen) * torch.logspace(-3, 3, 7)[:, None, None]
    x[2, 1] = 0.0  # an all-zero head: scale 1, zeros back
    q, s = quantize(x, page_dtype)
    back = dequantize(q, s, torch.float32)
    # int8: half a step of amax / 127; fp8 e4m3: 3 mantissa bits (relative 2^-4) above 2^-6
    amax = x.abs().amax(-1, keepdim=True)
    bound = amax / 254 if page_dtype == torch.int8 else x.abs() / 16 + amax / 448 * 2**-9
    assert torch.all((back - x).abs() <= bound * 1.0001)
    assert torch.all(back[2, 1] == 0)
    assert q.float().abs().amax() == (127 if page_dtype == torch.int8 else 448)


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_quantized(page_dtype: torch.dtype, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(9, 3, 32, generator=gen) * 3).to(dtype).to(DEVICE)
    v = torch.randn(9, 3, 32, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(4 * 8, generator=gen)[:9]
    slots[4] = -1  # padding row: stores nothing
    slots = slots.to(DEVICE)
    got = _caches(page_dtype, 4, 8, 3, 32)
    ref = [t.clone() for t in got]
    store_kv(k, v, *got[:2], slots, *got[2:])
    store_kv_ref(k, v, *ref[:2], slots, *ref[2:])
    for a, b in zip(got, ref):  # bit-exact: fp8 compared as raw bytes
        bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
def test_rotary_kv_store_quantized(page_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(6, 4, 32, generator=gen).to(DEVICE)
    k = torch.randn(6, 2, 32, generator=gen).to(DEVICE)
    v = torch.randn(6, 2, 32, generator=gen).to(DEVICE)
    positions = torch.tensor([0, 5, 9, 17, 3, 30], device=DEVICE)
    cos_sin = make_cos_sin_cache(32, 64)
    slots = torch.tensor([3, 8, -1, 12, 0, 31], device=DEVICE)
    got = _caches(page_dtype, 4, 8, 2, 32)
    ref = [t.clone() for t in got]
    q_ref, k_ref = rotary_kv_store_ref(q, k, v, positions, cos_sin, *ref[:2], slots, *ref[2:])
    rotary_kv_store(q, k, v, positions, cos_sin, *got[:2], slots, k_scale=got[2], v_scale=got[3])
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=0)


def _quantized_batch(page_dtype: torch.dtype, query_lens, context_lens, dtype, seed=0):
    batch = make_paged(query_lens, context_lens, 8, 2, 32, 8, dtype, seed=seed)
    kq, ks = quantize(batch.k_cache, page_dtype)  # garbage pages quantized too: never read
    vq, vs = quantize(batch.v_cache, page_dtype)
    return batch, kq, vq, ks, vs


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_quantized(page_dtype, dtype, num_splits) -> None:
    context_lens = [0, 37, 70, 5]
    batch, kq, vq, ks, vs = _quantized_batch(page_dtype, [1] * 4, context_lens, dtype)
    args = (batch.q, kq, vq, batch.block_table, batch.seq_lens, 0.125)
    out = decode_attention(*args, num_splits=num_splits, k_scale=ks, v_scale=vs)
    ref = decode_attention_ref(*args, k_scale=ks, v_scale=vs)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # and close to attention over the unquantized cache (quantization error only)
    exact = decode_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.block_table,
                                 batch.seq_lens, 0.125)  # fmt: skip
    err = (out.float() - exact.float()).abs().max().item()
    assert err < (0.05 if page_dtype == torch.int8 else 0.15), err


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_quantized(page_dtype, dtype) -> None:
    query_lens, context_lens = [19, 1, 7], [0, 40, 12]
    batch, kq, vq, ks, vs = _quantized_batch(page_dtype, query_lens, context_lens, dtype, seed=3)
    args = (batch.q, kq, vq, batch.block_table, batch.query_start_loc, batch.seq_lens, 0.125)
    out = prefill_attention(*args, max_query_len=max(query_lens), k_scale=ks, v_scale=vs)
    ref = prefill_attention_ref(*args, k_scale=ks, v_scale=vs)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _i8_to_f16_emulated(b: np.ndarray) -> np.ndarray:
    """``decode_attention.I8_TO_F16_PTX`` step by step on the host: the bytes' sign bits flipped
    (one xor for four), each byte under fp16's exponent of 1024 (``prmt`` with 0x64), then the
    fp16 subtract of 1152 (rounded to nearest, as ``sub.rn.f16x2``)."""
    flipped = (b.view(np.uint8) ^ 0x80).astype(np.uint16)
    halves = (0x64 << 8) | flipped  # the prmt's 16-bit halves
    return (halves.view(np.float16).astype(np.float32) - np.float32(1152)).astype(np.float16)


def test_int8_to_fp16_widening_is_exact() -> None:
    """The int8 -> fp16 bit trick of the decode kernel over 1-byte pages gives every int8 value
    exactly (the PTX itself runs on the GPU: ``scripts/gpu_kvf16.py`` checks it there)."""
    from roofline.kernels import decode_attention as da

    assert "0x64646464" in da.I8_TO_F16_PTX.value and "0x64806480" in da.I8_TO_F16_PTX.value
    b = np.arange(-128, 128, dtype=np.int8)
    assert np.array_equal(_i8_to_f16_emulated(b).astype(np.int32), b.astype(np.int32))
    # the prmt selectors put bytes 0, 1 (0x4140) and 2, 3 (0x4342) of the word into the halves
    word = np.array([0x04030201], dtype=np.uint32).view(np.uint8)
    lo, hi = word[[0, 1]], word[[2, 3]]
    assert list(lo) == [1, 2] and list(hi) == [3, 4]


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
@pytest.mark.parametrize("v_mul", [1.0, 1e-3, 1e3])
def test_decode_attention_fp16_widening(page_dtype, v_mul, monkeypatch) -> None:
    """1-byte pages widened to fp16 (``KV_F16``, q bf16) against the path through fp32 and the
    reference over the same pages, with V scaled so far down and up that unnormalised
    probability x scale products would leave fp16's range; q beyond fp16's range is clamped."""
    from roofline.kernels import decode_attention as da

    context_lens = [0, 37, 130, 5]
    batch, kq, _, ks, _ = _quantized_batch(page_dtype, [1] * 4, context_lens, torch.bfloat16)
    vq, vs = quantize(batch.v_cache * v_mul, page_dtype)
    q = batch.q.clone()
    args = (q, kq, vq, batch.block_table, batch.seq_lens, 0.125)
    ref = decode_attention_ref(*args, k_scale=ks, v_scale=vs).float()
    outs = {}
    for f16 in (False, True):
        monkeypatch.setattr(da, "KV_F16", f16)
        for splits in (1, 3):
            out = decode_attention(*args, num_splits=splits, k_scale=ks, v_scale=vs).float()
            torch.testing.assert_close(out, ref, atol=2e-2 * v_mul, rtol=2e-2)
            outs[f16, splits] = out
    # fp16 products keep more of q and p than bf16 ones: no further from the reference
    err = {f: (outs[f, 1] - ref).abs().max().item() for f in (False, True)}
    assert err[True] <= err[False] * 1.5 + 1e-6 * v_mul, err
    q[0, 0, 0] = 1e6  # past fp16: clamped, not inf
    out = decode_attention(*args, num_splits=1, k_scale=ks, v_scale=vs)
    assert torch.isfinite(out.float()).all()


def hopper_report() -> dict:
    """sm_90 builds of the attention kernels over 1-byte pages as the H100 runs them, compiled in
    a process without TRITON_INTERPRET: for decode (``KV_F16``, anchored widening, int8 through
    ``I8_TO_F16_PTX``, ``_pick_quant_config``) page dtype -> (registers, spill bytes, LDS.U8
    count); for the paged prefill kernel at ``_pick_config``'s 128 x 128 tiles "prefill " +
    page dtype -> (registers, spill bytes, four-byte LDGSTS copies)."""
    from sm90_inspect import compile_sm90, ptxas_usage, sass_lines

    from roofline.kernels import decode_attention as da
    from roofline.kernels import prefill_attention as pa

    def opcodes(kernel) -> list[str]:
        return [next(w for w in ins.split() if not w.startswith("@"))
                for _, ins in sass_lines(kernel)]  # fmt: skip

    report = {}
    for page_dtype in ("fp8e4nv", "i8"):
        ptrs = dict(q_ptr="*bf16", k_cache_ptr=f"*{page_dtype}", v_cache_ptr=f"*{page_dtype}",
                    k_scale_ptr="*fp32", v_scale_ptr="*fp32", block_table_ptr="*i32",
                    seq_lens_ptr="*i32", out_ptr="*bf16", scale_log2e="fp32")  # fmt: skip
        block_n, num_warps, num_stages = da._pick_quant_config(128)
        const = dict(NUM_HEADS=32, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=16,
                     BLOCK_D=128, BLOCK_N=block_n, SINGLE_SPLIT=False, PRECISION="tf32",
                     KV_QUANT=True, HAS_START=False, MERGE_PREFIX=False, PDL=True, KV_F16=True,
                     KV_ANCHOR=True, KV_I8_ASM=page_dtype == "i8", DEVICE_SPLIT=True,
                     MIN_SPLIT=128)  # fmt: skip
        fn = da._decode_split_kernel
        sig = {n: ptrs.get(n, "i32") for n in fn.arg_names if n not in const}
        sig.update(ctx_start_ptr="*i32", part_out_ptr="*fp32", part_lse_ptr="*fp32")
        strides = tuple(n for n in fn.arg_names if n.startswith("stride_"))
        kernel = compile_sm90(fn, sig, const, num_warps, strides, num_stages)
        report[page_dtype] = (*ptxas_usage(kernel), opcodes(kernel).count("LDS.U8"))

        block_m, block_n, num_warps, num_stages = pa._pick_config(torch.bfloat16, 128, 2048)
        const = dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_M=block_m, BLOCK_N=block_n,
                     BLOCK_D=128, PRECISION="tf32", KV_QUANT=True, HEADS_FAST=False)  # fmt: skip
        fn = pa._prefill_kernel
        sig = {n: ptrs.get(n, "i32") for n in fn.arg_names if n not in const}
        sig["query_start_loc_ptr"] = "*i32"
        strides = tuple(n for n in fn.arg_names if n.startswith("stride_"))
        kernel = compile_sm90(fn, sig, const, num_warps, strides, num_stages)
        # (16-byte copies are LDGSTS.E.BYPASS.128)
        report["prefill " + page_dtype] = (*ptxas_usage(kernel), opcodes(kernel).count("LDGSTS.E"))

        from roofline.kernels import verify_attention as va  # 4 rows a request (1 + 3 drafts)

        block_n, num_warps, num_stages = da._pick_config(128)
        const = dict(NUM_HEADS=32, GROUP=4, QUERY_LEN=4, HEAD_DIM=128, PAGE_SIZE=16,
                     BLOCK_M=16, BLOCK_D=128, BLOCK_N=block_n, SINGLE_SPLIT=False,
                     PRECISION="tf32", KV_QUANT=True, KV_F16=True,
                     KV_I8_ASM=page_dtype == "i8")  # fmt: skip
        fn = va._verify_split_kernel
        sig = {n: ptrs.get(n, "i32") for n in fn.arg_names if n not in const}
        sig.update(part_out_ptr="*fp32", part_lse_ptr="*fp32")
        strides = tuple(n for n in fn.arg_names if n.startswith("stride_"))
        kernel = compile_sm90(fn, sig, const, num_warps, strides, num_stages)
        report["verify " + page_dtype] = (*ptxas_usage(kernel), opcodes(kernel).count("LDS.U8"))
    return report


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU compiles the kernel itself")
def test_attention_over_1_byte_pages_sm90() -> None:
    """The decode kernel over 1-byte pages as the H100 runs it keeps three programs an SM (at
    most 168 registers, no spills), and reads no single bytes from shared memory (``LDS.U8``:
    widening in the MMA operand's layout, which the anchor avoids; the path through fp32 read
    128 a tile and took 228 registers); the prefill kernel's scale loads stay compact."""
    from sm90_inspect import report_in_subprocess

    pytest.importorskip("triton.backends.nvidia.compiler")
    report = report_in_subprocess("test_kv_quant")
    for page_dtype in ("fp8e4nv", "i8"):
        regs, spills, lds_u8 = report[page_dtype]
        assert 0 < regs <= 168 and spills == 0 and lds_u8 == 0, (page_dtype, report)
        # prefill: the scales loaded per key row, not replicated into the MMA layout (472
        # four-byte copies a build and 180 bytes of spills with the scales on the columns)
        regs, spills, scalar_copies = report["prefill " + page_dtype]
        assert spills <= 64 and scalar_copies <= 64, (page_dtype, report)
        regs, spills, lds_u8 = report["verify " + page_dtype]  # (speculative verification)
        assert spills == 0 and lds_u8 == 0, (page_dtype, report)
