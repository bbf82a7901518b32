"""Quantized linear layers at batch and prefill sizes on one GPU (H100, Llama-3.1-8B shapes,
random weights), in one process:

1. parity on the GPU: ``kernels.mixed_gemm`` (int8 per channel and g128, int4 g128 with offsets,
   fp8; heuristic, split-K and tuned configs; odd M) against x times the exactly dequantized
   weight; the Triton W8A8 GEMM against the torch W8A8 reference and ``torch._scaled_mm``;
2. the GEMMs at M = 16, 32, 128, 256, 2048, 8192 for qkv / o / gate_up / down: us, TFLOP/s and
   GB/s of weight bytes for bf16 cuBLAS, and per method int8 / int4 / fp8 the mixed-input GEMM
   (its tuned or heuristic config), dequantize + cuBLAS, what the layer's dispatch runs, the
   older generic fused GEMM (M <= 128), the decode GEMV (M = 16), and W8A8 (Triton fp8 GEMM,
   ``torch._scaled_mm``, the per-token quantization alone); weights
   cycle through a ring of copies (>= 256 MiB) inside one CUDA graph, so none is served from L2;
3. ``--sweep``: per method, shape and M, every candidate config (compiled in parallel), the best
   one beside the library GEMM (dequantize + cuBLAS, or ``_scaled_mm`` for W8A8); prints the
   ``TUNED_CONFIGS`` literal (also ``$OUT/mixed_gemm_tuned.txt``) and installs it for the runs
   below (``--sweep-budget`` seconds at most, most valuable shapes first);
4. (not ``--quick``) the engine per method (bf16, int8, int4 g128, fp8 W8A8): decode steps at
   batch 32 and 128, then offline throughput on the 256-request workload (input 100-1024, output
   512; ``--requests``).

Each section prints its error and goes on; a short table comes last.

    python scripts/gpu_mixedgemm.py --quick --sweep   # about 90 s
    python scripts/gpu_mixedgemm.py                   # about 3.5 min
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
import torch.nn.functional as F
import triton

from roofline.kernels import mixed_gemm as mg
from roofline.kernels import quant_gemv
from roofline.kernels.activation import silu_and_mul
from roofline.kernels.dequant_gemm import dequant_cublas_gemm, dequant_gemm, dequantize_ref
from roofline.kernels.fp8_quant import quantize_fp8_per_token, silu_mul_quantize_fp8_per_token
from roofline.kernels.mixed_gemm import MixedGemmConfig
from roofline.quantization import formats

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
M_VALUES = (16, 32, 128, 256, 2048, 8192)  # 16: beside the decode GEMV
METHODS = ("int8", "int4", "fp8")
SUMMARY: dict[str, object] = {}
TABLE: list[str] = []
RING_BYTES = 256 << 20
DEVICE = "cuda"  # a CPU dry run (TRITON_INTERPRET=1) sets "cpu" and small shapes
MODEL = "llama-3.1-8b"
STEP_BATCHES = (32, 128)  # decode steps timed per method
OUTPUT_LEN = 512  # offline workload: input 100-1024, this many output tokens
WARM_LENS = (300, 1500, 3000, 4000)  # prompts that compile the prefill GEMM configs first
PARITY_SHAPE = (4096, 4096)


def section(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            print(f"\n=== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name} FAILED: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
                SUMMARY[f"{name}_error"] = repr(e)
            finally:
                print(f"({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
                gc.collect()
                torch.cuda.empty_cache()

        return run

    return wrap


def quantized(kind: str, n: int, k: int, seed: int = 0, group: int = 0):
    """(qweight, scales, offsets) of a random weight: int8 per channel (or ``group``), int4 g128
    asymmetric (bf16 scales), fp8 per channel."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.randn(n, k, device=DEVICE, generator=gen) * 0.02
    if kind == "int8":
        q = formats.quantize_int8(w, group or k, torch.bfloat16)
        return q.qweight, q.scales, None
    if kind == "int4":
        return tuple(formats.quantize_int4(w, group or 128, False, torch.bfloat16))
    q, s = formats.quantize_fp8(w)
    return q, s, None


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def exact_ref(kind, x, qw, s, o) -> torch.Tensor:
    return x.float() @ dequantize_ref(kind, qw, s, o, torch.float32).T


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()


