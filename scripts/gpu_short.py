"""Issue 13's unquantized GEMM dispatch by row count, on the GPU: Llama-3.1-8B config, random
bf16 weights. Sections, in order (each in try/except: an error is printed and the next runs):

0. every descriptor-GEMM config compiled at once (a dry run on a thread pool);
1. parity on the GPU: the descriptor GEMM (``kernels/dense_gemm.py``) per config (one program
   per tile, persistent, warp-specialized, split-K) vs torch at the four layer shapes (two
   launches of split-K bit-equal), and ``layers.gemm_rows``'s padded path
   vs plain ``F.linear``;
2. the cuBLAS sweep (``F.linear``, bf16): qkv 4096->6144, o 4096->4096, gate_up
   4096->28672, down 14336->4096 at M = 1, 8, 16 .. 1024, then every 64 to 2048, 4096, 8192,
   each GEMM replayed from a CUDA graph over enough weight copies that no weight is in L2;
   with the default BLAS backend and with ``preferred_blas_library('cublaslt')``; per shape
   the row counts >= 1.15x slower than the best padded count of M .. M + 64; the LM head too
   (up to 512 rows); the raw times as ``SWEEP`` lines;
3. the descriptor GEMM per config at the decode-graph buckets from 128
   rows, the mixed-graph buckets and 2048 rows, each beside cuBLAS timed again;
4. the dispatch table derived from 2-3 (``--plans measured``, compared with the shipped
   ``PLANS``; ``--plans shipped`` keeps the module's; ``--plans off`` turns the dispatch off),
   printed as a Python literal, and its time per bucket against plain cuBLAS;
5. the engine with that table: the short, default and shared-prefix presets with dispatch on,
   off, on again (graphs captured again at each switch: same-run comparisons), GPU time by
   step kind (decode graph / mixed graph by bucket / eager mixed / big prefill); then a
   kernel-time split (GEMM / attention / other) of two mixed-bucket graph replays and the
   256-row decode graph;
6. 8B batch-1 decode (regression: >= 169 tok/s).

A table last; the raw sweep and results as JSON into $OUT/short.json.

    python scripts/gpu_short.py            # everything (~150 s)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import time
from collections import Counter, defaultdict

import torch
import torch.nn.functional as F
from gpu_common import print_rows, rows_and_sections  # scripts/ is on sys.path when run as a script
from gpu_presets import PhaseClock

from roofline import LLM
from roofline.bench import latency, throughput, workloads
from roofline.bench.ceilings import measure
from roofline.kernels.activation import silu_and_mul
from roofline.kernels.dense_gemm import dense_gemm, dense_gemm_ref
from roofline.kernels.dense_gemm_configs import DenseGemmConfig
from roofline.kernels.dense_gemm_silu import dense_gemm_silu, dense_gemm_silu_ref
from roofline.layers import gemm_rows
from roofline.layers.gemm_rows import Band, Chunks, Lt, Pad, Tiles
from roofline.layers.linear import linear

DEV = torch.device("cuda")
BF16 = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS_GRID = [1] + list(range(8, 1025, 8)) + list(range(1088, 2049, 64)) + [4096, 8192]
HEAD = {"lm_head": (128256, 4096)}
"""Swept too (cuBLAS only), at the row counts it meets: one per request of a step."""
HEAD_GRID = [1] + list(range(8, 513, 8))
ALL_SHAPES = SHAPES | HEAD
TRITON_ROWS = list(range(128, 257, 16)) + list(range(320, 1025, 64)) + [2048]
"""The decode-graph buckets from 128 rows, the mixed-graph buckets, a prefill chunk."""
CONFIGS = [  # each the fastest somewhere in the first two checks (stream-K, measured 1.3-2x
    # slower than one program per tile at every count, was dropped)
    DenseGemmConfig(64, 128, 64, 8, 4, 4, 0),
    DenseGemmConfig(64, 256, 64, 8, 4, 4, 0),
    DenseGemmConfig(128, 128, 64, 8, 4, 4, 1),
    DenseGemmConfig(128, 256, 64, 8, 8, 3, 1),
    DenseGemmConfig(128, 256, 64, 8, 8, 3, 2),
]
SPLIT_CONFIGS = [  # timed at row counts <= SPLIT_MAX_ROWS only
    DenseGemmConfig(128, 128, 64, 8, 4, 4, 0, 2),
    DenseGemmConfig(128, 128, 64, 8, 4, 4, 0, 4),
]
SPLIT_MAX_ROWS = 512
SILU_CONFIGS = [  # gate_up with the SiLU-and-mul in the epilogue (kernels/dense_gemm_silu.py)
    DenseGemmConfig(128, 128, 64, 8, 8, 3, 0),
    DenseGemmConfig(128, 128, 64, 8, 8, 3, 1),
    DenseGemmConfig(64, 128, 64, 8, 4, 4, 0),
    DenseGemmConfig(128, 64, 64, 8, 4, 4, 0),
    DenseGemmConfig(64, 256, 64, 8, 8, 2, 0),
]
TILES_MIN_GAIN = 0.92
"""A descriptor-GEMM band needs <= this time ratio against cuBLAS timed beside it (runs of one
GEMM differ by a few % between sections)."""
ROWS: list[tuple[str, str]] = []
RESULTS: dict[str, object] = {}
WEIGHTS: dict[str, list[torch.Tensor]] = {}


row, section = rows_and_sections(ROWS)


def weights(name: str) -> list[torch.Tensor]:
    """Copies of the shape's weight, together > 150 MB (each call reads one not in L2)."""
    if name not in WEIGHTS:
        n, k = ALL_SHAPES[name]
        copies = max(1, -(-(150 << 20) // (n * k * 2)))
        gen = torch.Generator(device=DEV).manual_seed(1)
        WEIGHTS[name] = [
            (torch.randn(n, k, device=DEV, generator=gen) / k**0.5).to(BF16) for _ in range(copies)
        ]
    return WEIGHTS[name]


X_ALL = {}


def x_rows(k: int, m: int) -> torch.Tensor:
    if k not in X_ALL:
        gen = torch.Generator(device=DEV).manual_seed(2)
        X_ALL[k] = torch.randn(max(ROWS_GRID) + 64, k, device=DEV, generator=gen).to(BF16)
    return X_ALL[k][:m]


def graph_us(fn, ws: list[torch.Tensor], reps: int = 6, replays: int = 3) -> float:
    """Microseconds per call of ``fn(w)`` replayed from a CUDA graph of ``reps`` calls cycling
    over ``ws`` (median of ``replays`` timed replays after one warm-up)."""
    fn(ws[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(ws[i % len(ws)])
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    del graph
    return sorted(times)[len(times) // 2]


def cublas_us(name: str, m: int) -> float:
    x = x_rows(ALL_SHAPES[name][1], m)
    return graph_us(lambda w: F.linear(x, w), weights(name))


@section("0. compile every descriptor-GEMM config at once (a dry run on a thread pool)")
def compile_all() -> None:
    from roofline.kernels.parallel_compile import ParallelCompiler

    compiler = ParallelCompiler()
    compiler.prepare()
    try:
        with compiler.dry_run():
            for name, (_, k) in SHAPES.items():
                for cfg in CONFIGS + SPLIT_CONFIGS:
                    dense_gemm(x_rows(k, 448), weights(name)[0], cfg)
            for cfg in SILU_CONFIGS:
                dense_gemm_silu(x_rows(4096, 448), weights("gate_up")[0], cfg)
        stats = compiler.finish(wait=True)
        row("compiled", f"{stats.num_kernels} specialisations, {stats.num_failed} failed")
    finally:
        compiler.close(wait=True)


@section("1. parity on the GPU: descriptor GEMM and padded cuBLAS vs torch")
def parity() -> None:
    for name, (n, k) in SHAPES.items():
        x = x_rows(k, 448)
        w = weights(name)[0]
        ref = dense_gemm_ref(x, w).float()
        worst = 0.0
        for cfg in CONFIGS + SPLIT_CONFIGS:
            try:
                out = dense_gemm(x, w, cfg).float()
                worst = max(worst, (out - ref).abs().max().item())
                fixup = cfg.split_k > 1
                if fixup and not torch.equal(dense_gemm(x, w, cfg).float(), out):
                    row(f"parity {name} {tuple(cfg)}", "fix-up NOT deterministic")
            except Exception as e:  # noqa: BLE001 - a config may not compile
                print(f"  {name} {tuple(cfg)}: {type(e).__name__}: {str(e)[:200]}")
        pad = gemm_rows.run(x[:437], w, None, Band(1, 448, Pad(512))).float()
        pad_err = (pad - ref[:437]).abs().max().item()
        cub_err = (F.linear(x, w).float() - ref).abs().max().item()
        row(
            f"parity {name} [{n}x{k}] 448 rows",
            f"descriptor GEMM max|diff| {worst:.1e}, padded cuBLAS {pad_err:.1e}, cuBLAS "
            f"{cub_err:.1e} (vs fp32 products rounded once) -> "
            f"{'OK' if worst < 0.05 and pad_err < 0.05 else 'MISMATCH'}",
        )


@section("1b. parity on the GPU: gate_up with the SiLU-and-mul epilogue vs the unfused path")
def parity_silu() -> None:
    x, w = x_rows(4096, 448), weights("gate_up")[0]
    ref = dense_gemm_silu_ref(x, w).float()
    unfused = silu_and_mul(F.linear(x, w)).float()
    for cfg in SILU_CONFIGS:
        try:
            err = (dense_gemm_silu(x, w, cfg).float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001 - a config may not compile
            row(f"parity silu epilogue {tuple(cfg)}", f"{type(e).__name__}: {str(e)[:160]}")
            continue
        row(
            f"parity silu epilogue {tuple(cfg)}",
            f"max|diff| {err:.1e} (cuBLAS + silu_and_mul {(unfused - ref).abs().max().item():.1e})"
            f" -> {'OK' if err < 0.05 else 'MISMATCH'}",
        )


@section("2. cuBLAS sweep (F.linear, bf16, weights not in L2, CUDA-graph timed)")
def sweep(ceil) -> dict[str, dict[str, dict[int, float]]]:
    res: dict[str, dict[str, dict[int, float]]] = {}
    for backend in ("default", "cublaslt"):
        saved = torch.backends.cuda.preferred_blas_library()
        if backend == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            print(f"  backend {backend} ({torch.backends.cuda.preferred_blas_library()})")
            res[backend] = {
                name: {m: cublas_us(name, m) for m in (HEAD_GRID if name in HEAD else ROWS_GRID)}
                for name in ALL_SHAPES
            }
        finally:
            torch.backends.cuda.preferred_blas_library(saved)
    for name, (n, k) in ALL_SHAPES.items():
        t = res["default"][name]
        lt = res["cublaslt"][name]
        bad = []
        for m in t:
            if m > 1024:
                continue
            cands = [mm for mm in t if m <= mm <= m + 64]
            best = min(cands, key=lambda mm: t[mm])
            if t[m] >= 1.15 * t[best]:
                bad.append(f"{m}:{t[m]:.0f}->{best}:{t[best]:.0f}")
        row(f"cuBLAS {name} slow counts (M:us->padded M:us)", " ".join(bad) or "none")
        ltwins = [f"{m}:{t[m]:.0f}/{lt[m]:.0f}" for m in t if lt[m] < 0.9 * t[m]]
        row(f"cuBLASLt >=10% faster at {name} (M:default/lt us)", " ".join(ltwins) or "none")
        floor_b = n * k * 2 / ceil.bandwidth_bytes_per_s
        pts = [m for m in t if m in (1, 64, 128, 256) or m % 128 == 0]
        eff = []
        for m in pts:
            ideal = max(2 * m * n * k / ceil.matmul_flops_per_s, floor_b)
            eff.append(f"{m}:{t[m]:.0f}({100 * ideal * 1e6 / t[m]:.0f}%)")
        row(f"cuBLAS {name} us (% of roofline) by M", " ".join(eff))
    RESULTS["sweep"] = res
    for backend, shapes in res.items():  # raw, for offline bucket choices
        for name, t in shapes.items():
            print(f"SWEEP {backend} {name} " + " ".join(f"{m}:{v:.1f}" for m, v in t.items()))
    return res


@section("3. descriptor GEMM per config at the engine's row counts")
def triton_sweep(cub: dict) -> dict[str, dict[int, tuple[float, DenseGemmConfig]]]:
    best: dict[str, dict[int, tuple[float, DenseGemmConfig]]] = {}
    raw: dict[str, dict] = {}
    print("  configs in order: " + " ".join(str(tuple(c)) for c in CONFIGS + SPLIT_CONFIGS))
    for name, (_, k) in ALL_SHAPES.items():
        best[name] = {}
        rows = TRITON_ROWS + ([8192] if name == "down" else [])
        for m in [128, 256] if name in HEAD else rows:
            x = x_rows(k, m)
            times = {}
            for cfg in CONFIGS + (SPLIT_CONFIGS if m <= SPLIT_MAX_ROWS else []):
                try:
                    times[cfg] = graph_us(lambda w, c=cfg: dense_gemm(x, w, c), weights(name))  # noqa: B023
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} {m} {tuple(cfg)}: {type(e).__name__}: {str(e)[:120]}")
            if not times:
                continue
            cfg = min(times, key=times.get)
            c = cublas_us(name, m)  # timed beside the tiles: the ratio is what counts
            best[name][m] = (times[cfg] / c, cfg)
            raw[f"{name} {m}"] = {str(tuple(c)): round(t, 1) for c, t in times.items()}
            print(
                f"  {name:8s} M={m:5d}: cuBLAS {c:7.1f} us | best tiles {times[cfg]:7.1f} "
                f"{tuple(cfg)} ({c / times[cfg]:.2f}x) | "
                + " ".join(f"{t:.0f}" for t in times.values()),
                flush=True,
            )
    RESULTS["triton"] = raw
    return best


def derive(cub: dict, tiles: dict) -> dict[tuple[int, int], list[Band]]:
    """Per shape and grid row count, the fastest of: cuBLAS at M, cuBLASLt at M, cuBLAS padded to
    a grid count <= M + 64 (+ the pad's copy), cuBLAS on blocks of 2048 / 4096 rows (4096 and
    8192 rows), the descriptor GEMM (row counts it was timed at, >= 8% faster than cuBLAS timed
    beside it); acting only on a >= 5% gain.
    Contiguous grid counts with the same action form a band (blocks: that count only)."""
    plans: dict[tuple[int, int], list[Band]] = {}
    for name, shape in ALL_SHAPES.items():
        t = cub["default"].get(name)
        if not t:
            continue
        bands: list[Band] = []
        prev = 0
        for m in sorted(t):
            options: list[tuple[float, object]] = [(t[m], None)]
            for mm in t:
                if m < mm <= m + 64:  # + the pad: read x, write the padded copy, a launch
                    pad_cost = (m + mm) * shape[1] * 2 / 2.5e12 * 1e6 + 2.0
                    options.append((t[mm] + pad_cost, Pad(mm)))
            lt = cub.get("cublaslt", {}).get(name, {})
            if m in lt:
                options.append((lt[m] + 1.0, Lt()))
            for c in (2048, 4096):  # blocks of rows (the largest counts only)
                if m > c and m % c == 0 and c in t:
                    options.append((m // c * t[c] + 2.0, Chunks(c)))
            if m in tiles.get(name, {}):
                ratio, cfg = tiles[name][m]  # tiles / cuBLAS, timed side by side
                if ratio <= TILES_MIN_GAIN:
                    options.append((ratio * t[m], Tiles(cfg)))
            cost, action = min(options, key=lambda o: o[0])
            if action is not None and cost < 0.95 * t[m]:
                # a band reaches at most 64 rows below a measured count (blocks: that count)
                lo = m if isinstance(action, Chunks) else max(prev + 1, m - 63)
                if bands and bands[-1].action == action and bands[-1].hi == lo - 1:
                    bands[-1] = Band(bands[-1].lo, m, action)
                else:
                    bands.append(Band(lo, m, action))
            prev = m
        if bands:
            plans[shape] = bands
    return plans


@section("4. the dispatch table and its time at the engine's row counts")
def table(cub: dict, tiles: dict, mode: str) -> None:
    if mode == "off":
        gemm_rows.set_enabled(False)
        row("dispatch", "off")
        return
    if mode == "measured":
        shipped = dict(gemm_rows.PLANS)
        gemm_rows.PLANS.clear()
        gemm_rows.PLANS.update(derive(cub, tiles))
        for shape in sorted(set(shipped) | set(gemm_rows.PLANS)):
            a, b = shipped.get(shape, []), gemm_rows.PLANS.get(shape, [])
            row(
                f"plans {shape} vs shipped",
                "same"
                if a == b
                else f"only shipped {[x for x in a if x not in b]}; only "
                f"measured {[x for x in b if x not in a]}",
            )
    print("PLANS = {")
    for shape, bands in gemm_rows.PLANS.items():
        print(f"    {shape}: [")
        for b in bands:
            print(f"        Band({b.lo}, {b.hi}, {b.action!r}),")
        print("    ],")
    print("}")
    RESULTS["plans"] = {str(k): [repr(b) for b in v] for k, v in gemm_rows.PLANS.items()}
    buckets = [16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960,
               1024, 1344, 2048, 8192]  # fmt: skip
    per_bucket = defaultdict(lambda: [0.0, 0.0])
    for name, (n, k) in ALL_SHAPES.items():
        parts = []
        for m in [b for b in buckets if name not in HEAD or b <= 512]:
            x = x_rows(k, m)
            band = gemm_rows.find_band(gemm_rows.PLANS.get((n, k), []), m)
            plain = graph_us(lambda w: F.linear(x, w), weights(name))  # noqa: B023
            new = plain
            if band is not None:
                new = graph_us(lambda w: gemm_rows.run(x, w, None, band), weights(name))  # noqa: B023
                parts.append(f"{m}:{plain:.0f}->{new:.0f}")
            if name not in HEAD:
                per_bucket[m][0] += plain
                per_bucket[m][1] += new
        row(f"dispatch {name} (M: cuBLAS us -> dispatched)", " ".join(parts) or "unchanged")
    row(
        "4 GEMMs of a layer, us by M (cuBLAS -> dispatched)",
        " ".join(f"{m}:{a:.0f}->{b:.0f}" for m, (a, b) in per_bucket.items()),
    )


MIXED_BUCKETS = (256, 320, 384, 448, 512, 640, 768, 896, 1024)
"""Step-kind labels of mixed steps (256: any count up to 256)."""


@section("4b. gate_up + SiLU-and-mul in one GEMM vs the dispatched GEMM + silu_and_mul")
def silu_table(mode: str) -> None:
    """Per row count, the fused GEMM's best config against the unfused pair (the GEMM as the
    table above dispatches it, then the activation kernel), timed side by side; a band where
    the fused one is >= 5% faster (at most 64 rows below a measured count)."""
    if mode == "off":
        return
    shape = SHAPES["gate_up"]
    shipped = gemm_rows.SILU_PLANS.pop(shape, [])  # the pair below: unfused
    bands: list[Band] = []
    prev = 0
    parts = []
    for m in TRITON_ROWS + [4096, 8192]:
        x = x_rows(shape[1], m)
        pair = graph_us(lambda w: silu_and_mul(linear(x, w, None)), weights("gate_up"))  # noqa: B023
        times = {}
        for cfg in SILU_CONFIGS:
            try:
                times[cfg] = graph_us(lambda w, c=cfg: dense_gemm_silu(x, w, c), weights("gate_up"))  # noqa: B023
            except Exception as e:  # noqa: BLE001
                print(f"  silu {m} {tuple(cfg)}: {type(e).__name__}: {str(e)[:120]}")
        if times:
            cfg = min(times, key=times.get)
            print(
                f"  gate_up+silu M={m:5d}: pair {pair:7.1f} us | fused {times[cfg]:7.1f} "
                f"{tuple(cfg)} ({pair / times[cfg]:.2f}x) | "
                + " ".join(f"{t:.0f}" for t in times.values()),
                flush=True,
            )
            parts.append(f"{m}:{pair:.0f}->{times[cfg]:.0f}")
            if times[cfg] < 0.95 * pair:
                lo = max(prev + 1, m - 63)
                action = Tiles(cfg)
                if bands and bands[-1].action == action and bands[-1].hi == lo - 1:
                    bands[-1] = Band(bands[-1].lo, m, action)
                else:
                    bands.append(Band(lo, m, action))
        prev = m
    row("gate_up+silu (M: pair us -> fused)", " ".join(parts))
    print(f"SILU_PLANS measured = {{{shape}: {bands!r}}}")
    if mode == "shipped":
        bands = shipped
    if bands:
        gemm_rows.SILU_PLANS[shape] = bands
    row("SiLU-epilogue bands in the engine", f"{len(bands)} ({mode})")
    RESULTS["silu_plans"] = repr(bands)


class StepClock(PhaseClock):
    """``gpu_presets.PhaseClock`` by finer step kinds (decode rows, mixed-step buckets), in
    kind order, with each kind's step count in ``rows``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: Counter = Counter()

    def kind(self, so) -> str:
        n, reqs = so.num_batched_tokens, len(so.scheduled)
        if n == reqs:
            kind = f"decode {-(-n // 16) * 16:4d}"
        elif n <= 1024:
            kind = f"mixed <={next(b for b in MIXED_BUCKETS if b >= n):5d}"
        elif n < 4096:
            kind = "mixed >1024"
        else:
            kind = "prefill >=4096"
        self.rows[kind] += 1
        return kind

    def phases(self) -> dict[str, tuple[int, float]]:
        return dict(sorted(super().phases().items()))


def run_preset(llm: LLM, ceil, name: str, tag: str) -> None:
    engine = llm.llm_engine
    engine.kv_manager.reset_prefix_cache()
    wl = workloads.preset(name, engine.model_config.vocab_size)
    clock = StepClock()
    res = throughput.run(llm, ceil, wl, use_tqdm=False, observe=clock)
    phases = clock.phases()
    label = f"preset {name} ({tag})"
    row(
        label,
        f"{res.elapsed_s:.3f} s, {res.output_tok_s:,.0f} out tok/s, {res.roofline_pct:.1f}% of "
        f"roofline ({res.roofline_s:.3f} s), host {100 * res.host_fraction:.1f}%, max running "
        f"{res.max_running}, {res.num_preemptions} preemptions, {len(res.jit_compiles)} JIT "
        f"compiles {res.jit_compiles}",
    )
    dec = [(n, s) for k, (n, s) in phases.items() if k.startswith("decode")]
    mix = {k: v for k, v in phases.items() if not k.startswith("decode")}
    row(
        f"  phases {name} ({tag})",
        f"decode steps {sum(n for n, _ in dec)}: {sum(s for _, s in dec):.3f} s; "
        + "; ".join(
            f"{k}: {n} steps {s:.3f} s ({1e3 * s / n:.2f} ms/step)" for k, (n, s) in mix.items()
        ),
    )
    if name == "short" and tag == "on":
        row(
            "  decode steps by rows (short)",
            " ".join(
                f"{k[7:].strip()}:{n}/{1e3 * s / n:.1f}ms"
                for k, (n, s) in phases.items()
                if k.startswith("decode")
            ),
        )
    RESULTS[label] = vars(res) | {"phases": phases}


def recapture(llm: LLM, enabled: bool) -> None:
    """Drop the runner's graphs, switch the dispatch, capture them again."""
    runner = llm.llm_engine.runner
    gemm_rows.set_enabled(enabled)
    runner.graphs = runner.cascade_graphs = None
    if runner.mixed is not None:
        runner.mixed.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    runner.capture_cuda_graphs()
    row(f"recaptured (dispatch {'on' if enabled else 'off'})", f"{time.perf_counter() - t0:.1f} s")


@section("5b. kernel-time split of mixed-bucket and decode graph replays")
def split(llm: LLM) -> None:
    from torch.profiler import ProfilerActivity, profile

    runner = llm.llm_engine.runner
    mixed = getattr(runner.mixed, "graphs", None)
    targets = []
    if mixed is not None:
        for b in (448, 640):
            if b in mixed.graphs:
                stage = functools.partial(mixed._stage_empty, b)
                targets.append((f"mixed bucket {b} (all padding)", stage, mixed.graphs[b]))
    decode = runner.graphs
    if decode is not None and 256 in decode.graphs:

        def stage() -> None:
            decode.slot_mapping.fill_(-1)
            decode.seq_lens.fill_(256)

        targets.append(("decode graph 256 (ctx 256)", stage, decode.graphs[256]))
    for label, stage, graph in targets:
        stage()
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        cls: dict[str, float] = defaultdict(float)
        for evt in prof.events():
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            nm = evt.name.lower()
            if any(s in nm for s in ("nvjet", "gemm", "xmma", "cutlass", "sm90", "_dense")):
                key = "GEMM"
            elif any(s in nm for s in ("attention", "prefill", "decode", "cascade")):
                key = "attention"
            else:
                key = "other"
            cls[key] += evt.time_range.elapsed_us() / 3
        total = sum(cls.values())
        row(
            f"split {label}",
            f"{total / 1e3:.2f} ms: "
            + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(cls.items())),
        )


@section("6. decode: Llama-3.1-8B batch 1 (regression: >= 169 tok/s)")
def bs1(llm: LLM, ceil) -> None:
    rows = latency.run(llm.llm_engine, ceil, [1], 512, 128)
    print(latency.format_rows(rows))
    row("8B batch-1 decode", f"{rows[0].output_tok_s:.1f} tok/s ({rows[0].step_ms_p50:.2f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", choices=("measured", "shipped", "off"), default="measured")
    ap.add_argument("--no-sweep", action="store_true", help="skip sections 2-3 (plans shipped)")
    ap.add_argument("--silu", choices=("measured", "shipped"), default=None,
                    help="SiLU-epilogue bands for the engine (default: as --plans)")  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t_start = time.perf_counter()
    ceil = measure(DEV, BF16)
    row(
        "ceilings",
        f"copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s",
    )
    compile_all()
    parity()
    cub = tiles = None
    if not args.no_sweep:
        cub = sweep(ceil)
        tiles = triton_sweep(cub) if cub else None
    mode = args.plans if cub is not None else ("off" if args.plans == "off" else "shipped")
    table(cub or {"default": {}}, tiles or {}, mode)
    parity_silu()
    silu_table("off" if mode == "off" else (args.silu or mode))
    WEIGHTS.clear()
    X_ALL.clear()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    kw = dict(max_model_len=8448, max_num_seqs=256, max_num_batched_tokens=8192)
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **kw)
    row("start-up", f"{time.perf_counter() - t0:.1f} s (dispatch {mode})")
    # dispatch on, off, on again (the graphs captured again each time): same-run comparisons
    rounds = [("on", True), ("off", False), ("on, again", True)]
    if mode == "off":
        rounds = [("off", False)]
    for i, (tag, enabled) in enumerate(rounds):
        if i:
            section(f"5. graphs captured again, dispatch {tag}")(recapture)(llm, enabled)
        for name in ("short", "default", "shared-prefix"):
            section(f"5. preset {name}, dispatch {tag}")(run_preset)(llm, ceil, name, tag)
    split(llm)
    bs1(llm, ceil)
    print_rows("gpu_short", ROWS, time.perf_counter() - t_start)
    with open(os.path.join(args.out, "short.json"), "w") as f:
        json.dump(RESULTS | {"ceilings": vars(ceil)}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
