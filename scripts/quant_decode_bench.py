"""Decode-GEMV sections of ``scripts/gpu_quant.py`` (H100, Llama-3.1-8B shapes): GPU parity of
``kernels.int4_gemv`` against its plain-torch reference, the per-shape table (bf16 skinny GEMM,
int8 ``quant_gemv``, int4 ``quant_gemv`` and int4 ``int4_gemv`` at M = 1, 4, 16: us, GB/s of
the bytes each reads, % of the copy bandwidth), and the ``int4_gemv`` config sweep (``--sweep``),
whose winners are installed into ``int4_gemv.TUNED_CONFIGS`` for the decode runs that follow.

Weights cycle through a ring of copies (>= 256 MiB) inside one CUDA graph, so no call is served
from L2."""

from __future__ import annotations

import math
import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
import triton

from roofline.kernels import int4_gemv, quant_gemv
from roofline.kernels.activation import silu_and_mul, silu_and_mul_ref
from roofline.kernels.gemv import skinny_gemm
from roofline.kernels.int4_gemv import Int4GemvConfig
from roofline.quantization import formats

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FOCUS = False  # --focus: one row, a few configs around the installed ones (a short second run)
FOCUS_CONFIGS = [  # one row: the installed winners' families, two stages, K parts on the grid
    Int4GemvConfig(*c)
    for c in [
        (128, 8, 4, 4, 2), (128, 8, 4, 4, 3), (128, 8, 2, 4, 2), (128, 8, 2, 4, 3),
        (64, 16, 1, 4, 2), (64, 16, 1, 4, 4), (64, 16, 2, 4, 2), (128, 8, 1, 4, 2, 2),
        (128, 4, 2, 4, 2, 2), (128, 4, 2, 4, 3, 2), (128, 4, 1, 4, 3, 4), (64, 4, 2, 4, 2, 4),
        (64, 8, 1, 4, 3, 2), (128, 4, 4, 4, 2, 2),
    ]
]  # fmt: skip
FOCUS_PROLOGUE = [
    Int4GemvConfig(*c)
    for c in [
        (128, 4, 1, 4, 3), (128, 4, 2, 4, 3), (128, 8, 1, 4, 3), (64, 8, 1, 4, 3),
        (128, 4, 1, 4, 3, 2), (128, 2, 2, 4, 3, 2), (128, 2, 1, 4, 3),
    ]
]  # fmt: skip
RING_BYTES = 256 << 20
DEVICE = "cuda"


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()


def time_graph(calls: list, iters: int = 10) -> float:
    """Median seconds per call over ``iters`` replays of one CUDA graph of ``calls``."""
    for call in calls:
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


def time_ring(fn, weights: list[tuple]) -> float:
    """Seconds per ``fn(*w)`` with w cycling through the ring (one CUDA graph)."""
    calls = max(len(weights), 8)
    return time_graph([partial(fn, *weights[i % len(weights)]) for i in range(calls)])


def precompile(fns: list) -> None:
    """First calls on a thread pool (Triton's async compile); errors surface when timed."""
    if not hasattr(triton, "AsyncCompileMode"):
        return
    with (
        ThreadPoolExecutor(os.cpu_count() or 4) as pool,
        triton.AsyncCompileMode(pool, ignore_errors=True),
    ):
        for fn in fns:
            try:
                fn()
            except Exception:  # noqa: BLE001 - reported when the config is timed
                pass


