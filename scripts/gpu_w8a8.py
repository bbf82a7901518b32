"""fp8 W8A8 against bf16 on one GPU (H100, Llama-3.1-8B config, random weights): where a step's
time goes and how far each part is from its floor, in one process.

1. ``parity``: the per-token fp8 quantization kernels (``kernels.fp8_quant``: the persistent
   ``rows`` kernel and the per-row ``row`` kernel it replaces; plain and SiLU-and-mul inputs,
   odd K) bit for bit against torch (``formats.quantize_fp8_per_token`` after
   ``silu_and_mul``), the W8A8 dispatch (``fp8.fp8_gemm``) against the exact reference;
2. ``quant``: those kernels at M = 251 (a decode step of the offline run), 2048 and 8192 rows
   beside their floor (bytes over the copy bandwidth of this run), SiLU-and-mul + quantization
   apart, the bf16 SiLU-and-mul, the fused RMSNorm + quantization;
3. ``gemm``: the four Llama-3.1-8B GEMMs at 251 and 8192 rows (x already quantized): bf16
   cuBLAS, what the W8A8 dispatch picks, ``torch._scaled_mm``, Triton fp8 configs (each checked
   on the GPU first), beside max(bytes / copy bandwidth, FLOPs / fp8 ``_scaled_mm`` rate measured
   here); weights cycle through a ring inside one CUDA graph (not served from L2);
4. ``engine`` per method (bf16, fp8-w8a8; fp8 weight-only: batch 1 only): decode steps at batch
   1/8/32/128; a profiled prefill step (8192 tokens) and decode step (251 rows, ~600-token
   contexts), kernel time per kind beside its floor; the offline workload (256 requests, input
   100-1024, output 512) after a warm-up of the same shapes (so no JIT compile lands in the
   timed run: their count is printed), prefill and decode steps apart.

    python scripts/gpu_w8a8.py --no-install   # about 100 s: the engines run the shipped tables
    python scripts/gpu_w8a8.py                # the engines run this run's sweep winners
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_mixedgemm as base  # noqa: E402  (section runner, CUDA-graph timing, rings)

from roofline.kernels import fp8_gemm as tg  # noqa: E402
from roofline.kernels import fp8_quant as fq  # noqa: E402
from roofline.kernels import mixed_gemm as mg  # noqa: E402
from roofline.kernels.activation import silu_and_mul  # noqa: E402
from roofline.kernels.mixed_gemm import MixedGemmConfig  # noqa: E402
from roofline.quantization import formats  # noqa: E402

SUMMARY = base.SUMMARY
TABLE = base.TABLE
BF16 = torch.bfloat16
MODEL = "llama-3.1-8b"
HIDDEN, INTER = 4096, 14336
SHAPES = base.SHAPES  # name -> (N, K)
LINEAR_PARAMS = 32 * sum(n * k for n, k in SHAPES.values())  # per token: 2 FLOPs each
OUTPUT_LEN = 512
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, mode) tried per M
FAMILIES = {
    251: [
        (128, 128, 128, 8, 4, 0), (128, 256, 128, 8, 3, 1), (64, 128, 128, 4, 4, 0),
    ],
    8192: [(128, 256, 128, 8, 3, 1), (256, 128, 128, 8, 3, 0)],
    2048: [(128, 256, 64, 8, 4, 1)],
}  # fmt: skip
# kernels.fp8_gemm (descriptor GEMM): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages,
# persistent) tried per M, split-K added where the tiles are few
TMA_FAMILIES = {  # persistent 3: stream-K
    251: [
        (128, 128, 128, 8, 4, 0), (128, 128, 128, 8, 4, 1), (128, 256, 128, 8, 3, 1),
        (256, 128, 128, 8, 3, 0), (64, 128, 128, 4, 4, 0), (128, 64, 128, 4, 4, 0),
        (128, 128, 128, 8, 4, 3), (256, 128, 128, 8, 3, 3), (128, 64, 128, 4, 4, 3),
        (64, 128, 128, 4, 4, 3),
    ],
    8192: [
        (128, 256, 128, 8, 3, 1), (128, 256, 128, 8, 3, 2), (128, 128, 128, 8, 4, 1),
        (256, 128, 128, 8, 3, 1), (128, 256, 64, 8, 4, 0), (128, 128, 128, 8, 4, 3),
        (256, 128, 128, 8, 3, 3),
    ],
    2048: [
        (128, 256, 128, 8, 3, 1), (128, 128, 128, 8, 4, 1), (128, 128, 128, 8, 4, 0),
        (128, 128, 128, 8, 4, 3),
    ],
}  # fmt: skip


def us(t: float) -> str:
    return f"{t * 1e6:7.1f}"


def floor_note(t: float, floor: float) -> str:
    return f"{us(t)} us ({100 * floor / t:3.0f}% of floor {floor * 1e6:.1f})"


def fp8_steps(q: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """How many e4m3 steps apart two fp8 tensors are, element by element (the step at a
    value: 2^(exponent - 3) for normals, 2^-9 below 2^-6)."""
    a, b = q.float(), ref.float()
    top = torch.maximum(a.abs(), b.abs()).clamp_min(2**-6)
    step = torch.exp2(torch.floor(torch.log2(top)) - 3)
    return (a - b).abs() / step


@base.section("parity")
def parity() -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    bad = []
    for silu, m, k in [
        (True, 1, INTER), (True, 251, INTER), (True, 40, 11008), (False, 251, HIDDEN),
        (False, 7, 200),
    ]:  # fmt: skip
        cols = 2 * k if silu else k
        x = (torch.randn(m, cols, device="cuda", generator=gen) * 3).to(BF16)
        x[0, 1] = 40.0  # an outlier sets a scale
        ref_in = silu_and_mul(x) if silu else x
        # torch on the CPU: IEEE divisions (on CUDA it multiplies by a scalar's reciprocal)
        q_ref, s_ref = formats.quantize_fp8_per_token(ref_in.cpu())
        fn = fq.silu_mul_quantize_fp8_per_token if silu else fq.quantize_fp8_per_token
        cells = []
        for kernel in ("rows", "row", "rows-fast"):
            q, s = fn(x, kernel=kernel)
            q, s = q.cpu(), s.cpu()
            diff = int((q.float() != q_ref.float()).sum())
            same_s = int((s != s_ref).sum())
            steps = fp8_steps(q, q_ref)
            cells.append(f"{kernel} {diff} fp8 differ (at most {steps.max():.0f} e4m3 step), "
                         f"{same_s} scales differ")  # fmt: skip
            exact = kernel != "rows-fast"
            if (exact and (diff or same_s)) or steps.max() > 1 or diff > q.numel() // 1000:
                bad.append(f"{kernel} silu={silu} M={m} K={k}")
        print(f"quant silu={silu!s:5} M={m:5} K={k:5}: " + "; ".join(cells), flush=True)
    from roofline.quantization import fp8
    from roofline.quantization.fp8 import fp8_gemm

    for name, (n, k) in SHAPES.items():
        qw, s, _ = base.quantized("fp8", n, k)
        for m in (251, 1500, 7479):  # the shipped picks of buckets 256, 2048, 8192; odd rows
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            xq, xs = formats.quantize_fp8_per_token(x)
            ref = (xq.float() @ qw.float().T) * xs * s[None, :]
            err = base.rel_err(fp8_gemm(xq, xs, qw, s, None, BF16), ref)
            pick = fp8.W8A8_GEMMS.get((n, k, mg.m_bucket(m)), "mixed_gemm table")
            print(f"fp8_gemm {name:7} M={m:5} ({pick}): max-rel error {err:.1e}", flush=True)
            if not err < 2e-2:
                bad.append(f"fp8_gemm {name} M={m}: {err:.1e}")
    SUMMARY["parity_bad"] = bad
    TABLE.append(f"parity: {len(bad)} failures" + (": " + "; ".join(bad) if bad else ""))


def rand_rows(m: int, k: int) -> tuple[torch.Tensor]:
    return (torch.randn(m, k, device="cuda", dtype=BF16),)


def ring_of(make, total_bytes: int, one_bytes: int) -> list:
    """Enough distinct inputs that a CUDA graph cycling through them reads from HBM."""
    return [make() for _ in range(max(2, min(16, math.ceil(total_bytes / one_bytes))))]


def time_cycle(fn, inputs: list) -> float:
    calls = [partial(fn, *a) for a in inputs] * max(1, 8 // len(inputs))
    return base.time_graph(calls, 5)


@base.section("quant")
def quant(copy_bw: float) -> None:
    from roofline.kernels.fp8_quant import rms_norm_quantize_fp8_per_token
    from roofline.kernels.rmsnorm import fused_add_rms_norm

    for m in (251, 2048, 8192):
        # SiLU-and-mul + quantization (down_proj's input): reads 2I bf16, writes I fp8 + scale
        gu = ring_of(partial(rand_rows, m, 2 * INTER), 256 << 20, m * INTER * 4)
        floor = m * INTER * 5 / copy_bw
        cells = {}
        for kernel, warps in (("rows-fast", 16), ("rows", 16), ("row", 0), ("rows-fast", 32)):
            fq.ROWS_WARPS_MAX = warps or 16
            try:
                cells[f"{kernel}/{warps}"] = time_cycle(
                    partial(fq.silu_mul_quantize_fp8_per_token, kernel=kernel), gu
                )
            except Exception as e:  # noqa: BLE001 - (32 warps may not fit)
                print(f"  {kernel}/{warps}: {type(e).__name__}: {str(e)[:100]}", flush=True)
        fq.ROWS_WARPS_MAX = 16
        cells["apart"] = time_cycle(lambda x: fq.quantize_fp8_per_token(silu_and_mul(x)), gu)
        t_silu = time_cycle(silu_and_mul, gu)
        print(
            f"silu+quant M={m:5}: "
            + "; ".join(f"{a} {floor_note(t, floor)}" for a, t in cells.items())
            + f"; bf16 silu_and_mul {floor_note(t_silu, m * INTER * 6 / copy_bw)}",
            flush=True,
        )
        SUMMARY[f"quant_silu_{m}"] = {a: t * 1e6 for a, t in cells.items()} | {
            "floor": floor * 1e6,
            "bf16_silu": t_silu * 1e6,
        }
        TABLE.append(
            f"silu+quant M={m} (floor {floor * 1e6:.1f} us): "
            + ", ".join(f"{a} {us(t)}" for a, t in cells.items())
        )
        del gu
        # plain quantization (o_proj's input): reads K bf16, writes K fp8 + scale
        xs = ring_of(partial(rand_rows, m, HIDDEN), 256 << 20, m * HIDDEN * 2)
        floor = m * HIDDEN * 3 / copy_bw
        cells = {}
        for kernel in ("row", "rows"):
            cells[kernel] = time_cycle(partial(fq.quantize_fp8_per_token, kernel=kernel), xs)
        res = torch.randn(m, HIDDEN, device="cuda", dtype=BF16)
        w = torch.rand(HIDDEN, device="cuda", dtype=BF16) + 0.5
        t_norm8 = time_cycle(
            lambda x, w=w, r=res: rms_norm_quantize_fp8_per_token(x, w, 1e-5, r), xs
        )
        t_norm16 = time_cycle(lambda x, w=w, r=res: fused_add_rms_norm(x, r, w, 1e-5), xs)
        print(
            f"quant      M={m:5}: "
            + "; ".join(f"{a} {floor_note(t, floor)}" for a, t in cells.items())
            + f"; add+norm+quant {floor_note(t_norm8, m * HIDDEN * 7 / copy_bw)}, bf16 add+norm"
            f" {floor_note(t_norm16, m * HIDDEN * 8 / copy_bw)}",
            flush=True,
        )
        SUMMARY[f"quant_plain_{m}"] = {a: t * 1e6 for a, t in cells.items()} | {
            "floor": floor * 1e6,
            "norm8": t_norm8 * 1e6,
            "norm16": t_norm16 * 1e6,
        }
        del xs, res


def fp8_rate() -> float:
    """FLOP/s of ``torch._scaled_mm`` on 8192^3 fp8 (row-wise scales): the fp8 GEMM ceiling."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(formats.FP8_DTYPE)
    b = torch.randn(n, n, device="cuda").to(formats.FP8_DTYPE)
    sa = torch.ones(n, 1, device="cuda")
    sb = torch.ones(1, n, device="cuda")
    fn = partial(torch._scaled_mm, a, b.T, scale_a=sa, scale_b=sb, out_dtype=BF16)
    return 2 * n**3 / base.time_graph([fn] * 4, 5)


