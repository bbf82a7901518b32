"""The one-token MoE variants that ``scripts/gpu_moe6.py`` measures, default off: the down
projection with all k experts' rows in one program's tile (``fused_moe.WIDE_DOWN``,
``moe_down.moe_down_wide``) against the split down (within an ulp: the k rows summed in a tree)
and the reference, 16-bit and 8-bit experts, a not-local expert; the routing in the gate/up
GEMV with one copy of the logits a warp (``fused_moe.ROUTE_PER_WARP``) against the router's
routing; the sm_90 compiles (barriers, registers, spills)."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU
from test_moe_down import _layer

from roofline.kernels import fused_moe as fm
from roofline.kernels import moe_router as mr
from roofline.kernels.moe_down import moe_down_wide


@pytest.mark.parametrize("kind", ["bf16", "fp32", "int8", "fp8"])
@pytest.mark.parametrize("residual", [True, False])
def test_wide_down_matches_the_split_down(kind, residual, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(5)
    num_experts, inter, hidden = 8, 48, 40  # a ragged column block and K step
    w13, w2, scales = _layer(kind, num_experts, inter, hidden, gen)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    x = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE)
    h = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE) if residual else None
    layout = 0 if kind in ("bf16", "fp32") else 1
    monkeypatch.setitem(fm.SPLIT_DOWN, layout, True)
    for ids in ([[5, 2, 7]], [[1, num_experts, 3]]):  # the second: another rank's expert
        ids_t = torch.tensor(ids).to(DEVICE)
        weights = torch.tensor([[0.5, 0.3, 0.2]]).to(dtype).to(DEVICE)
        split = fm.fused_moe(x, w13, w2, weights, ids_t, residual=h, **scales)
        monkeypatch.setattr(fm, "WIDE_DOWN", True)
        wide = fm.fused_moe(x, w13, w2, weights, ids_t, residual=h, **scales)
        monkeypatch.setattr(fm, "WIDE_DOWN", False)
        ref = fm.fused_moe_ref(x, w13, w2, weights, ids_t, **scales)
        ref = ref if h is None else (h.float() + ref.float()).to(dtype)
        ulp = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(wide, split, atol=ulp, rtol=ulp)
        torch.testing.assert_close(wide.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_wide_down_tiles_and_bad_shapes() -> None:
    """Other tiles (8 rows, a K step past the end; 2 rows) give the default's result; a batch
    of two tokens is refused."""
    gen = torch.Generator().manual_seed(6)
    w13, w2, _ = _layer("fp32", 6, 40, 24, gen)
    act = torch.randn(4, 40, generator=gen).to(DEVICE)
    ids = torch.tensor([[0, 5, 3, 1]]).to(DEVICE)
    weights = torch.rand(1, 4, generator=gen).to(DEVICE)
    outs = [
        moe_down_wide(act, w2, weights, ids, torch.empty(1, 24, device=DEVICE), config=cfg)
        for cfg in (None, dict(BLOCK_N=8, BLOCK_K=64), dict(BLOCK_N=2, BLOCK_K=16))
    ]
    want = sum(weights[0, j] * (w2[ids[0, j]].float() @ act[j].float()) for j in range(4))
    for out in outs:
        torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one token"):
        moe_down_wide(act, w2, weights.expand(2, 4), ids.expand(2, 4),
                      torch.empty(2, 24, device=DEVICE))  # fmt: skip


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_per_warp_equals_the_router(dtype, renormalize, monkeypatch) -> None:
    """One copy of the logits a warp: the router's experts in its order, weights within an ulp
    of its weights, the block's output as the router-routed one's (to an ulp of a weight)."""
    monkeypatch.setattr(mr, "FORCE_PRELOAD", True)
    gen = torch.Generator().manual_seed(7)
    E, K, H, INTER = 16, 4, 64, 32
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(E, H, INTER, generator=gen) / INTER**0.5).to(dtype).to(DEVICE)
    router = torch.randn(E, H, generator=gen).to(dtype).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(H, generator=gen)).to(dtype).to(DEVICE)
    for _ in range(3):
        h = torch.randn(1, H, generator=gen).to(dtype).to(DEVICE)
        xn, weights, ids = mr.moe_router(h, nw, 1e-6, router, K, renormalize)
        want = fm.fused_moe(xn, w13, w2, weights, ids, residual=h)
        xn2, logits = mr.router_logits(h, nw, 1e-6, router)
        w2_, i2 = torch.empty_like(weights), torch.empty_like(ids)
        monkeypatch.setattr(fm, "ROUTE_PER_WARP", True)
        got = fm.fused_moe(xn2, w13, w2, w2_, i2, residual=h, route_logits=(logits, renormalize))
        monkeypatch.setattr(fm, "ROUTE_PER_WARP", False)
        assert torch.equal(i2, ids)
        ulp = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(w2_, weights, atol=ulp, rtol=ulp)
        torch.testing.assert_close(got, want, atol=2 * ulp, rtol=2 * ulp)


def hopper_report() -> dict:
    """sm_90 at Qwen3-30B-A3B's shapes (128 experts, top 8, bf16), compiled in a process
    without TRITON_INTERPRET: barriers, registers and spills of the gate/up GEMV routing one
    copy a program and one copy a warp, and of the wide down kernel."""
    from sm90_inspect import compile_sm90, ptxas_usage

    from roofline.kernels import moe_down

    gemv = fm._moe_gemv_kernel
    base = dict(PAIRS_PER_PROGRAM=1, A_PER_PAIR=8, BLOCK_N=8, BLOCK_K=256, NUM_STAGES=3,
                SILU_MUL=True, MUL_WEIGHT=False, QUANT=0, GROUP=0, WIDEN=0, RESIDUAL=False,
                PDL=False, PREFETCH_LINES=1, LINE_BYTES=128, FAST_FP8=True, LATE_TRIGGER=False,
                ROUTE=True, RENORMALIZE=True, BLOCK_E=128)  # fmt: skip
    base["ROUTE_COPIES"] = 0
    sig = {n: "constexpr" if n in base else "i32" for n in gemv.arg_names}
    sig.update(a_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", o_ptr="*bf16", out_ptr="*bf16",
               ids_ptr="*i64", weights_ptr="*bf16", res_ptr="*bf16",
               logits_ptr="*bf16")  # fmt: skip
    divisible = ("N", "K", "num_experts", "stride_am", "stride_we", "stride_wn", "stride_om")
    report = {}
    for label, route in (("no routing", dict(ROUTE=False)), ("copies 0", {}),
                         ("copies 4", dict(ROUTE_COPIES=4))):  # fmt: skip
        kernel = compile_sm90(gemv, sig, dict(base, **route), 4, divisible)
        report[f"gate/up {label}"] = (kernel.asm["ptx"].count("bar.sync"),
                                      *ptxas_usage(kernel))  # fmt: skip
    wide = moe_down._moe_down_wide_kernel
    consts = dict(TOP_K=8, BLOCK_J=8, NUM_STAGES=3, QUANT=False, RESIDUAL=True)
    sig = {n: "constexpr" if n in consts or n.startswith("BLOCK_") else "i32"
           for n in wide.arg_names}  # fmt: skip
    sig.update(act_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", ids_ptr="*i64",
               weights_ptr="*bf16", res_ptr="*bf16", out_ptr="*bf16")  # fmt: skip
    for block_n, block_k, warps in ((4, 256, 4), (8, 128, 4), (8, 256, 8)):
        tiles = dict(consts, BLOCK_N=block_n, BLOCK_K=block_k)
        kernel = compile_sm90(wide, sig, tiles, warps, ("H", "INTER", "stride_am", "stride_we",
                                                         "stride_wn"))  # fmt: skip
        report[f"wide down {block_n}x{block_k}, {warps} warps"] = (
            kernel.asm["ptx"].count("bar.sync"),
            *ptxas_usage(kernel),
        )
    return report


@pytest.mark.skipif(ON_GPU, reason="the GPU compiles the kernels itself in the tests above")
def test_variants_compile_for_hopper() -> None:
    """The gate/up GEMV routing one copy a warp has far fewer barriers than routing one copy a
    program and no more registers; nothing spills; the wide down's tiles the script sweeps
    compile."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    here = pathlib.Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(here), str(here.parents[1]), env.get("PYTHONPATH", "")]
    )
    code = "import json, test_moe_batch1_variants as t; print(json.dumps(t.hopper_report()))"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    gemv_bars = report["gate/up no routing"][0]  # the GEMV's own (its K sum, the pipeline)
    (bars0, regs0, _), (bars1, regs1, _) = report["gate/up copies 0"], report["gate/up copies 4"]
    assert bars1 - gemv_bars <= 8 and bars0 - gemv_bars >= 24 and regs1 <= regs0 + 8, report
    assert all(0 < regs <= 255 and spills == 0 for _, regs, spills in report.values()), report
