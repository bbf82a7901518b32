"""The mixed-input GEMM (``kernels.mixed_gemm``) against dequantize-then-matmul for every canonical
layout (int8 per channel and grouped, int4 with offsets in groups of 32 / 64 / 128, fp8 per
channel and per tensor), with bias, odd row counts, split-K, grouped tile orders and several tile
shapes; the fp8 x fp8 path against the W8A8 reference; the config choice; and (on any machine
with Triton's ptxas) that the kernels compile for Hopper with the weight as wgmma's register
operand and without spills."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels import mixed_gemm as mg
from roofline.kernels.mixed_gemm import MixedGemmConfig, fp8_scaled_gemm, mixed_gemm
from roofline.quantization import formats
from roofline.quantization.fp8 import w8a8_ref

N, K = (4096, 4096) if ON_GPU else (80, 256)


def _weight(kind: str, group: int, seed: int = 0, symmetric: bool = False):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) / K**0.5
    if kind == "int8":
        q = formats.quantize_int8(w, group, torch.bfloat16)
        return q.qweight.to(DEVICE), q.scales.to(DEVICE), None
    if kind == "int4":
        q = formats.quantize_int4(w, group, symmetric, scale_dtype=torch.float16)
        return q.qweight.to(DEVICE), q.scales.to(DEVICE), q.offsets.to(DEVICE)
    q, s = formats.quantize_fp8(w, per_channel=group != 0)
    return q.to(DEVICE), s.to(DEVICE), None


def _x(m: int, dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, K, generator=gen).to(dtype).to(DEVICE)


CASES = [
    ("int8", K),
    ("int8", 32),
    ("int8", 128),
    ("int4", 32),
    ("int4", 64),
    ("int4", 128),
    ("fp8", K),
    ("fp8", 0),
]
CONFIGS = [
    None,  # the heuristic
    MixedGemmConfig(16, 64, 64, 1, 1, 4, 2),
    MixedGemmConfig(32, 64, 128, 2, 2, 4, 3),  # split-K: partial sums + the reduce launch
    MixedGemmConfig(64, 128, 64, 2, 1, 4, 2),
]


@pytest.mark.parametrize("kind,group", CASES)
@pytest.mark.parametrize("config", CONFIGS)
def test_mixed_gemm_matches_dequantize_then_matmul(kind: str, group: int, config) -> None:
    qweight, scales, offsets = _weight(kind, group)
    x = _x(37)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    bias = bias.to(DEVICE)
    expected = mg.mixed_gemm_ref(kind, x, qweight, scales, offsets, bias)
    got = mixed_gemm(kind, x, qweight, scales, offsets, bias, config=config)
    assert got.shape == (37, N) and got.dtype == torch.bfloat16
    assert_close(got, expected, torch.bfloat16)


@pytest.mark.parametrize(
    "kind,group,config",
    [
        ("int8", K, MixedGemmConfig(32, 128, 32, 8, 3, 4, 2)),  # 8 K tiles in 3 slices: 3/3/2
        ("int4", 128, MixedGemmConfig(16, 256, 64, 8, 3, 8, 2)),  # a 256-row weight tile
        ("fp8", K, MixedGemmConfig(64, 256, 64, 8, 5, 16, 2)),  # 16 warps; 5 slices > 4 tiles: 4
        ("int8", 128, MixedGemmConfig(64, 128, 64, 8, 3, 4, 2, 1)),  # weight as B operand
        ("int4", 64, MixedGemmConfig(64, 256, 64, 8, 2, 8, 2, 1)),
        ("fp8", K, MixedGemmConfig(32, 256, 64, 8, 1, 4, 2, 1)),
        ("int4", 128, MixedGemmConfig(32, 64, 64, 8, 2, 4, 2, 2)),  # a fresh MMA chain per tile
        ("int8", K, MixedGemmConfig(16, 64, 128, 8, 1, 4, 2, 2)),
    ],
)
def test_mixed_gemm_uneven_split_k_and_wide_weight_tiles(kind: str, group: int, config) -> None:
    """Split-K into a count that does not divide the K tiles (slices differ by one tile) and
    weight tiles of 256 rows (fewer re-reads of x per weight byte)."""
    qweight, scales, offsets = _weight(kind, group, seed=9)
    x = _x(41)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    bias = bias.to(DEVICE)
    expected = mg.mixed_gemm_ref(kind, x, qweight, scales, offsets, bias)
    got = mixed_gemm(kind, x, qweight, scales, offsets, bias, config=config)
    assert_close(got, expected, torch.bfloat16)


@pytest.mark.parametrize("m", [17, 70])
def test_mixed_gemm_fp16_symmetric_int4_several_row_blocks(m: int) -> None:
    qweight, scales, offsets = _weight("int4", 128, seed=3, symmetric=True)
    x = _x(m, torch.float16)
    expected = mg.mixed_gemm_ref("int4", x, qweight, scales, offsets)
    config = MixedGemmConfig(16, 64, 128, 2, 1, 4, 2)  # several row blocks, grouped order
    got = mixed_gemm("int4", x, qweight, scales, offsets, config=config)
    assert got.dtype == torch.float16
    assert_close(got, expected, torch.float16)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize(
    "config", [CONFIGS[1], CONFIGS[2], MixedGemmConfig(64, 128, 64, 8, 2, 4, 2, 1)]
)
def test_fp8_scaled_gemm_matches_w8a8_reference(per_channel: bool, config) -> None:
    qweight, scales, _ = _weight("fp8", K if per_channel else 0, seed=4)
    x = _x(33) * 3
    bias = torch.randn(N, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    bias = bias.to(DEVICE)
    xq, x_scales = formats.quantize_fp8_per_token(x)  # torch's rounding (the interpreter's differs)
    got = fp8_scaled_gemm(xq, x_scales, qweight, scales, bias, torch.bfloat16, config=config)
    assert_close(got, w8a8_ref(x, qweight, scales, bias), torch.bfloat16)


def test_config_choice_and_validation() -> None:
    assert [mg.m_bucket(m) for m in (5, 17, 32, 33, 200, 300, 5000, 9000)] == [
        16, 32, 32, 64, 256, 512, 8192, 8192,
    ]  # fmt: skip
    cpu = torch.device("cpu")
    old = dict(mg.TUNED_CONFIGS)
    try:
        mg.TUNED_CONFIGS.clear()
        key = ("int8", 4096, 4096, 64)
        mg.TUNED_CONFIGS[key] = None
        assert mg.pick_config("int8", 50, 4096, 4096, cpu) is None
        mg.TUNED_CONFIGS[key] = (64, 128, 64, 8, 2, 4, 4)
        assert mg.pick_config("int8", 50, 4096, 4096, cpu) == MixedGemmConfig(
            64, 128, 64, 8, 2, 4, 4
        )
        # buckets not measured take the nearest measured one of the same shape up to
        # MIXED_MAX_ROWS; beyond it the library GEMM unless the bucket itself is in the table
        assert mg.pick_config("int8", 100, 4096, 4096, cpu).split_k == 2
        assert mg.pick_config("int8", 1500, 4096, 4096, cpu) is None
        mg.TUNED_CONFIGS[("int8", 4096, 4096, 2048)] = (128, 128, 128, 8, 1, 8, 3)
        assert mg.pick_config("int8", 1500, 4096, 4096, cpu).block_m == 128
        assert mg.pick_config("int8", 9000, 4096, 4096, cpu) is None
        assert mg.pick_config("int8", 50, 4096, 14336, cpu) is not None  # the heuristic
        assert mg.pick_config("w8a8", 4096, 4096, 4096, cpu) is None  # torch._scaled_mm
        small = mg.pick_config("w8a8", 32, 4096, 4096, cpu)
        assert small is not None and small.split_k > 1  # 32 tiles on 132 SMs: K is split
    finally:
        mg.TUNED_CONFIGS.clear()
        mg.TUNED_CONFIGS.update(old)
    # every shipped config is valid for its shape, and none with a 16-bit x feeds wgmma from
    # registers pipelined across K tiles (the ptxas 12.8 race that gave wrong results on the
    # H100); the heuristic is race-free too
    for (kind, n, k, bucket), cfg in mg.TUNED_CONFIGS.items():
        if cfg is not None:
            c = MixedGemmConfig(*cfg)
            assert mg.check_config(k, 128 if kind == "int4" else k, c) == c
            assert kind == "w8a8" or c.mode != mg.MODE_REG, (kind, n, k, bucket)
    for m in (17, 100, 300):
        assert mg.heuristic_config("int4", m, 4096, 4096, 132).mode != mg.MODE_REG
    # a tile that would straddle groups of 32 shrinks; split-K shrinks to whole tiles
    cfg = mg.check_config(96 * 4, 32, MixedGemmConfig(32, 64, 128, 8, 8, 4, 3))
    assert cfg.block_k == 128 and cfg.split_k == 3  # one slice per K tile at most
    cfg = mg.check_config(4096, 4096, MixedGemmConfig(32, 64, 128, 8, 4, 4, 3))
    assert cfg.split_k == 4
    cfg = mg.check_config(384, 128, MixedGemmConfig(32, 64, 256, 8, 1, 4, 3))
    assert cfg.block_k == 128  # 256 holds whole groups but does not divide K
    assert mg.check_config(4128, 4128, MixedGemmConfig(32, 64, 128, 8, 1, 4, 3)).block_k == 32
    with pytest.raises(ValueError, match="does not match"):
        qweight, scales, _ = _weight("int8", K)
        mixed_gemm("int8", _x(20)[:, :-32], qweight, scales)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        mixed_gemm("int8", _x(20, torch.float32), qweight, scales)
    assert not mg.supports("int8", _x(20, torch.float32), qweight, scales)
    assert mg.supports("int8", _x(20), qweight, scales)


def _hopper_kernel(kind: int, group: int, row_scale: bool, cfg: MixedGemmConfig, w8a8: bool):
    from sm90_inspect import compile_sm90

    q_type = {0: "*i8", 1: "*u8", 2: "*fp8e4nv"}[kind]
    signature = {
        "x_ptr": "*fp8e4nv" if w8a8 else "*bf16", "xs_ptr": "*fp32", "q_ptr": q_type,
        "s_ptr": "*fp32" if kind == 2 else "*bf16", "o_ptr": "*bf16", "bias_ptr": "*bf16",
        "out_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32",
        "K": "i32",
        "stride_xm": "i32", "stride_qn": "i32", "stride_s": "i32", "stride_om": "i32",
        "SPLIT_K": "i32",
    }  # fmt: skip
    constexprs = dict(
        KIND=kind, GROUP=group, ROW_SCALE=row_scale, SCALAR_SCALE=False, HAS_BIAS=True,
        X_SCALE=w8a8, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SPLIT=cfg.split_k > 1, FIXUP=cfg.split_k > 1,
        NUM_STAGES=cfg.num_stages, FAST_FP8=True, MODE=cfg.mode,
    )  # fmt: skip
    divisible = ("N", "K", "stride_xm", "stride_qn", "stride_om")
    return compile_sm90(mg._mixed_gemm_kernel, signature, constexprs, cfg.num_warps, divisible)


HOPPER_CASES = [  # (kind, group, row_scale, config, w8a8, expected wgmma operand types)
    (0, 0, True, MixedGemmConfig(32, 128, 128, 8, 1, 4, 4, 2), False, "bf16.bf16"),
    (1, 128, False, MixedGemmConfig(128, 64, 128, 8, 1, 4, 3, 2), False, "bf16.bf16"),
    (1, 32, False, MixedGemmConfig(64, 128, 128, 8, 4, 8, 4, 2), False, "bf16.bf16"),
    (1, 128, False, MixedGemmConfig(32, 64, 256, 8, 4, 4, 3, 2), False, "bf16.bf16"),
    (2, 0, True, MixedGemmConfig(64, 128, 128, 8, 2, 8, 4, 2), False, "bf16.bf16"),
    (2, 0, True, MixedGemmConfig(128, 128, 128, 8, 1, 8, 4), True, "e4m3.e4m3"),
    (2, 0, True, MixedGemmConfig(128, 256, 64, 8, 2, 8, 3, 1), True, "e4m3.e4m3"),
    (0, 0, True, MixedGemmConfig(128, 256, 64, 8, 1, 8, 3, 1), False, "bf16.bf16"),
    (1, 128, False, MixedGemmConfig(64, 256, 64, 8, 1, 4, 4, 1), False, "bf16.bf16"),
]
RACY_CASE = (1, 128, False, MixedGemmConfig(128, 128, 64, 8, 1, 8, 3, mg.MODE_REG), False)
"""The register-operand form pipelined across K tiles: ptxas 12.8 reuses A registers of MMAs
still in flight (the H100 gave wrong results for this tile); the SASS check must flag it."""


def hopper_report() -> list[dict]:
    """Compile HOPPER_CASES (then RACY_CASE) for sm_90 (run in a process without
    TRITON_INTERPRET, where the kernels are compiled functions) and report what the PTX,
    ptxas and the SASS say."""
    from sm90_inspect import ptxas_usage, register_a_hazards, uses_register_a, wgmma_forms

    report = []
    for kind, group, row_scale, cfg, w8a8 in [c[:5] for c in HOPPER_CASES] + [RACY_CASE]:
        kernel = _hopper_kernel(kind, group, row_scale, cfg, w8a8)
        registers, spilled = ptxas_usage(kernel)
        report.append({
            "forms": wgmma_forms(kernel), "register_a": uses_register_a(kernel),
            "pipelined": "cp.async" in kernel.asm["ptx"], "registers": registers,
            "spilled": spilled, "hazards": register_a_hazards(kernel),
        })  # fmt: skip
    return report


@pytest.mark.skipif(ON_GPU, reason="the GPU compiles the kernels itself in the tests above")
def test_kernels_compile_for_hopper_without_register_races() -> None:
    """Code the interpreter accepts but the GPU compiler rejects fails here; so does a config
    whose SASS overwrites a wgmma A register before that MMA has been waited for."""
    from sm90_inspect import report_in_subprocess

    pytest.importorskip("triton.backends.nvidia.compiler")
    *report, racy = report_in_subprocess("test_mixed_gemm")
    for (*_, cfg, w8a8, types), got in zip(HOPPER_CASES, report, strict=True):
        assert got["forms"] and all(f.endswith(types) for f in got["forms"]), got
        # dequantized weights feed wgmma from registers, or (MODE_SMEM) from shared memory
        assert got["register_a"] == (not w8a8 and cfg.mode != mg.MODE_SMEM), got
        assert got["pipelined"], got  # the K loop copies tiles ahead with cp.async
        assert 0 < got["registers"] <= 255 and got["spilled"] == 0, got
        assert got["hazards"] == [], got
    assert racy["register_a"] and racy["hazards"], racy  # the check finds the known race


@pytest.mark.parametrize("m,inter", [(3, 96), (5, 2048 + 64), (2, 16384 + 32)])
def test_silu_mul_fp8_quantization_equals_the_two_kernels(m: int, inter: int) -> None:
    """One launch computes silu(gate) * up and quantizes it per token: the same quotients and
    scales as ``silu_and_mul`` followed by ``quantize_fp8_per_token`` (fp32 quotients: the
    interpreter's fp8 rounding is not the hardware's), and torch's values within rounding."""
    from roofline.kernels.activation import silu_and_mul, silu_and_mul_ref
    from roofline.kernels.fp8_quant import (
        quantize_fp8_per_token,
        silu_mul_quantize_fp8_per_token,
    )

    gen = torch.Generator().manual_seed(6)
    gate_up = (torch.randn(m, 2 * inter, generator=gen) * 4).to(torch.bfloat16).to(DEVICE)
    fused_q, fused_s = silu_mul_quantize_fp8_per_token(gate_up, torch.float32, kernel="rows")
    two_q, two_s = quantize_fp8_per_token(silu_and_mul(gate_up), out_dtype=torch.float32)
    assert fused_q.shape == (m, inter) and fused_s.shape == (m, 1)
    assert torch.equal(fused_s, two_s) and torch.equal(fused_q, two_q)
    act = silu_and_mul_ref(gate_up.float()).to(torch.bfloat16).float()
    ref_s = (act.abs().amax(dim=1, keepdim=True) / formats.FP8_MAX).clamp_min(1e-12)
    torch.testing.assert_close(fused_s, ref_s, rtol=1e-2, atol=0)
    torch.testing.assert_close(fused_q * fused_s, act, rtol=2e-2, atol=1e-2)
    with pytest.raises(ValueError, match="gate and up"):
        silu_mul_quantize_fp8_per_token(gate_up[:, 1:].contiguous())