def w8a8_exact(x, qw, s) -> torch.Tensor:
    xq, xs = formats.quantize_fp8_per_token(x)
    return (xq.float() @ qw.float().T) * xs * s.float()[None, :]


@section("parity")
def parity() -> None:
    worst = 0.0
    n, k = PARITY_SHAPE
    cfgs = {
        "pick": None,
        "splitk4": MixedGemmConfig(32, 64, 128, 8, 4, 4, 4),
        "bm128": MixedGemmConfig(128, 64, 128, 8, 1, 4, 3),
        "bn128": MixedGemmConfig(128, 128, 128, 4, 1, 8, 3),
    }
    cases = (("int8", 0), ("int8", 128), ("int4", 128), ("int4", 32), ("fp8", 0))
    weights = {case: quantized(case[0], n, k, group=case[1]) for case in cases}
    x17 = torch.randn(17, k, device=DEVICE, dtype=torch.bfloat16)
    precompile(
        [
            partial(ours(kind, c, True), x17, *weights[(kind, g)])
            for kind, g in cases
            for c in cfgs.values()
        ]
        + [partial(ours("w8a8", c, True), x17, *weights[("fp8", 0)]) for c in cfgs.values()]
        + [  # what the dispatch picks below
            partial(ours(kind, mg.pick_config(kind, m, n, k, x17.device), True), x17, *w)
            for (kind, _), w in weights.items()
            for m in (24, 200, 3000)
            if mg.pick_config(kind, m, n, k, x17.device) is not None
        ]
    )
    for kind, group in cases:
        qw, s, o = weights[(kind, group)]
        for m in (17, 100, 300, 2049):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            ref = exact_ref(kind, x, qw, s, o)
            errs = {
                name: rel_err(mg.mixed_gemm(kind, x, qw, s, o, config=c), ref)
                for name, c in cfgs.items()
            }
            worst = max(worst, *errs.values())
            print(
                f"{kind} g{group or 'K'} M={m:4}: "
                + " ".join(f"{a} {e:.1e}" for a, e in errs.items())
            )
    qw, s, _ = quantized("fp8", n, k)
    bias = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    for m in (17, 100, 300, 2049):
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) * 3
        ref = w8a8_exact(x, qw, s) + bias.float()
        errs = {
            name: rel_err(mg.w8a8_gemm(x, qw, s, bias, config=c), ref) for name, c in cfgs.items()
        }
        xq, xs = quantize_fp8_per_token(x)
        sm = torch._scaled_mm(xq, qw.T, scale_a=xs, scale_b=s[None, :], out_dtype=torch.bfloat16)
        errs["_scaled_mm"] = rel_err(sm + bias, ref)
        worst = max(worst, *errs.values())
        print(f"w8a8 M={m:4}: " + " ".join(f"{a} {e:.1e}" for a, e in errs.items()))
    # the dispatch the quantization methods use (common.quantized_linear, fp8.w8a8_linear)
    from types import SimpleNamespace

    from roofline.quantization import common
    from roofline.quantization.fp8 import w8a8_linear

    for m in (24, 200, 3000):
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        errs = {}
        for kind, group in cases:
            qw, s, o = weights[(kind, group)]
            layer = SimpleNamespace(qweight=qw, scales=s, offsets=o)
            got = common.quantized_linear(kind, layer, x, None)
            errs[f"{kind}/g{group or 'K'}"] = rel_err(got, exact_ref(kind, x, qw, s, o))
        qw, s, _ = weights[("fp8", 0)]
        errs["w8a8"] = rel_err(w8a8_linear(x, qw, s, None), w8a8_exact(x, qw, s))
        gate_up = torch.randn(m, 2 * k, device=DEVICE, dtype=torch.bfloat16) * 2
        got = w8a8_linear(gate_up, qw, s, None, silu_mul=True)
        errs["w8a8+silu"] = rel_err(got, w8a8_exact(silu_and_mul(gate_up), qw, s))
        worst = max(worst, *errs.values())
        print(f"dispatch M={m:4}: " + " ".join(f"{a} {e:.1e}" for a, e in errs.items()))
    worst = max(worst, tuned_parity())
    SUMMARY["parity_worst"] = worst
    TABLE.append(
        f"parity: worst max-rel error {worst:.2e} (bf16 output rounding ~4e-3; bound 2e-2)"
    )
    if worst > 2e-2:
        TABLE.append("PARITY FAILED")