def int4_weight(n: int, k: int, group: int = 128, symmetric: bool = False, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.randn(n, k, device=DEVICE, generator=gen) * 0.02
    q = formats.quantize_int4(w, group, symmetric, torch.bfloat16)
    words = int4_gemv.repack_int4(q.qweight)
    return q, words, int4_gemv.pack_scales(q.scales, q.offsets)


def parity() -> float:
    """int4_gemv (picked config) against the fp32 reference: 8B shapes, groups, M, dtypes."""
    worst = 0.0
    cases = [
        ("down", 128, False, torch.bfloat16), ("qkv", 128, True, torch.bfloat16),
        ("o", 64, False, torch.float16), ("o", 32, True, torch.bfloat16),
    ]  # fmt: skip
    for layer, group, sym, dtype in cases:
        n, k = SHAPES[layer]
        q, words, pairs = int4_weight(n, k, group, sym, seed=3)
        if dtype == torch.float16:
            q = q._replace(scales=q.scales.half(), offsets=q.offsets.half())
            pairs = int4_gemv.pack_scales(q.scales, q.offsets)
        bias = torch.randn(n, device=DEVICE, dtype=dtype)
        errs = []
        for m in (1, 3, 16):
            x = torch.randn(m, k, device=DEVICE, dtype=dtype)
            ref = int4_gemv.int4_gemv_ref(x, q.qweight, q.scales, q.offsets, bias)
            errs.append(rel_err(int4_gemv.int4_gemv(x, words, pairs, bias), ref))
        if layer == "down":
            gate_up = torch.randn(1, 2 * k, device=DEVICE, dtype=dtype)
            ref = int4_gemv.int4_gemv_ref(silu_and_mul_ref(gate_up), q.qweight, q.scales, q.offsets)
            errs.append(rel_err(int4_gemv.int4_gemv(gate_up, words, pairs, silu_mul=True), ref))
        worst = max(worst, *errs)
        print(
            f"int4_gemv {layer:7} g{group:3} {'sym ' if sym else 'asym'} {str(dtype)[6:]:8}: "
            "max rel err at M=1/3/16"
            + ("/silu" if layer == "down" else "")
            + ": "
            + " ".join(f"{e:.1e}" for e in errs),
            flush=True,
        )
    back = int4_gemv.unrepack_int4(words)
    print(f"repack round trip exact on the GPU: {torch.equal(back, q.qweight)}")
    return worst


def candidates(m: int) -> list[Int4GemvConfig]:
    """Configs for the sweep at M rows: the MMA's columns (K-slices x M's bucket) 8 to 32."""
    if FOCUS:
        return FOCUS_CONFIGS
    bm = min(16, triton.next_power_of_2(m))
    ksplits = sorted({max(1, c // bm) for c in (8, 16, 32)} | ({4} if bm == 1 else set()))
    shapes = [(32, 2), (64, 4), (64, 2), (128, 4)] if m == 1 else [(32, 2), (64, 4)]
    tiles = (1, 2, 4) if m == 1 else (1, 2)
    stages = (2, 3, 4) if m == 1 else (2, 3)
    split_k = [  # K parts over the grid: more rows a program, less x per program
        Int4GemvConfig(bn, ks, t, w, st, kg)
        for bn, w in ((64, 4), (128, 4)) for ks, kg in ((4, 2), (4, 4), (2, 4), (8, 2))
        for t in (1, 2) for st in (2, 3)
    ] if m == 1 else []  # fmt: skip
    return [
        Int4GemvConfig(bn, ks, t, w, st)
        for bn, w in shapes for ks in ksplits for t in tiles for st in stages
        if bn // ks >= 1 and ks * bm <= 32
    ] + split_k  # fmt: skip


def sweep(
    bits: int, layer: str, x: torch.Tensor, ring: list, ref: torch.Tensor, copy_bw: float
) -> tuple[float, Int4GemvConfig]:
    """Times every candidate config on the ring of (words, pairs); returns (seconds, config) of
    the fastest one whose result matches ``ref`` (nan and the heuristic's if none)."""
    w0, p0 = ring[0]
    m, n, k = x.shape[0], w0.shape[0], w0.shape[1] * 32 // bits
    group = k // p0.shape[1]
    heur = int4_gemv.heuristic_config(n, k, group, m, 132)
    cands = candidates(m) if bits == 4 else candidates8(m)
    cfgs = [heur] + [c for c in cands if c != heur and int4_gemv._resolve(c, k, group) is not None]
    run = partial(int4_gemv.int4_gemv, x, bits=bits)
    precompile([partial(run, w0, p0, config=c, warmup=True) for c in cfgs])
    results = []
    for cfg in cfgs:
        try:
            results.append((time_ring(lambda w, p, cfg=cfg: run(w, p, config=cfg), ring), cfg))
        except Exception as e:  # noqa: BLE001
            print(f"  int{bits} gemv {layer} M={m} {tuple(cfg)}: {type(e).__name__}: {e!s:.90}")
    for t, cfg in sorted(results):
        err = rel_err(run(w0, p0, config=cfg), ref)
        if err < 1e-2:
            break
        print(f"      {tuple(cfg)} {t * 1e6:.1f} us is WRONG: max rel error {err:.2e}")
    else:
        return math.nan, heur
    top = "; ".join(f"{tuple(c)} {s * 1e6:.1f}" for s, c in sorted(results)[:4])
    t_heur = next((s for s, c in results if c == heur), math.nan)
    top += f" | heuristic {tuple(heur)} {t_heur * 1e6:.1f}"
    gbs = nbytes(w0, p0) / t / 1e9
    print(f"  sweep int{bits} gemv {layer:7} M={m:2}: best {t * 1e6:6.1f} us {gbs:5.0f} GB/s "
          f"({100 * gbs * 1e9 / copy_bw:3.0f}%) {tuple(cfg)} | top: {top}", flush=True)  # fmt: skip
    return t, cfg


def prologue_sweep(prologue: str, bits: int, x: torch.Tensor, ring: list, **kw) -> tuple:
    """A few configs for a GEMV with a prologue at one row ("silu": x = gate_up; "norm": x the
    residual stream, ``kw`` its ``norm``): its x costs more per program, so fewer K-slices and
    more rows. Returns (seconds, config) of the fastest whose result matches the unfused path."""
    from roofline.kernels.rmsnorm import rms_norm

    cfgs = FOCUS_PROLOGUE if FOCUS else [
        Int4GemvConfig(bn, ks, t, w, 3, kg)
        for bn, w in ((64, 4), (128, 4)) for ks in (2, 4, 8) for t in (1, 2) for kg in (1, 2)
    ]  # fmt: skip
    w0, p0 = ring[0]
    k = w0.shape[1] * 32 // bits
    group = k // p0.shape[1]
    cfgs = [c for c in cfgs if int4_gemv._resolve(c, k, group) is not None]
    run = partial(int4_gemv.int4_gemv, x, silu_mul=prologue == "silu", bits=bits, **kw)
    precompile([partial(run, w0, p0, config=c, warmup=True) for c in cfgs])
    results = sorted(
        (time_ring(lambda w, p, cfg=cfg: run(w, p, config=cfg), ring), cfg) for cfg in cfgs
    )
    print(
        f"  sweep int{bits} {prologue}-fused M= 1: "
        + "; ".join(f"{tuple(c)} {t * 1e6:.1f} us" for t, c in results[:4]),
        flush=True,
    )
    plain_x = silu_and_mul(x) if prologue == "silu" else rms_norm(x, *kw["norm"])
    ref = int4_gemv.int4_gemv(plain_x, w0, p0, bits=bits)
    for t, cfg in results:  # the fastest whose result matches the unfused path
        if rel_err(run(w0, p0, config=cfg), ref) < 1e-2:
            return t, cfg
        print(f"      {tuple(cfg)} is WRONG")
    return math.nan, int4_gemv.prologue_heuristic(k, group)


def prologue_figures(
    layer: str, n: int, k: int, rings: dict, fig: dict, tuned: dict, sweep: bool
) -> None:
    """One row: the GEMV with its prologue fused (the fused decode layer's kernel) vs the
    prologue's own kernel (rms_norm / silu_and_mul) and the GEMV, for int4 and int8."""
    from roofline.kernels.rmsnorm import rms_norm

    prologue = "silu" if layer == "down" else "norm"
    if prologue == "silu":
        x = torch.randn(1, 2 * k, device=DEVICE, dtype=torch.bfloat16)
        kw: dict = {}
        apart = silu_and_mul
    else:
        x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        norm_w = torch.rand(k, device=DEVICE, dtype=torch.bfloat16) + 0.5
        kw = {"norm": (norm_w, 1e-5)}
        apart = partial(rms_norm, weight=norm_w, eps=1e-5)
    for bits, ring in rings.items():
        group = 128 if bits == 4 else k
        if sweep:
            t, cfg = prologue_sweep(prologue, bits, x, ring, **kw)
            if not math.isnan(t):
                tuned[(prologue, bits, n, k, group, 1)] = tuple(cfg)
                int4_gemv.PROLOGUE_TUNED_CONFIGS[(prologue, bits, n, k, group, 1)] = tuple(cfg)
        fused = partial(int4_gemv.int4_gemv, x, silu_mul=prologue == "silu", bits=bits, **kw)
        fig[f"int{bits} {prologue} fused"] = (time_ring(fused, ring), nbytes(*ring[0]))
        fig[f"int{bits} {prologue}+gemv"] = (
            time_ring(lambda w, p, b=bits: int4_gemv.int4_gemv(apart(x), w, p, bits=b), ring),
            nbytes(*ring[0]),
        )


def candidates8(m: int) -> list[Int4GemvConfig]:
    """int8 (two nibble planes): a smaller set, one row only."""
    return [
        Int4GemvConfig(bn, ks, t, w, st)
        for bn, w in ((32, 2), (64, 4), (128, 4)) for ks in (4, 8, 16) for t in (1, 2)
        for st in (2, 3, 4)
        if bn // ks >= 1
    ]  # fmt: skip


def shape_table(
    copy_bw: float, ms: tuple[int, ...], sweep_ms: tuple[int, ...] = ()
) -> tuple[dict, list[str]]:
    """Per 8B shape and M: bf16 skinny, int8 quant_gemv, int8 and int4 over int4_gemv's repacked
    layouts, int4 quant_gemv (with sweep_ms, int4_gemv's configs swept first at those M, int8's
    at M = 1). Returns the tuned configs (also installed into int4_gemv.TUNED_CONFIGS) and the
    table's lines."""
    tuned: dict[tuple[int, ...], tuple[int, ...]] = {}
    rows: list[str] = []
    for layer, (n, k) in SHAPES.items():
        q4, words4, pairs4 = int4_weight(n, k)
        copies = max(2, math.ceil(RING_BYTES / nbytes(words4, pairs4)))
        ring4 = [(words4.clone(), pairs4.clone()) for _ in range(copies)]
        canon4 = [(q4.qweight.clone(), q4.scales.clone(), q4.offsets.clone()) for _ in ring4]
        w16 = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
        ring16 = [(w16.clone(),) for _ in range(max(2, math.ceil(RING_BYTES / nbytes(w16))))]
        q8 = formats.quantize_int8(w16.float(), k, torch.bfloat16)
        copies8 = max(2, math.ceil(RING_BYTES / nbytes(q8.qweight, q8.scales)))
        ring8 = [(q8.qweight.clone(), q8.scales.clone(), None) for _ in range(copies8)]
        words8, pairs8 = int4_gemv.repack_int8(q8.qweight), int4_gemv.pack_scales(q8.scales, None)
        ring8n = [(words8.clone(), pairs8.clone()) for _ in range(copies8)]
        w8 = formats.dequantize_int8(q8.qweight, q8.scales, torch.float32)  # [N, K]
        for m in sorted(set(ms) | set(sweep_ms)):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            bucket = min(16, triton.next_power_of_2(m))
            fig: dict[str, tuple[float, int]] = {}
            sweeps = [(4, ring4, int4_gemv.int4_gemv_ref(x, q4.qweight, q4.scales, q4.offsets))]
            if m == 1 and not FOCUS:
                sweeps.append((8, ring8n, (x.float() @ w8.T).to(x.dtype)))
            for bits, ring, ref in sweeps if m in sweep_ms else []:
                t, cfg = sweep(bits, layer, x, ring, ref, copy_bw)
                if not math.isnan(t):
                    group = 128 if bits == 4 else k
                    tuned[(bits, n, k, group, bucket)] = tuple(cfg)
                    int4_gemv.TUNED_CONFIGS[(bits, n, k, group, bucket)] = tuple(cfg)
            if m not in ms:
                continue
            new4, new8 = partial(int4_gemv.int4_gemv, x), partial(int4_gemv.int4_gemv, x, bits=8)
            fig["bf16"] = (time_ring(partial(skinny_gemm, x), ring16), nbytes(w16))
            fig["int8 qgemv"] = (
                time_ring(partial(quant_gemv.quant_gemv, "int8", x), ring8),
                nbytes(*ring8[0]),
            )
            fig["int8 new"] = (time_ring(new8, ring8n), nbytes(*ring8n[0]))
            fig["int4 qgemv"] = (
                time_ring(partial(quant_gemv.quant_gemv, "int4", x), canon4),
                nbytes(*canon4[0]),
            )
            fig["int4 new"] = (time_ring(new4, ring4), nbytes(*ring4[0]))
            if m == 1 and layer != "o":  # the fused decode layer's prologue GEMVs
                rings = {4: ring4, 8: ring8n}
                prologue_figures(layer, n, k, rings, fig, tuned, m in sweep_ms)
            for bits, old, new in ((4, "int4 qgemv", "int4 new"), (8, "int8 qgemv", "int8 new")):
                if fig[old][0] < fig[new][0]:  # the decode runs below take quant_gemv here
                    int4_gemv.TUNED_CONFIGS[(bits, n, k, 128 if bits == 4 else k, bucket)] = None
                    tuned[(bits, n, k, 128 if bits == 4 else k, bucket)] = None
            line = f"{layer:7} M={m:2}: " + " | ".join(
                f"{name} {t * 1e6:6.1f} us {b / t / 1e9:5.0f} GB/s {100 * b / t / copy_bw:3.0f}%"
                for name, (t, b) in fig.items()
            )
            rows.append(line)
            print(line, flush=True)
        del ring4, canon4, ring16, ring8, ring8n
        torch.cuda.empty_cache()
    print("\nper-shape decode GEMV (GB/s of the bytes each kernel reads; % of copy):")
    print("\n".join(rows))
    if tuned:
        print("\nint4_gemv.TUNED_CONFIGS = {")
        for key, cfg in tuned.items():
            print(f"    {key!r}: {cfg!r},")
        print("}")
    return tuned, rows


def profile_engine(engine, label: str, steps: int = 20) -> list[str]:
    """Kernel time per batch-1 decode step by kernel name (torch.profiler), against the step's
    wall time: where the quantized step's time goes beside its GEMVs."""
    import collections
    import time

    from torch.profiler import ProfilerActivity, profile

    from roofline import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=10 + 3 * steps, ignore_eos=True)
    engine.add_request(f"profile-{label}", [(7 * j) % 1000 + 10 for j in range(128)], params)
    for _ in range(10):  # prefill and settle
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / steps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name].append(e.device_time)
    busy = sum(sum(v) for v in per_name.values()) / steps
    count = sum(len(v) for v in per_name.values()) / steps
    lines = [
        f"profile {label} batch 1: wall {wall_us:.0f} us/step, kernels {busy:.0f} us/step, "
        f"{count:.0f} kernels/step"
    ]
    for name, times in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:12]:
        lines.append(
            f"  {sum(times) / steps:8.1f} us/step {len(times) / steps:5.0f}x "
            f"{sum(times) / len(times):7.1f} us  {name[:80]}"
        )
    print("\n".join(lines), flush=True)
    return lines
