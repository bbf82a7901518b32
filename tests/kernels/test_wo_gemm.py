"""The Hopper weight-only GEMM (``kernels.wo_gemm``, Gluon: no interpreter, so its numbers are
checked on the GPU by ``scripts/gpu_wonly.py``): here, the int8 -> bf16 widening PTX executed by a
small emulator over every pair of int8 values, the layout checks and the config table, and (with
Triton's ptxas, on any machine) that every shipped config and a few representative ones compile
for sm_90 with the weight as wgmma's register operand, TMA loads, no spills and no
register-operand race in the SASS."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from kernel_utils import ON_GPU

from roofline.kernels import wo_gemm as wg
from roofline.quantization import formats


def _run_ptx(asm: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute the straight-line PTX of an inline-asm block (the instructions the widening
    uses) on uint32 arrays; ``$n`` operands come from / go to ``inputs``."""
    regs = {k: v.astype(np.uint32) for k, v in inputs.items()}

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok.startswith("0f"):
            return np.full_like(next(iter(regs.values())), int(tok[2:], 16))
        if tok.startswith("0x") or tok.isdigit():
            return np.full_like(next(iter(regs.values())), int(tok, 0))
        return regs[tok]

    def as_f32(a: np.ndarray) -> np.ndarray:
        return a.view(np.float32)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in srcs]
        if op == "cvt.u32.u16":
            out = a[0] & 0xFFFF
        elif op == "xor.b32":
            out = a[0] ^ a[1]
        elif op == "sub.f32":
            out = (as_f32(a[0]) - as_f32(a[1])).view(np.uint32)
        elif op == "mov.b32":
            out = a[0]
        elif op == "shl.b32":
            out = a[0] << a[1]
        elif op == "and.b32":
            out = a[0] & a[1]
        elif op == "or.b32":
            out = a[0] | a[1]
        elif op == "cvt.rn.f16x2.e4m3x2":  # the low byte into the low half
            b = torch.from_numpy((a[0] & 0xFFFF).astype(np.uint16).view(np.uint8).copy())
            h = b.view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16).numpy()
            h = h.view(np.uint16).astype(np.uint32).reshape(-1, 2)
            out = h[:, 0] | (h[:, 1] << 16)
        elif op == "shr.u32":
            out = a[0] >> a[1]
        elif op == "lop3.b32":  # only the (a & b) | c table the widenings use
            assert int(a[3][0]) == 0xEA, line
            out = (a[0] & a[1]) | a[2]
        elif op.split(".")[0] in ("sub", "mul", "fma") and op.endswith("16x2"):
            # each half (bf16 or fp16) exact in float64, rounded once to its type: the
            # references round an exact fp32 value (asserted for sub and fma; a product of two
            # 16-bit values is exact in fp32)
            dtype = torch.bfloat16 if op.endswith("bf16x2") else torch.float16
            halves = []
            for shift in (0, 16):
                h = [torch.from_numpy(((v >> shift) & 0xFFFF).astype(np.int16)) for v in a]
                f = [t.view(dtype).double().numpy() for t in h]
                if op.startswith("sub"):
                    exact = f[0] - f[1]
                elif op.startswith("mul"):
                    exact = f[0] * f[1]
                else:
                    exact = f[0] * f[1] + f[2]
                assert np.array_equal(exact.astype(np.float32).astype(np.float64), exact), line
                res = torch.from_numpy(exact.astype(np.float32)).to(dtype)
                halves.append(
                    res.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << shift
                )
            out = halves[0] | halves[1]
        elif op == "prmt.b32":
            both = np.stack([(a[j] >> (8 * i)) & 0xFF for j in (0, 1) for i in range(4)])
            out = np.zeros_like(a[0])
            for i in range(4):
                sel = (a[2] >> (4 * i)) & 0x7
                out |= np.take_along_axis(both, sel[None, :].astype(np.int64), 0)[0] << (8 * i)
        else:
            raise AssertionError(f"instruction {op} not emulated")
        regs[dst] = out.astype(np.uint32)
    return regs