def tuned_parity() -> float:
    """Every config of the shipped table on its own shape, at a row count inside its bucket
    (3 below the bucket: a partial row block), against the reference."""
    worst, failed = 0.0, []
    entries = [(key, cfg) for key, cfg in mg.TUNED_CONFIGS.items() if cfg is not None]
    weights: dict[tuple, tuple] = {}
    for (kind, n, k, _bucket), _ in entries:
        base = "fp8" if kind == "w8a8" else kind
        if (base, n, k) not in weights:
            weights[(base, n, k)] = quantized(base, n, k, seed=3)
    x17 = {k: torch.randn(17, k, device=DEVICE, dtype=torch.bfloat16) for _, _, k in weights}
    precompile(
        [
            partial(ours(kind, MixedGemmConfig(*c), True), x17[k], *weights[(kind, n, k)])
            for (kind, n, k, _), c in entries
            if kind != "w8a8"
        ]
    )
    for (kind, n, k, bucket), cfg in entries:
        base = "fp8" if kind == "w8a8" else kind
        qw, s, o = weights[(base, n, k)]
        x = torch.randn(max(bucket - 3, 1), k, device=DEVICE, dtype=torch.bfloat16)
        got = ours(kind, MixedGemmConfig(*cfg))(x, qw, s, o)
        ref = w8a8_exact(x, qw, s) if kind == "w8a8" else exact_ref(kind, x, qw, s, o)
        err = rel_err(got, ref)
        worst = max(worst, err)
        if not err < 2e-2:
            failed.append(f"{kind} {n}x{k} M={x.shape[0]} {cfg}: {err:.2e}")
    print(f"tuned table: {len(entries)} configs on their shapes, worst max-rel error {worst:.2e}")
    for line in failed:
        print(f"  WRONG: {line}")
    TABLE.append(f"tuned configs: {len(entries)} checked, {len(failed)} wrong")
    return worst


def time_graph(calls: list, iters: int = 10) -> float:
    """Median seconds per call over ``iters`` replays of one CUDA graph of ``calls``."""
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for a, b in zip(starts, ends, strict=True):
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    ms = statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends, strict=True))
    del graph
    return ms / 1e3 / len(calls)


def time_ring(fn, weights: list[tuple], heavy: bool) -> float:
    """Seconds per ``fn(*w)``, w cycling through the ring (one CUDA graph)."""
    calls = len(weights) if heavy else max(len(weights), 8)
    return time_graph(
        [partial(fn, *weights[i % len(weights)]) for i in range(calls)], 5 if heavy else 10
    )


def make_ring(kind: str, n: int, k: int, heavy: bool) -> list[tuple]:
    qw, s, o = quantized(kind, n, k)
    copies = 2 if heavy else max(2, math.ceil(RING_BYTES / nbytes(qw, s, o)))
    return [(qw, s, o)] + [
        (qw.clone(), s.clone(), None if o is None else o.clone()) for _ in range(copies - 1)
    ]


def precompile(fns: list) -> None:
    """Compile (first call) on a thread pool where Triton supports it; errors surface later."""
    if not hasattr(triton, "AsyncCompileMode"):
        return
    with (
        ThreadPoolExecutor(os.cpu_count() or 4) as pool,
        triton.AsyncCompileMode(pool, ignore_errors=True),
    ):
        for fn in fns:
            try:
                fn()
            except Exception:  # noqa: BLE001 - reported when timed
                pass


def gemv(kind: str, x: torch.Tensor):
    """The decode GEMV (``kernels.quant_gemv``, its picked config), for M <= 16."""
    return lambda qw, s, o: quant_gemv.quant_gemv(kind, x, qw, s, o)