def gemm_floor(m: int, n: int, k: int, w_bytes: int, x_bytes: int, bw: float, rate: float):
    return max((n * k * w_bytes + m * k * x_bytes + m * n * 2) / bw, 2 * m * n * k / rate)


def scaled_mm(xq, xs, qw, s, fast: bool = False):
    return torch._scaled_mm(
        xq, qw.T, scale_a=xs, scale_b=s[None, :], out_dtype=BF16, use_fast_accum=fast
    )


@base.section("gemm")
def gemm(copy_bw: float, bf16_rate: float, f8_rate: float, install: bool) -> None:
    """Per shape and M: the fastest correct W8A8 GEMM (Triton config, ``_scaled_mm``, or
    ``_scaled_mm`` with fast accumulation) goes into ``fp8.W8A8_GEMMS`` for the engine runs
    (``install``) and is printed as that table's literal."""
    from roofline.quantization import fp8
    from roofline.quantization.fp8 import fp8_gemm

    picks: dict[tuple[int, int, int], object] = {}

    for m, fams in FAMILIES.items():
        cands = []
        for bm, bn, bk, warps, stages, mode in fams:
            for n, k in SHAPES.values():
                tiles = math.ceil(m / bm) * math.ceil(n / bn)
                for sk in sorted({1, round(132 / tiles), round(264 / tiles)}):
                    if 1 <= sk <= min(8, k // bk):
                        cands.append(MixedGemmConfig(bm, bn, bk, 8, sk, warps, stages, mode))
        cands = sorted(set(cands))
        tma_cands = []
        for bm, bn, bk, warps, stages, persistent in TMA_FAMILIES[m]:
            for n, k in SHAPES.values():
                tiles = math.ceil(m / bm) * math.ceil(n / bn)
                for sk in sorted({1, round(132 / tiles), round(264 / tiles)}):
                    if 1 <= sk <= min(8, k // bk) and (sk == 1 or not persistent):
                        tma_cands.append(tg.Fp8GemmConfig(bm, bn, bk, 8, sk, warps, stages,
                                                          persistent))  # fmt: skip
        tma_cands = sorted(set(tma_cands))
        qw0, s0, _ = base.quantized("fp8", *SHAPES["qkv"])
        x0q, x0s = formats.quantize_fp8_per_token(torch.randn(m, 4096, device="cuda", dtype=BF16))
        base.precompile(
            [partial(mg.fp8_scaled_gemm, x0q, x0s, qw0, s0, None, BF16, config=c._replace(
                split_k=min(c.split_k, 2)), warmup=True) for c in cands]
            + [partial(tg.fp8_gemm, x0q, x0s, qw0, s0, None, BF16, c._replace(
                split_k=min(c.split_k, 2)), warmup=True) for c in tma_cands]
        )  # fmt: skip
        for name, (n, k) in SHAPES.items():
            heavy = m >= 2048
            ring = base.make_ring("fp8", n, k, heavy)
            qw, s, _ = ring[0]
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            xq, xs = formats.quantize_fp8_per_token(x)
            ref = (xq.float() @ qw.float().T) * xs * s[None, :]
            t_pick = base.time_ring(
                lambda q, sc, o, a=xq, b=xs: fp8_gemm(a, b, q, sc, None, BF16), ring, heavy
            )
            t_lib = base.time_ring(lambda q, sc, o, a=xq, b=xs: scaled_mm(a, b, q, sc), ring, heavy)
            fast_err = base.rel_err(scaled_mm(xq, xs, qw, s, True), ref)
            # against x in 16 bits (the weight's own quantization left out): activation
            # quantization alone, and with each accumulation
            ref16 = x.float() @ (qw.float() * s[:, None]).T
            errs16 = [base.rel_err(ref, ref16)] + [
                base.rel_err(scaled_mm(xq, xs, qw, s, f), ref16) for f in (False, True)
            ]
            t_fast = base.time_ring(
                lambda q, sc, o, a=xq, b=xs: scaled_mm(a, b, q, sc, True), ring, heavy
            )
            if m % 16:  # the same GEMM with M padded to a multiple of 16 rows
                pad = 16 - m % 16
                xq_p = torch.cat([xq, xq[:pad]])
                xs_p = torch.cat([xs, xs[:pad]])
                t_pad = base.time_ring(
                    lambda q, sc, o, a=xq_p, b=xs_p: scaled_mm(a, b, q, sc), ring, heavy
                )
            else:
                t_pad = t_lib
            w16 = [(rand_rows(n, k)[0],) for _ in range(2 if heavy else 4)]
            t16 = base.time_ring(partial(F.linear, x), w16, heavy)
            res = []
            for c in cands:
                tiles = math.ceil(m / c.block_m) * math.ceil(n / c.block_n)
                if c.split_k > 1 and c.split_k not in {round(132 / tiles), round(264 / tiles)}:
                    continue
                try:
                    fn = partial(mg.fp8_scaled_gemm, xq, xs, out_dtype=BF16, config=c)
                    err = base.rel_err(fn(qw, s), ref)
                    if not err < 2e-2:
                        print(f"  WRONG {name} M={m} {tuple(c)}: {err:.1e}", flush=True)
                        continue
                    res.append((base.time_ring(lambda q, sc, o, fn=fn: fn(q, sc), ring, heavy), c))
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} M={m} {tuple(c)}: {type(e).__name__}: {str(e)[:120]}")
            for c in tma_cands:
                tiles = math.ceil(m / c.block_m) * math.ceil(n / c.block_n)
                if c.split_k > 1 and c.split_k not in {round(132 / tiles), round(264 / tiles)}:
                    continue
                try:
                    fn = partial(tg.fp8_gemm, xq, xs, out_dtype=BF16, bias=None, config=c)
                    err = base.rel_err(fn(qweight=qw, w_scales=s), ref)
                    if not err < 2e-2:
                        print(f"  WRONG tma {name} M={m} {tuple(c)}: {err:.1e}", flush=True)
                        continue
                    t = base.time_ring(
                        lambda q, sc, o, fn=fn: fn(qweight=q, w_scales=sc), ring, heavy
                    )
                    res.append((t, ("tma", *c)))
                except Exception as e:  # noqa: BLE001
                    print(f"  tma {name} M={m} {tuple(c)}: {type(e).__name__}: {str(e)[:160]}")
            res.sort(key=lambda r: r[0])
            f8 = gemm_floor(m, n, k, 1, 1, copy_bw, f8_rate)
            f16 = gemm_floor(m, n, k, 2, 2, copy_bw, bf16_rate)
            picked = fp8.W8A8_GEMMS.get((n, k, mg.m_bucket(m))) or (
                "triton" if mg.pick_config("w8a8", m, n, k, x.device) else "lib"
            )
            line = (
                f"{name:7} M={m:5}: bf16 {floor_note(t16, f16)} | w8a8 dispatch "
                f"{picked} {floor_note(t_pick, f8)} | _scaled_mm "
                f"{us(t_lib)} (M padded {us(t_pad)}; fast accum {us(t_fast)}, err "
                f"{fast_err:.1e}; vs 16-bit x: exact {errs16[0]:.1e}, promoted {errs16[1]:.1e}, "
                f"fast {errs16[2]:.1e}) | best triton "
                + "; ".join(f"{tuple(c)} {us(t)}" for t, c in res[:3])
            )
            print(line, flush=True)
            SUMMARY[f"gemm_{name}_{m}"] = {
                "bf16": t16 * 1e6, "pick": t_pick * 1e6, "scaled_mm": t_lib * 1e6,
                "floor_fp8": f8 * 1e6, "floor_bf16": f16 * 1e6, "fast_err": fast_err,
                "errs_vs_x16": errs16,
                "top": [(tuple(c), t * 1e6) for t, c in res[:6]],
            }  # fmt: skip
            options = [(t_fast if fp8.FAST_ACCUM else t_lib, "lib")]
            options += [(t, tuple(c)) for t, c in res[:1]]
            best, winner = min(options, key=lambda o: o[0])
            picks[(n, k, mg.m_bucket(m))] = winner
            TABLE.append(
                f"gemm {name:7} M={m:5}: bf16 {us(t16)} | w8a8 dispatch {us(t_pick)} | best "
                f"{us(best)} ({winner}) | fp8 floor {f8 * 1e6:.1f}"
            )
            del ring, w16
    print("W8A8_GEMMS = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in picks.items()) + "}")
    SUMMARY["w8a8_gemms"] = {str(k): v for k, v in picks.items()}
    if install:
        fp8.W8A8_GEMMS.update(picks)
        TABLE.append("(the engine runs below use these picks: fp8.W8A8_GEMMS)")


KINDS = (
    ("attention", ("attention", "attn", "flash", "cascade", "_decode_", "_prefill_", "_verify_",
                   "_stage_decode")),
    ("gemm", ("gemm", "gemv", "matmul", "cutlass", "xmma", "nvjet", "sm90", "cublas",
              "scaled_mm")),
    ("quant/norm/act", ("fp8", "rms_norm", "silu", "per_token")),
)  # fmt: skip


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(key in low for key in keys):
            return kind
    return "other"


def profiled(fn, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Kernel seconds per step by kind and by name over ``steps`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_kind: dict[str, float] = {}
    per_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = e.device_time / 1e6 / steps
            per_kind[kernel_kind(e.name)] = per_kind.get(kernel_kind(e.name), 0.0) + t
            per_name[e.name] = per_name.get(e.name, 0.0) + t
    return per_kind, per_name


def step_floors(rows: int, tokens: int, ctx_tokens: int, w8a8: bool, bw, bf16_rate, f8_rate):
    """Floors (s) per kind of one step: GEMMs (weights once, FLOPs at the measured rate;
    the LM head in bf16 on ``rows`` rows), attention (the KV read once: decode), the
    quantization / norm / activation kernels (their bytes once)."""
    w_bytes = 1 if w8a8 else 2
    gemm = sum(
        gemm_floor(tokens, n, k, w_bytes, w_bytes, bw, f8_rate if w8a8 else bf16_rate)
        for n, k in SHAPES.values()
    ) * 32 + gemm_floor(rows, 128256, HIDDEN, 2, 2, bw, bf16_rate)
    kv = ctx_tokens * 32 * 2 * 8 * 128 * 2  # K and V, 8 KV heads of 128, bf16
    attn = kv / bw
    if w8a8:  # norm+quant x2 (7 B/elem), quant o-input (3), silu+quant (5 per I)
        elem = tokens * 32 * (2 * HIDDEN * 7 + HIDDEN * 3 + INTER * 5)
    else:  # add+norm x2 (8), silu_and_mul (6 per I)
        elem = tokens * 32 * (2 * HIDDEN * 8 + INTER * 6)
    return {"gemm": gemm, "attention": attn, "quant/norm/act": elem / bw}


def profile_steps(llm, ceil, f8_rate: float, w8a8: bool, method: str) -> None:
    """251 requests of 560-token prompts: three prefill steps (8192 tokens) profiled, then three
    decode-only steps (251 rows); kernel time per step by kind beside its floor."""
    engine = llm.llm_engine
    from roofline import SamplingParams

    rng = random.Random(5)
    vocab = engine.model_config.vocab_size
    n_req, in_len = 251, 560
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ids = [f"prof-{i}" for i in range(n_req)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(10, vocab - 10) for _ in range(in_len)], params)
    bw, bf16_rate = ceil.bandwidth_bytes_per_s, ceil.matmul_flops_per_s
    try:
        engine.step()  # the first chunk (and compiles)
        kinds, names = profiled(engine.step, 3)
        report(method, "prefill step (~8192 tokens)", kinds, names,
               step_floors(8, 8192, 0, w8a8, bw, bf16_rate, f8_rate))  # fmt: skip
        while any(r.num_computed_tokens < in_len for r in engine.scheduler.running) or (
            engine.scheduler.waiting
        ):
            engine.step()
        engine.step()
        ctx = sum(r.num_computed_tokens for r in engine.scheduler.running)
        rows = len(engine.scheduler.running)
        kinds, names = profiled(engine.step, 3)
        report(method, f"decode step ({rows} rows, {ctx // max(rows, 1)}-token contexts)", kinds,
               names, step_floors(rows, rows, ctx, w8a8, bw, bf16_rate, f8_rate))  # fmt: skip
    finally:
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()


def report(method: str, what: str, kinds: dict, names: dict, floors: dict) -> None:
    total = sum(kinds.values())
    cells = []
    for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
        fl = floors.get(kind)
        cells.append(f"{kind} {t * 1e3:.2f}" + (f" (floor {fl * 1e3:.2f})" if fl else ""))
    line = f"{method:9} {what}: kernels {total * 1e3:.2f} ms: " + ", ".join(cells)
    print(line, flush=True)
    TABLE.append(line)
    for name, t in sorted(names.items(), key=lambda kv: -kv[1])[:10]:
        print(f"    {t * 1e3:7.3f} ms [{kernel_kind(name)}] {name[:100]}")
    SUMMARY[f"profile_{method}_{what.split()[0]}"] = {
        "kinds": {k: v * 1e3 for k, v in kinds.items()}, "floors": {k: v * 1e3 for k, v in
        floors.items()}, "top": {n: t * 1e3 for n, t in sorted(names.items(), key=lambda kv:
        -kv[1])[:15]}}  # fmt: skip


@base.section("engine")
def engine(ceil, f8_rate: float, methods: list[str], num_requests: int, batches: list[int]):
    from gpu_profile_presets import phase_split

    from roofline import LLM
    from roofline.bench import latency, throughput, workloads

    for method in methods:
        llm = None
        try:
            t0 = time.perf_counter()
            llm = LLM(
                MODEL, load_format="dummy", device="cuda", max_model_len=4096,
                max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
                quantization=None if method == "bf16" else method,
            )  # fmt: skip
            startup = time.perf_counter() - t0
            eng = llm.llm_engine
            if method == "fp8":  # weight-only: batch-1 decode only (its issue figure)
                rows = latency.run(eng, ceil, [1], 128, 64)
                tok_s = 1e3 / rows[0].step_ms_p50
                line = f"fp8 weight-only b1: {rows[0].step_ms_p50:.2f} ms/step = {tok_s:.0f} tok/s"
                print(line, flush=True)
                TABLE.append(line)
                SUMMARY["fp8_b1_tok_s"] = tok_s
                continue
            rows = latency.run(eng, ceil, batches, 128, 32)
            steps = {r.batch_size: r.step_ms_p50 for r in rows}
            print(f"{method} decode step ms: "
                  + " ".join(f"b{b} {t:.2f}" for b, t in steps.items()), flush=True)  # fmt: skip
            try:
                profile_steps(llm, ceil, f8_rate, method != "bf16", method)
            except Exception as e:  # noqa: BLE001 - the offline run still goes
                print(f"profile {method} FAILED: {type(e).__name__}: {e}", flush=True)
            vocab = eng.model_config.vocab_size
            warm = workloads.synthetic(num_requests, (100, 1024), (4, 4), vocab, seed=11)
            t1 = time.perf_counter()
            throughput.run(llm, ceil, warm, use_tqdm=False)  # the same step shapes, compiled
            warm_s = time.perf_counter() - t1
            eng.kv_manager.reset_prefix_cache()
            wl = workloads.synthetic(num_requests, (100, 1024), (OUTPUT_LEN, OUTPUT_LEN), vocab)
            res, phases = phase_split(llm, ceil, wl)
            parts = []
            for kind in ("prefill", "decode"):
                t = phases.get(kind, [])
                if t:
                    rws = phases[kind + "_rows"]
                    parts.append(f"{kind} steps {len(t)} {sum(t):.2f} s (median "
                                 f"{1e3 * sorted(t)[len(t) // 2]:.1f} ms, rows "
                                 f"{sum(rws) / len(rws):.0f})")  # fmt: skip
            line = (
                f"{method:9} start-up {startup:4.1f} s; steps ms "
                + " ".join(f"b{b} {t:.2f}" for b, t in steps.items())
                + f"; offline {num_requests} req: {res.output_tok_s:6.0f} out tok/s "
                f"({res.elapsed_s:.2f} s, {res.roofline_pct:.0f}% of roofline, warm-up "
                f"{warm_s:.1f} s, JIT compiles in the timed run: {len(res.jit_compiles)}); "
                + "; ".join(parts)
            )
            print(line, flush=True)
            TABLE.append(line)
            SUMMARY[f"engine_{method}"] = {
                "out_tok_s": res.output_tok_s, "elapsed_s": res.elapsed_s, "step_ms": steps,
                "jit": res.jit_compiles, "startup_s": startup,
                "phases": {k: sum(v) for k, v in phases.items() if k in ("prefill", "decode")},
            }  # fmt: skip
        except Exception as e:  # noqa: BLE001
            import traceback

            print(f"engine {method} FAILED: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        finally:
            llm = eng = None  # (a reference left here kept the engine's memory: check 1)
            gc.collect()
            torch.cuda.empty_cache()
    b, w = SUMMARY.get("engine_bf16"), SUMMARY.get("engine_fp8-w8a8")
    if b and w:
        ratios = " ".join(
            f"b{k} {b['step_ms'][k] / v:.2f}x" for k, v in w["step_ms"].items() if k in b["step_ms"]
        )
        TABLE.append(
            f"fp8-w8a8 / bf16 (both warm): offline {w['out_tok_s'] / b['out_tok_s']:.3f}x "
            f"(target 1.25x), prefill {b['phases'].get('prefill', 0):.2f} -> "
            f"{w['phases'].get('prefill', 0):.2f} s, decode {b['phases'].get('decode', 0):.2f} -> "
            f"{w['phases'].get('decode', 0):.2f} s; decode steps {ratios}"
        )


def kernel_sections(args, sections: list[str]) -> None:
    """parity / quant / gemm in a child process (a kernel that faults the GPU takes only that
    process down): its table lines, summary and GEMM picks come back through a JSON file."""
    import subprocess
    import tempfile

    from roofline.quantization import fp8

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "child.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--sections", ",".join(sections),
               "--child-out", path, "--out", tmp]  # fmt: skip
        gc.collect()
        torch.cuda.empty_cache()
        sys.stdout.flush()
        rc = subprocess.run(cmd).returncode
        if rc:
            TABLE.append(f"KERNEL SECTIONS' PROCESS EXITED WITH {rc}")
        if os.path.exists(path):
            with open(path) as f:
                got = json.load(f)
            TABLE.extend(got["table"])
            SUMMARY.update(got["summary"])
            if not args.no_install:
                fp8.W8A8_GEMMS.update(
                    {tuple(k): tuple(v) if isinstance(v, list) else v for k, v in got["picks"]}
                )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="parity,quant,gemm,engine")
    ap.add_argument("--methods", default="bf16,fp8-w8a8,fp8", help="engine runs")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", default="1,8,32,128")
    ap.add_argument("--no-install", action="store_true", help="engine: the shipped W8A8 GEMMs")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--child-out", default="", help="(internal) the kernel sections' results")
    args = ap.parse_args()
    t0 = time.perf_counter()
    from roofline.bench.ceilings import measure

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    ceil = measure(torch.device("cuda"), BF16)
    f8 = fp8_rate()
    line = (
        f"ceilings: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s, fp8 _scaled_mm {f8 / 1e12:.0f} TFLOP/s"
    )
    print(line, flush=True)
    TABLE.append(line)
    sections = args.sections.split(",")
    kernels = [v for v in sections if v in ("parity", "quant", "gemm")]
    if kernels and "engine" in sections:  # isolated: the engine runs whatever happens there
        kernel_sections(args, kernels)
        sections = ["engine"]
    if "parity" in sections:
        parity()
    if "quant" in sections:
        quant(ceil.bandwidth_bytes_per_s)
    if "gemm" in sections:
        gemm(ceil.bandwidth_bytes_per_s, ceil.matmul_flops_per_s, f8, not args.no_install)
    if "engine" in sections:
        batches = [int(v) for v in args.steps.split(",") if v]
        engine(ceil, f8, args.methods.split(","), args.requests, batches)
    if args.child_out:
        from roofline.quantization import fp8

        with open(args.child_out, "w") as f:
            picks = [[list(k), v] for k, v in fp8.W8A8_GEMMS.items()]
            json.dump({"table": TABLE, "summary": SUMMARY, "picks": picks}, f, default=str)
        return
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s)")
    print("\n".join(TABLE))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_w8a8.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