def _halves(out: np.ndarray, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The low and high 16-bit halves of ``out`` (uint32) read as ``dtype``, in fp32."""

    def half(bits: np.ndarray) -> np.ndarray:
        t = torch.from_numpy((bits & 0xFFFF).astype(np.uint16).view(np.int16))
        return t.view(dtype).float().numpy()

    return half(out), half(out >> 16)


@pytest.mark.parametrize("name", ["INT8_TO_BF16_PTX", "INT8_TO_F16_PTX"])
def test_int8_widening_ptx_is_exact_for_every_pair(name: str) -> None:
    pairs = np.arange(1 << 16, dtype=np.uint32)  # two int8 in the low 16 bits
    asm = re.sub(r"\$(\d)", r"R\1", getattr(wg, name).value)
    out = _run_ptx(asm, {"R1": pairs})["R0"]
    lo, hi = _halves(out, torch.float16 if name.endswith("_F16_PTX") else torch.bfloat16)
    q = pairs.astype(np.uint16).view(np.int8).reshape(-1, 2).astype(np.float32)
    assert np.array_equal(lo, q[:, 0]) and np.array_equal(hi, q[:, 1])


@pytest.mark.parametrize("name", ["FP8_TO_BF16_PTX", "FP8_TO_F16_PTX"])
def test_fp8_widening_ptx_is_exact_for_every_pair(name: str) -> None:
    pairs = np.arange(1 << 16, dtype=np.uint32)  # two e4m3 bytes in the low 16 bits
    asm = re.sub(r"\$(\d)", r"R\1", getattr(wg, name).value)
    out = _run_ptx(asm, {"R1": pairs})["R0"]
    lo, hi = _halves(out, torch.float16 if name.endswith("_F16_PTX") else torch.bfloat16)
    b = torch.from_numpy(pairs.astype(np.uint16).view(np.uint8).copy())
    want = b.view(torch.float8_e4m3fn).float().numpy().reshape(-1, 2)
    ok = ~np.isnan(want).any(axis=1)  # 0x7F / 0xFF: NaN, never a quantized weight
    assert ok.sum() == 254 * 254
    assert np.array_equal(lo[ok], want[ok, 0]) and np.array_equal(hi[ok], want[ok, 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_int4_widening_ptx_matches_the_reference(dtype: torch.dtype, symmetric: bool) -> None:
    """``INT4_{ASYM,SYM}_TO_{BF16,F16}_PTX`` over every byte value, with the scales and offsets
    RTN, GPTQ and AWQ give (``-z s`` rounded to the 16-bit dtype, z in 0..15; 8 when
    symmetric), scales over six orders of magnitude (fp16: over four, inside its normal range):
    the same bits as ``formats.dequantize_int4`` (fp32, then the 16-bit dtype)."""
    gen = torch.Generator().manual_seed(0)
    n = 4096
    low = -20 if dtype == torch.bfloat16 else -12
    scales = torch.rand(n, generator=gen) * 2.0 ** torch.randint(low, 0, (n,), generator=gen)
    scales = scales.to(dtype)
    zeros = torch.randint(0, 16, (n,), generator=gen).float()
    if symmetric:
        zeros.fill_(8.0)
    offsets = (-zeros * scales.float()).to(dtype)
    byte = torch.arange(n) % 256  # each byte value with 16 scales
    pairs = byte.view(-1, 2)  # two bytes (rows) a register, each with its row's constants
    s2, o2 = scales.view(-1, 2), offsets.view(-1, 2)

    def u32(t: torch.Tensor) -> np.ndarray:  # [n / 2, 2] 16-bit halves -> one uint32 each
        v = t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
        return v[:, 0] | (v[:, 1] << 16)

    half = "BF16" if dtype == torch.bfloat16 else "F16"
    name = f"INT4_{'SYM' if symmetric else 'ASYM'}_TO_{half}_PTX"
    asm = re.sub(r"\$(\d)", r"R\1", getattr(wg, name).value)
    regs = _run_ptx(
        asm, {"R2": (pairs[:, 0] | (pairs[:, 1] << 8)).numpy(), "R3": u32(s2), "R4": u32(o2)}
    )  # fmt: skip (the symmetric PTX does not read R4)
    got_lo, got_hi = regs["R0"], regs["R1"]
    ref = formats.dequantize_int4(
        byte.to(torch.uint8).view(n, 1), scales.view(n, 1), offsets.view(n, 1), dtype
    )  # [n, 2]: low, high nibble
    want_lo, want_hi = u32(ref[:, 0].reshape(-1, 2)), u32(ref[:, 1].reshape(-1, 2))
    assert (ref != 0).float().mean() > 0.9  # (scales of zero would prove nothing)
    assert np.array_equal(got_lo, want_lo) and np.array_equal(got_hi, want_hi)


def test_layout_checks() -> None:
    cfg = wg.WoConfig(128, 128, 64, 1, 4)
    w = torch.randn(256, 512)
    x = torch.randn(37, 512).to(torch.bfloat16)
    q8 = formats.quantize_int8(w, 512, torch.bfloat16)
    assert wg.fits("int8", x, q8.qweight, q8.scales, cfg)
    assert wg.fits("int8", x.half(), q8.qweight, q8.scales, cfg)  # bf16 or fp16 x
    assert not wg.fits("int8", x.float(), q8.qweight, q8.scales, cfg)
    assert not wg.fits("int8", x[:, 1:-63], q8.qweight, q8.scales, cfg)  # misaligned rows
    grouped = formats.quantize_int8(w, 128, torch.bfloat16)
    assert not wg.fits("int8", x, grouped.qweight, grouped.scales, cfg)  # per channel only
    q4 = formats.quantize_int4(w, 128, True, torch.bfloat16)
    assert wg.fits("int4", x, q4.qweight, q4.scales, cfg)
    assert not wg.fits("int4", x, q4.qweight, q4.scales, cfg._replace(block_k=256))
    q4_32 = formats.quantize_int4(w, 32, True, torch.bfloat16)  # groups inside a K tile
    assert not wg.fits("int4", x, q4_32.qweight, q4_32.scales, cfg)
    assert not wg.supports("int8", x, q8.qweight, q8.scales, cfg)  # not a GPU tensor
    q8f, s8f = formats.quantize_fp8(w)
    assert wg.fits("fp8", x, q8f, s8f, cfg)
    assert not wg.fits("fp8", x, q8.qweight, q8.scales, cfg)  # int8 bytes are not e4m3
    assert not wg.fits("int8", x, q8f, s8f, cfg)
    # the pipelined form takes K tiles two at a time: an even count in every split-K slice
    pipe = cfg._replace(ws=wg.PIPELINED, block_n=64)  # (any warpgroup count)
    assert wg.fits("int8", x, q8.qweight, q8.scales, pipe)  # 8 tiles
    assert wg.fits("int8", x, q8.qweight, q8.scales, pipe._replace(split_k=4))  # 2 a slice
    assert not wg.fits("int8", x, q8.qweight, q8.scales, pipe._replace(split_k=8))  # 1 a slice
    assert not wg.fits("int8", x, q8.qweight, q8.scales, pipe._replace(block_k=128, split_k=4))
    x3 = torch.randn(5, 192).to(torch.bfloat16)  # 3 tiles of 64
    q3 = formats.quantize_int8(torch.randn(256, 192), 192, torch.bfloat16)
    assert wg.fits("int8", x3, q3.qweight, q3.scales, cfg)
    assert not wg.fits("int8", x3, q3.qweight, q3.scales, pipe)
    assert not wg.fits("int8", x, q8.qweight, q8.scales, cfg._replace(ws=1, block_n=64))


def test_kind_follows_the_dtypes_of_x_and_the_constants() -> None:
    """Constants of x's dtype are widened in pairs of it (bf16x2 / f16x2), others in fp32;
    symmetric int4 (no offsets) needs scales of x's dtype."""
    pytest.importorskip("triton.experimental.gluon")
    cfg = wg.WoConfig(128, 128, 64, 1, 4)
    w = torch.randn(256, 512)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(64, 512).to(dtype)
        other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
        q4 = formats.quantize_int4(w, 128, False, dtype)
        q4o = formats.quantize_int4(w, 128, False, other)

        def code(q, offsets, x=x) -> int:
            return wg.kind_and_descriptors("t", "int4", x, q.qweight, q.scales, offsets, cfg)[0]

        assert code(q4, q4.offsets) == wg.KIND_INT4_HALF2
        assert code(q4o, q4o.offsets) == wg.KIND_INT4
        assert code(q4, None) == wg.KIND_INT4_SYM
        with pytest.raises(ValueError, match="symmetric int4"):
            code(q4o, None)


def test_scale_args() -> None:
    w = torch.randn(256, 512)
    q8 = formats.quantize_int8(w, 512, torch.bfloat16)
    s, o, b, stride_s, stride_g, group = wg.scale_args(wg.KIND_INT8, 512, q8.scales, None, None)
    assert s is q8.scales and o is q8.scales and b is q8.scales
    assert (stride_s, stride_g, group) == (1, 1, 0)
    q4 = formats.quantize_int4(w, 128, False, torch.bfloat16)
    offsets = q4.offsets.t().contiguous().t()  # another stride than the scales'
    bias = torch.randn(256)
    s, o, b, stride_s, stride_g, group = wg.scale_args(wg.KIND_INT4, 512, q4.scales, offsets, bias)
    assert s.stride() == o.stride() and torch.equal(o, q4.offsets) and b is bias
    assert (stride_s, stride_g, group) == (4, 1, 128)
    # both stored group-major ([K / group, N] in memory): passed as they are, a group's stride N
    scales = q4.scales.t().contiguous().t()
    s, o, _, stride_s, stride_g, group = wg.scale_args(wg.KIND_INT4, 512, scales, offsets, None)
    assert s is scales and o is offsets and (stride_s, stride_g, group) == (1, 256, 128)


def test_config_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from roofline.kernels import wo_gemm_configs

    table = {("int8", 6144, 4096, 256): (256, 128, 64, 2, 4)}
    monkeypatch.setattr(wo_gemm_configs, "WO_CONFIGS", table)
    ms = (17, 64, 65, 129, 256, 300, 385, 513, 769, 2048, 8192, 8193)
    assert [wg.m_bucket(m) for m in ms] == [32, 64, 128, 192, 256, 384, 512, 768, 1024, 2048,
                                            8192, 0]  # fmt: skip
    assert wg.pick("int8", 200, 6144, 4096) == wg.WoConfig(256, 128, 64, 2, 4)
    assert wg.pick("int8", 100, 6144, 4096) is None  # bucket 128 not measured
    assert wg.pick("int4", 200, 6144, 4096) is None


KINDS = {"int8": wg.KIND_INT8, "int4": wg.KIND_INT4_HALF2, "int4s": wg.KIND_INT4_SYM,
         "fp8": wg.KIND_FP8, "int4f": wg.KIND_INT4}  # fmt: skip
"""The table's kinds as the kernel runs them: ``int4`` (asymmetric, a bf16 model's RTN scales
and offsets) widened in bf16x2; ``int4f``: asymmetric with constants of another dtype than x's
(fp16 GPTQ / AWQ zero points in a bf16 model), widened in fp32. A ``-f16`` suffix: x, the
output and the constants in fp16 (a GPTQ / AWQ checkpoint saved in fp16, run in fp16), the
weight widened into fp16."""

REPRESENTATIVE = [  # (kind, config)
    ("int8", (256, 128, 64, 1, 4)),
    ("int4", (256, 128, 64, 2, 4)),
    ("int8", (128, 64, 128, 2, 4)),
    ("int4", (64, 64, 128, 4, 4)),
    ("int4s", (256, 128, 64, 1, 4)),  # symmetric int4: bf16x2 widening
    ("int8", (128, 256, 64, 1, 4)),  # 16 warps
    ("int8", (256, 128, 64, 1, 4, 8, 1)),  # warp-specialized
    ("int4", (128, 128, 128, 1, 4, 8, 1)),
    ("int4s", (64, 128, 128, 1, 4, 8, 1)),
    ("int8", (128, 128, 64, 1, 6, 8, 2)),  # stream-K
    ("int4", (64, 128, 128, 1, 4, 8, 2)),
    ("int4s", (256, 128, 64, 1, 4, 8, 2)),  # stream-K, two halves of x
    ("int8", (256, 64, 128, 1, 3, 8, 3)),  # pipelined: two K tiles' MMAs in flight
    ("int4", (128, 64, 128, 2, 4, 8, 3)),
    ("fp8", (64, 256, 128, 1, 4, 8, 3)),  # 16 warps
    ("int4s", (64, 64, 128, 4, 4, 8, 3)),  # one warpgroup
    ("fp8", (128, 64, 128, 1, 4)),  # e4m3 bytes widened by bit moves
    ("fp8", (256, 128, 64, 1, 4, 8, 1)),
    ("fp8", (128, 128, 128, 1, 4, 8, 2)),
    ("int4f", (256, 128, 64, 2, 4)),  # asymmetric int4 widened in fp32, each form
    ("int4f", (128, 128, 128, 1, 4, 8, 1)),
    ("int4f", (64, 128, 128, 1, 4, 8, 2)),
    ("int4f", (128, 64, 128, 2, 4, 8, 3)),
    # fp16 x: every kind widened into fp16, each form
    ("int8-f16", (256, 128, 64, 1, 4)),
    ("int4-f16", (256, 128, 64, 1, 4, 8, 1)),
    ("int4s-f16", (128, 64, 128, 1, 4, 8, 3)),
    ("fp8-f16", (128, 128, 128, 1, 4, 8, 2)),
    ("int4-f16", (128, 64, 128, 2, 4, 8, 3)),
    ("int4s-f16", (256, 128, 64, 1, 4, 8, 2)),
    ("int8-f16", (256, 64, 128, 1, 3, 8, 3)),
    ("fp8-f16", (256, 128, 64, 1, 4, 8, 1)),
    ("int4f-f16", (128, 128, 128, 1, 4, 8, 1)),
]


def _build(kind: str, cfg: wg.WoConfig, k: int = 4096, silu: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    f16 = kind.endswith("-f16")
    kind = kind.removesuffix("-f16")
    int4 = kind.startswith("int4")
    qk = cfg.block_k // 2 if int4 else cfg.block_k
    x = torch.empty(256, k, dtype=torch.float16 if f16 else torch.bfloat16)
    q = torch.empty(4096, qk * (k // cfg.block_k), dtype=torch.uint8 if int4 else torch.int8)
    x_type = gl.float16 if f16 else gl.bfloat16
    x_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], x_type)
    q_type = gl.uint8 if int4 else gl.int8
    q_rows = 64 if silu else cfg.block_n  # silu: one 64-row box per consumer
    q_layout = gl.NVMMASharedLayout.get_default_for([q_rows, qk], q_type)
    descs = [
        TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k], x_layout),
        TensorDescriptor.from_tensor(q, [q_rows, qk], q_layout),
    ]
    if cfg.ws == 2:
        from roofline.kernels import wo_gemm_sk

        fn = wo_gemm_sk._wo_sk_kernel
    elif cfg.ws == 1:
        from roofline.kernels import wo_gemm_ws

        fn = wo_gemm_ws._wo_ws_kernel
    else:
        fn = wg._wo_gemm_kernel
    names = list(fn.arg_names)
    types = dict(zip(("x_desc", "q_desc"), map(mangle_type, descs)))
    half = "*fp16" if f16 else "*bf16"  # constants, bias and output of x's dtype
    types.update({n: half for n in ("s_ptr", "o_ptr", "bias_ptr", "out_ptr")})
    types.update({"ws_ptr": "*fp32", "lock_ptr": "*i32"})
    types.update({n: "i32" for n in ("M", "N", "K", "stride_s", "stride_om", "dp_tiles")})
    signature = {n: types.get(n, "constexpr") for n in names}
    constexprs = dict(
        KIND=KINDS[kind], GROUP=128 if int4 else 0,
        HAS_BIAS=True,
        SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        STAGES=cfg.stages, GROUP_M=cfg.group_m, CONSUMER_REGS=224,
    )  # fmt: skip
    constexprs["stride_g"] = 1  # a group's stride in the canonical layout: specialized at run time
    if silu:
        constexprs["SILU"] = True
    if cfg.ws == wg.PIPELINED:
        constexprs["PIPE"] = True
    constexprs = {n: v for n, v in constexprs.items() if n in names}
    aligned = ("N", "K", "stride_om")
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n, t in signature.items()
        if t.startswith("*") or n in aligned
    }
    return triton.compile(
        GluonASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4 if cfg.ws in (1, 2) else cfg.block_n // 16},
    )