def dispatch(kind: str):
    """What a quantized linear layer runs (``common.quantized_linear``, ``fp8.w8a8_linear``)."""
    from types import SimpleNamespace

    from roofline.quantization import common
    from roofline.quantization.fp8 import w8a8_linear

    if kind == "w8a8":
        return lambda x, qw, s, o: w8a8_linear(x, qw, s, None)
    return lambda x, qw, s, o: common.quantized_linear(
        kind, SimpleNamespace(qweight=qw, scales=s, offsets=o), x, None
    )


def lib_gemm(kind: str):
    """The library path the tuned table can choose instead (``None`` entries)."""
    if kind == "w8a8":
        from roofline.quantization.fp8 import _scaled_mm

        return lambda x, qw, s, o: _scaled_mm(x, qw, s, None)
    return partial(dequant_cublas_gemm, kind)


def ours(kind: str, config=None, warmup: bool = False):
    if kind == "w8a8":
        return lambda x, qw, s, o: mg.w8a8_gemm(x, qw, s, None, config=config, warmup=warmup)
    return lambda x, qw, s, o: mg.mixed_gemm(kind, x, qw, s, o, config=config, warmup=warmup)


@section("GEMMs")
def gemms(copy_bw: float, mm_rate: float, quick: bool) -> None:
    """Every shape x M: bf16 cuBLAS, then per method ours / dequantize + cuBLAS / generic."""
    rows = []
    for layer, (n, k) in SHAPES.items():
        ms = M_VALUES if not quick else (16, 32, 128, 2048, 8192)
        rings16 = [
            (torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16),)
            for _ in range(max(2, math.ceil(RING_BYTES / (2 * n * k))))
        ]
        rings = {kind: make_ring(kind, n, k, False) for kind in METHODS}
        rings["w8a8"] = rings["fp8"]
        x_big = torch.randn(max(ms), k, device=DEVICE, dtype=torch.bfloat16)
        for kind in ("int8", "int4", "fp8", "w8a8"):  # compile the picked configs in parallel
            precompile([partial(ours(kind, warmup=True), x_big[:m], *rings[kind][0]) for m in ms])
        for m in ms:
            heavy = m >= 2048
            x = x_big[:m]
            flops = 2 * m * n * k
            t16 = time_ring(partial(F.linear, x), rings16[: 2 if heavy else None], heavy)
            line = {"bf16": t16}
            for kind in ("int8", "int4", "fp8", "w8a8"):
                ring = rings[kind][: 2 if heavy else None]
                line[kind] = time_ring(partial(ours(kind), x), ring, heavy)
                line[f"{kind}/lib"] = time_ring(partial(lib_gemm(kind), x), ring, heavy)
                line[f"{kind}/dispatch"] = time_ring(partial(dispatch(kind), x), ring, heavy)
                if m <= 128 and kind != "w8a8":
                    line[f"{kind}/old"] = time_ring(partial(dequant_gemm, kind, x), ring, heavy)
                if m <= 16 and kind != "w8a8":
                    try:  # (another branch may change the decode GEMV's API)
                        if quant_gemv.supports(kind, x, *ring[0][:2]):
                            line[f"{kind}/gemv"] = time_ring(gemv(kind, x), ring, heavy)
                    except Exception as e:  # noqa: BLE001
                        print(f"  decode GEMV {kind} M={m}: {type(e).__name__}: {e}")
            line["actquant"] = time_ring(partial(quantize_fp8_per_token, x), [()], heavy)
            if layer == "down":  # the W8A8 down projection's input: fused vs two launches
                gu = torch.randn(m, 2 * k, device=DEVICE, dtype=torch.bfloat16)
                line["silu+quant"] = time_ring(
                    lambda g: quantize_fp8_per_token(silu_and_mul(g)), [(gu,)], heavy
                )
                line["silu_quant"] = time_ring(silu_mul_quantize_fp8_per_token, [(gu,)], heavy)
                del gu
            wbytes = {kind: nbytes(*rings[kind][0]) for kind in METHODS}
            wbytes["bf16"], wbytes["w8a8"] = 2 * n * k, wbytes["fp8"]
            parts = [
                f"{layer:7} M={m:5}: bf16 {t16 * 1e6:7.1f} us {flops / t16 / 1e12:5.0f} TF/s "
                f"{2 * n * k / t16 / 1e9:5.0f} GB/s"
            ]
            for kind in ("int8", "int4", "fp8", "w8a8"):
                t = line[kind]
                p = (
                    f"  {kind:4} ours {t * 1e6:7.1f} ({t16 / t:4.2f}x bf16, "
                    f"{flops / t / 1e12:4.0f} TF/s, {wbytes[kind] / t / 1e9:5.0f} GB/s) "
                    f"lib {line[kind + '/lib'] * 1e6:7.1f} dispatch "
                    f"{line[kind + '/dispatch'] * 1e6:7.1f} "
                    f"({t16 / line[kind + '/dispatch']:4.2f}x)"
                )
                if f"{kind}/old" in line:
                    p += f" old {line[kind + '/old'] * 1e6:7.1f}"
                if f"{kind}/gemv" in line:
                    p += f" decode GEMV {line[kind + '/gemv'] * 1e6:7.1f}"
                parts.append(p)
            parts.append(f"  fp8 per-token act quant alone {line['actquant'] * 1e6:.1f} us")
            if "silu_quant" in line:
                parts.append(
                    f"  SiLU-and-mul + act quant: two launches {line['silu+quant'] * 1e6:.1f} "
                    f"us, fused {line['silu_quant'] * 1e6:.1f} us"
                )
            print("\n".join(parts), flush=True)
            SUMMARY[f"gemm_{layer}_{m}"] = {a: v * 1e6 for a, v in line.items()}
            rows.append((layer, m, line))
        del rings16, rings, x_big
        torch.cuda.empty_cache()
    TABLE.append(
        "speed vs bf16 cuBLAS (the mixed kernel | what the dispatch runs), "
        "per shape qkv/o/gate_up/down:"
    )
    for m in sorted({r[1] for r in rows}):
        cells = []
        for kind in ("int8", "int4", "fp8", "w8a8"):
            ratios = [line["bf16"] / line[kind] for _, mm, line in rows if mm == m]
            best = [line["bf16"] / line[f"{kind}/dispatch"] for _, mm, line in rows if mm == m]
            cells.append(
                f"{kind} "
                + "/".join(f"{r:.2f}" for r in ratios)
                + " | "
                + "/".join(f"{r:.2f}" for r in best)
            )
        TABLE.append(f"  M={m:5}: " + "; ".join(cells))
    SUMMARY["copy_bw"], SUMMARY["mm_rate"] = copy_bw, mm_rate