@pytest.mark.parametrize("kind,group", [("int8", 160), ("int4", 32), ("fp8", 160)])
def test_mixed_gemm_k_not_a_multiple_of_the_tile(kind: str, group: int) -> None:
    """K = 160: the tile shrinks to 32 elements (5 steps), split-K to whole tiles."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(48, 160, generator=gen) / 13
    if kind == "int8":
        q = formats.quantize_int8(w, group, torch.bfloat16)
        qweight, scales, offsets = q.qweight, q.scales, None
    elif kind == "int4":
        qweight, scales, offsets = formats.quantize_int4(w, group, False, torch.bfloat16)
    else:
        (qweight, scales), offsets = formats.quantize_fp8(w), None
    qweight, scales = qweight.to(DEVICE), scales.to(DEVICE)
    offsets = offsets.to(DEVICE) if offsets is not None else None
    x = torch.randn(19, 160, generator=gen).to(torch.bfloat16).to(DEVICE)
    assert mg.supports(kind, x, qweight, scales)
    config = MixedGemmConfig(16, 64, 128, 8, 4, 4, 2)
    got = mixed_gemm(kind, x, qweight, scales, offsets, config=config)
    assert_close(got, mg.mixed_gemm_ref(kind, x, qweight, scales, offsets), torch.bfloat16)