def hopper_report() -> list[dict]:
    """Compile the shipped configs and REPRESENTATIVE for sm_90 and report what ptxas and the
    SASS say (run in a process without TRITON_INTERPRET)."""
    from sm90_inspect import ptxas_usage, sass_lines, sass_register_a_hazards, uses_register_a

    cases = {(kind, tuple(cfg), False) for (kind, *_), cfg in wg.WO_CONFIGS.items()}
    cases |= {(kind, tuple(cfg), False) for kind, cfg in REPRESENTATIVE}
    # the warp-specialized configs also with the SiLU-and-mul epilogue (an MLP's gate_up)
    cases |= {(kind, cfg, True) for kind, cfg, _ in cases if wg.WoConfig(*cfg).ws == 1}
    cases |= {(kind, tuple(cfg), True) for (kind, *_), cfg in wg.WO_SILU_CONFIGS.items()}
    report = []
    for kind, cfg, silu in sorted(cases):
        kernel = _build(kind, wg.WoConfig(*cfg), silu=silu)
        registers, spilled = ptxas_usage(kernel)
        sass = sass_lines(kernel)  # (one disassembly for both SASS checks)
        report.append({
            "case": [kind, list(cfg), silu], "register_a": uses_register_a(kernel),
            "tma": "cp.async.bulk.tensor" in kernel.asm["ptx"], "registers": registers,
            "spilled": spilled, "hazards": sass_register_a_hazards(sass),
            "shared": kernel.metadata.shared,
            "in_flight": any("DEPBAR.LE gsb0, 0x1" in ins for _, ins in sass),
        })  # fmt: skip
    return report


@pytest.mark.skipif(ON_GPU, reason="the GPU script checks the shipped configs' numbers")
def test_configs_compile_for_hopper_without_register_races() -> None:
    from sm90_inspect import report_in_subprocess

    pytest.importorskip("triton.experimental.gluon")
    report = report_in_subprocess("test_wo_gemm")
    assert len(report) >= len(REPRESENTATIVE)
    for got in report:
        assert got["register_a"] and got["tma"], got
        assert 0 < got["registers"] <= 255 and got["spilled"] == 0, got
        assert got["hazards"] == [], got
        assert got["shared"] <= 227 << 10, got  # an H100 SM's shared memory per block
        # the pipelined form keeps a K tile's MMAs in flight (ptxas did not serialize them)
        assert got["in_flight"] == (wg.WoConfig(*got["case"][1]).ws == wg.PIPELINED), got