def candidates(kind: str, m: int, k: int) -> list[MixedGemmConfig]:
    """Tile shapes to time at M rows; 8 warps where a thread would otherwise hold more than 128
    weight elements of a tile (4 warps spill there: ptxas on the CPU)."""
    out = []
    if m <= 64:
        for bn in (64, 128):
            for bk in (128, 256):
                for sk in (1, 2, 4, 8):
                    w = 4 if bn * bk <= 64 * 128 else 8
                    out.append(MixedGemmConfig(max(16, m), bn, bk, 8, sk, w, 4 if bk == 128 else 3))
    elif m <= 256:
        for bm in sorted({64, 128, m}):
            for bn in (64, 128):
                for bk in (64, 128):
                    for sk in (1, 2, 4) if bm * bn < 128 * 256 else (1,):
                        w = 8 if max(bm, bk) * bn >= 128 * 128 else 4
                        out.append(MixedGemmConfig(bm, bn, bk, 8, sk, w, 4 if bk == 64 else 3))
    else:
        for bm, bn in ((128, 128), (256, 128), (128, 256), (64, 128)):
            for bk in (64, 128):
                for st in (3, 4):
                    w = 8 if max(bm, bk) * bn >= 128 * 128 else 4
                    out.append(MixedGemmConfig(bm, bn, bk, 8, 1, w, st))
    valid = []
    for c in out:
        if k % (c.split_k * c.block_k) or (kind == "w8a8" and c.block_k < 64):
            continue
        if c.block_k == 64 and c.num_warps == 8:
            continue  # (128, 128, 64, 8, 1, 8, 3) gave wrong results on the H100
        x_bytes = 1 if kind == "w8a8" else 2
        smem = c.num_stages * (c.block_m * c.block_k * x_bytes + c.block_n * c.block_k)
        if smem <= 200 << 10:
            valid.append(c)
    return list(dict.fromkeys(valid))


@section("sweep")
def sweep(budget_s: float, ms: list[int], kinds: list[str]) -> dict:
    """Per M, then per method: every candidate config compiled at once (the kernels do not
    depend on the shape: one compile serves all four), then timed on each shape beside the
    library GEMM; the fastest correct config wins unless the library GEMM is faster (None)."""
    t_end = time.perf_counter() + budget_s
    tuned: dict[tuple, tuple | None] = {}
    for m in ms:
        for kind in kinds:
            if time.perf_counter() > t_end:
                print(f"sweep budget ({budget_s:.0f} s) reached before {kind} M={m}")
                return tuned
            base = "fp8" if kind == "w8a8" else kind
            heavy = m >= 2048
            n0, k0 = next(iter(SHAPES.values()))
            cfgs = candidates(kind, m, k0)
            w0 = quantized(base, n0, k0)
            x0 = torch.randn(17, k0, device=DEVICE, dtype=torch.bfloat16)
            precompile([partial(ours(kind, c, True), x0, *w0) for c in cfgs])
            for layer, (n, k) in SHAPES.items():
                ring = make_ring(base, n, k, heavy)
                x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
                res = []
                for c in candidates(kind, m, k):
                    try:
                        res.append((time_ring(partial(ours(kind, c), x), ring, heavy), c))
                    except Exception as e:  # noqa: BLE001
                        print(f"  {kind} {layer} M={m} {tuple(c)}: {type(e).__name__}: {e}")
                t_lib = time_ring(partial(lib_gemm(kind), x), ring, heavy)
                t16 = time_ring(
                    partial(F.linear, x),
                    [(torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16),)] * 2,
                    heavy,
                )
                picked = mg.pick_config(kind, m, n, k, x.device)
                t_pick = (
                    time_ring(partial(ours(kind, picked), x), ring, heavy) if picked else math.nan
                )
                qw, s, o = ring[0]
                ref = w8a8_exact(x, qw, s) if kind == "w8a8" else exact_ref(kind, x, qw, s, o)
                for t_best, best in sorted(res):
                    err = rel_err(ours(kind, best)(x, qw, s, o), ref)
                    if err < 2e-2:
                        break
                    print(f"      {tuple(best)} {t_best * 1e6:.1f} us is WRONG: {err:.2e}")
                else:
                    continue
                winner = tuple(best) if t_best <= t_lib else None
                tuned[(kind, n, k, m)] = winner
                print(
                    f"{kind:4} {layer:7} M={m:5}: best {t_best * 1e6:7.1f} us {tuple(best)} | "
                    f"picked {t_pick * 1e6:7.1f} | lib {t_lib * 1e6:7.1f} | bf16 {t16 * 1e6:7.1f} "
                    f"-> {winner}; next: "
                    + "; ".join(f"{tuple(c)} {t * 1e6:.1f}" for t, c in sorted(res)[1:3]),
                    flush=True,
                )
                SUMMARY[f"sweep_{kind}_{layer}_{m}"] = {
                    "best_us": t_best * 1e6, "best": tuple(best), "lib_us": t_lib * 1e6,
                    "picked_us": t_pick * 1e6, "bf16_us": t16 * 1e6,
                }  # fmt: skip
                del ring, x
            torch.cuda.empty_cache()
    return tuned


def print_tuned(tuned: dict, out_dir: str) -> None:
    print("\nTUNED_CONFIGS = {")
    for key, cfg in tuned.items():
        print(f"    {key!r}: {cfg!r},")
    print("}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "mixed_gemm_tuned.txt"), "w") as f:
        f.write("".join(f"    {k!r}: {v!r},\n" for k, v in tuned.items()))


def weight_gib(llm) -> float:
    from roofline.layers.linear import MergedLinear

    model = llm.llm_engine.runner.model
    return (
        sum(m.method.weight_bytes(m) for m in model.modules() if isinstance(m, MergedLinear))
        / 2**30
    )


@section("engine")
def engine(ceil, methods: list[str], num_requests: int) -> None:
    from roofline import LLM, SamplingParams
    from roofline.bench import latency, throughput, workloads

    for method in methods:
        llm = None
        try:
            t0 = time.perf_counter()
            llm = LLM(
                MODEL, load_format="dummy", device=DEVICE, max_model_len=4096,
                max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
                quantization=None if method == "bf16" else method,
            )  # fmt: skip
            startup = time.perf_counter() - t0
            rows = latency.run(llm.llm_engine, ceil, list(STEP_BATCHES), 128, 32)
            steps = {r.batch_size: r.step_ms_p50 for r in rows}
            vocab = llm.llm_engine.model_config.vocab_size
            wl = workloads.synthetic(num_requests, (100, 1024), (OUTPUT_LEN, OUTPUT_LEN), vocab)
            warm = [[7] * n for n in WARM_LENS]  # prefill sizes: compiled before the clock
            llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False)
            res = throughput.run(llm, ceil, wl, use_tqdm=False)
            SUMMARY[f"engine_{method}"] = {
                "startup_s": startup, "step_ms": steps, "out_tok_s": res.output_tok_s,
                "pct_roofline": res.roofline_pct, "jit": res.jit_compiles,
            }  # fmt: skip
            TABLE.append(
                f"{method:9} weights {weight_gib(llm):5.2f} GiB, start-up {startup:4.1f} s, "
                "step ms "
                + " ".join(f"b{b} {t:.2f}" for b, t in steps.items())
                + f"; offline {res.output_tok_s:6.0f} "
                f"out tok/s ({res.elapsed_s:.1f} s, {res.roofline_pct:.0f}% of its roofline, "
                f"jit during run: {len(res.jit_compiles)})"
            )
            print(TABLE[-1], flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"engine {method} FAILED: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        finally:
            llm = None
            gc.collect()
            torch.cuda.empty_cache()
    base = SUMMARY.get("engine_bf16")
    if base:
        for method in methods[1:]:
            got = SUMMARY.get(f"engine_{method}")
            if got:
                TABLE.append(
                    f"offline {method} / bf16: {got['out_tok_s'] / base['out_tok_s']:.2f}x"
                )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="parity and GEMMs only (about 60 s)")
    ap.add_argument(
        "--sweep", action="store_true", help="config sweep, installed for the engine runs"
    )
    ap.add_argument("--sweep-budget", type=float, default=45.0, help="seconds for the sweep")
    ap.add_argument("--sweep-m", default="128,32,256,2048,64,8192", help="M values, in order")
    ap.add_argument("--sweep-kinds", default="int4,int8,w8a8,fp8", help="methods, in order")
    ap.add_argument("--requests", type=int, default=256, help="offline throughput requests")
    ap.add_argument("--methods", default="bf16,int8,int4,fp8-w8a8", help="engine runs")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.perf_counter()
    from roofline.bench.ceilings import measure

    ceil = measure(torch.device("cuda"), torch.bfloat16)
    bw, mm = ceil.bandwidth_bytes_per_s, ceil.matmul_flops_per_s
    print(
        f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, "
        f"bf16 matmul {mm / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    parity()
    if args.sweep:
        ms = [int(v) for v in args.sweep_m.split(",")]
        tuned = sweep(args.sweep_budget, ms, args.sweep_kinds.split(",")) or {}
        print_tuned(tuned, args.out)
        mg.TUNED_CONFIGS.update(tuned)
    gemms(bw, mm, args.quick)
    if not args.quick:
        engine(ceil, args.methods.split(","), args.requests)
    print(
        f"\n=== summary ({time.perf_counter() - t0:.0f} s, copy {bw / 1e12:.2f} TB/s, "
        f"matmul {mm / 1e12:.0f} TFLOP/s)"
    )
    print("\n".join(TABLE))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_mixedgemm.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
