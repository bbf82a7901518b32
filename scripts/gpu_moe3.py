"""Qwen3-30B-A3B batch-1 decode against its active-parameter roofline, and where a layer's time
goes (random weights from roofline/model_configs; each section in try/except so one failure
does not hide the others; a short table last).

1. Parity of the decode MoE block at Qwen3-30B-A3B shapes (router kernel, gate/up GEMV, down
   GEMV with the routing weights and the residual add in its store, PDL launches) against the
   unfused launches (PDL off, separate add) and the torch reference, bf16 / int8 / fp8 / int4
   experts; a chain of blocks captured in a CUDA graph and replayed equals eager.
2. The MoE block alone at one token, ``LAYERS`` blocks of distinct weights chained in one CUDA
   graph (no L2 reuse between blocks, as in the model): microseconds per block and % of copy
   over the bytes it must read (8 experts + router), its fusions switched on one at a time
   (residual in the down store, PDL, the down rows' prefetch), the 8-bit GEMV's widenings.
3. The fused MoE kernel alone at 16 / 256 (/ 4096) tokens (grouped GEMM, the weight-left and
   the first kernel): GB/s over the touched experts, TFLOP/s, per precision.
4. Qwen3-30B-A3B, all 48 layers in bf16 (~61 GB, dummy weights drawn on the GPU): load time,
   batch-1 decode (% of the planner's active-parameter roofline), a profiled batch-1 step
   (each kernel's share of the step's critical path: its end minus the previous kernel's end,
   which stays meaningful with PDL's overlapping launches), decode steps at batch 8 / 32 / 128
   (% of the roofline counting the experts a batch touches), without ``--quick`` the
   256-request offline workload (input 100-1024, output 512); then batch 1 again under each
   switch (PDL, the MoE fusions, the attention's fusion and split size), the decode graphs
   recaptured each time, the PDL-off step profiled (every kernel's own time).
5. 8 of the 48 layers: batch-1 decode with int8 / fp8 / int4 experts and linears.
6. (not ``--quick``) 8 layers: batch-1 decode against HF transformers ``generate`` on the same
   weights.

    python scripts/gpu_moe3.py --quick     # first check (~3 min: no 4096 tokens, offline, HF)
    python scripts/gpu_moe3.py             # full (~6 min)
    python scripts/gpu_moe3.py --final     # the figures only (~2.5 min): sections 4 and 6
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_moe2 as m2  # noqa: E402
from gpu_common import profiled_steps  # noqa: E402 - the expert builders and helpers of the last session

from roofline import LLM, SamplingParams  # noqa: E402
from roofline.bench import latency, peers, throughput, workloads  # noqa: E402
from roofline.bench.ceilings import Ceilings, measure, time_fn  # noqa: E402
from roofline.kernels import fused_moe as fm  # noqa: E402
from roofline.kernels import pdl  # noqa: E402
from roofline.kernels.moe_router import moe_router, moe_router_ref  # noqa: E402

SUMMARY: dict[str, object] = {}
TABLE = m2.TABLE  # one table: the sections of both scripts report into it
DEVICE = "cuda"
E, K, H, INTER = m2.SHAPES["qwen3-30b-a3b"]
LAYERS = 8
EPS = 1e-6


section = m2.section  # print, time, report a failure into TABLE and go on (gpu_moe2)


VARIANTS = {  # label: (residual in the down store, PDL, down prefetch, late PDL triggers)
    "unfused": (False, False, False, False),
    "residual fused": (True, False, False, False),
    "+ PDL": (True, True, False, False),
    "+ down prefetch (shipped)": (True, True, True, False),
    "+ late PDL triggers": (True, True, True, True),
}
"""(The label "shipped" names the defaults when this script was written: PDL on, prefetch
on, early triggers; ``True`` below runs it.)"""


def block(h, norm_w, router, w13, w2, sk, fused: bool | str):
    """One MoE block at one token: the shipped path (``fused`` True: PDL launches, the down
    rows prefetched, residual in the down store), the unfused launches (False: PDL off,
    separate add) or a ``VARIANTS`` label."""
    label = {True: "+ down prefetch (shipped)", False: "unfused"}.get(fused, fused)
    residual, use_pdl, prefetch, late = VARIANTS[label]
    saved = (fm.DOWN_PREFETCH, fm.LATE_TRIGGER, fm.DECODE_PDL)
    pdl.set_pdl(use_pdl)
    fm.DOWN_PREFETCH, fm.LATE_TRIGGER, fm.DECODE_PDL = prefetch, late, True
    try:
        xn, w, ids = moe_router(h, norm_w, EPS, router, K, True)
        if residual:
            return fm.fused_moe(xn, w13, w2, w, ids, residual=h, **sk)
        return h + fm.fused_moe(xn, w13, w2, w, ids, **sk)
    finally:
        pdl.set_pdl(True)
        fm.DOWN_PREFETCH, fm.LATE_TRIGGER, fm.DECODE_PDL = saved


def make_layers(kind: str, n: int, gen: torch.Generator) -> list:
    layers = []
    for _ in range(n):
        w13, w2, scales, router = m2.experts(kind, E, H, INTER, gen)
        norm_w = (1 + 0.1 * torch.randn(H, device=DEVICE, generator=gen)).bfloat16()
        layers.append((norm_w, router, w13, w2, m2.scale_kwargs(scales)))
        m2.ORIGINALS.clear()
    return layers


@section("parity: decode MoE block (fused residual, PDL)")
def parity() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    bad = 0
    for kind in m2.KINDS:
        layers = make_layers(kind, 2, gen)
        norm_w, router, w13, w2, sk = layers[0]
        for seed in range(3):
            h = torch.randn(1, H, device=DEVICE, generator=gen).bfloat16()
            new = block(h, norm_w, router, w13, w2, sk, True)
            old = block(h, norm_w, router, w13, w2, sk, False)
            xn, w, ids = moe_router_ref(h, norm_w, EPS, router, K, True)
            w13_ref, w2_ref = (w13.float(), w2.float()) if kind == "bf16" else (w13, w2)
            ref = h.float() + fm.fused_moe_ref(xn.float(), w13_ref, w2_ref, w.float(), ids, **sk)
            err = m2.rel_err(new, ref)
            same = torch.equal(new, old)
            ok = same and err < 2e-2
            bad += m2.check(
                f"{kind} block seed {seed}",
                ok,
                f"equal to unfused {same}, rel err vs reference {err:.1e}",
            )
        h = torch.randn(1, H, device=DEVICE, generator=gen).bfloat16()
        chain(h, layers, True)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(h, layers, True)
        h.copy_(torch.randn(1, H, device=DEVICE, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(out, chain(h, layers, True))
        bad += m2.check(f"{kind} 2-block chain CUDA graph", same, f"equals eager: {same}")
        bad += grouped_parity(kind, w13, w2, sk, router, gen)
        del layers
    TABLE.append(("parity", "ok" if not bad else f"{bad} BAD (listed)"))


def weight_left(kind: str, on: bool) -> None:
    """Route the grouped GEMM of ``kind``'s experts to the weight-left kernel or the first one."""
    layout = {"bf16": 0, "int8": 1, "fp8": 1, "int4": 2}[kind]  # ExpertLayout.quant
    fm.WEIGHT_LEFT[layout] = float("inf") if on else 0.0


def grouped_parity(kind, w13, w2, sk, router, gen) -> int:
    """The grouped path (both kernels) against the (dequantizing) reference at 16 / 256 tokens."""
    bad = 0
    saved = dict(fm.WEIGHT_LEFT)
    for num_tokens in (16, 256):
        x = torch.randn(num_tokens, H, device=DEVICE, generator=gen).bfloat16()
        w, ids = fm.route_ref(x @ router.T, K, True)
        w13_ref, w2_ref = (w13.float(), w2.float()) if kind == "bf16" else (w13, w2)
        ref = fm.fused_moe_ref(x.float(), w13_ref, w2_ref, w.float(), ids, **sk)
        for on in (True, False):
            weight_left(kind, on)
            err = m2.rel_err(fm.fused_moe(x, w13, w2, w, ids, force_path="grouped", **sk), ref)
            name = f"{kind} T={num_tokens} grouped {'weight-left' if on else 'first kernel'}"
            bad += m2.check(name, err < 2e-2, f"rel err {err:.1e}")
    fm.WEIGHT_LEFT.update(saved)
    return bad


def chain(h: torch.Tensor, layers: list, fused: bool | str) -> torch.Tensor:
    for layer in layers:
        h = block(h, *layer, fused)
    return h


def time_chain(layers, fused: bool | str) -> float:
    """Seconds per block of a chain of blocks replayed from one CUDA graph."""
    h = torch.randn(1, H, device=DEVICE).bfloat16()
    chain(h, layers, fused)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(h, layers, fused)
    return time_fn(graph.replay, torch.device(DEVICE), iters=30) / len(layers)


@section("MoE block alone at one token (chained, distinct weights)")
def block_bench(ceil: Ceilings) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    bw = ceil.bandwidth_bytes_per_s
    rows = {}
    for kind in m2.KINDS:
        layers = make_layers(kind, LAYERS, gen)
        _, router, w13, w2, sk = layers[0]
        scales = tuple(sk.get(n) for n in ("w13_scale", "w2_scale", "w13_offset", "w2_offset"))
        nbytes = K * m2.expert_bytes(w13, w2, scales) + router.numel() * 2 + 3 * H * 2
        for label in VARIANTS:
            t = time_chain(layers, label)
            rows[f"{kind} {label}"] = 1e6 * t
            print(
                f"{kind:4s} {label:26s}: {1e6 * t:6.1f} us/block, {nbytes / t / 1e9:5.0f} GB/s "
                f"({100 * nbytes / t / bw:4.1f}% of copy; {nbytes / 1e6:.1f} MB)",
                flush=True,
            )
        for widen in (2,) if kind in ("int8", "fp8") else ():  # the 8-bit GEMV's widening
            saved = fm.GEMV_CONFIG_8BIT["WIDEN"]
            fm.GEMV_CONFIG_8BIT["WIDEN"] = widen
            try:
                t = time_chain(layers, True)
            finally:
                fm.GEMV_CONFIG_8BIT["WIDEN"] = saved
            rows[f"{kind} shipped, WIDEN {widen}"] = 1e6 * t
            print(f"{kind:4s} shipped with WIDEN {widen}      : {1e6 * t:6.1f} us/block, "
                  f"{100 * nbytes / t / bw:4.1f}% of copy", flush=True)  # fmt: skip
        int4_cfgs = [dict(BLOCK_N=8, BLOCK_K=256), dict(BLOCK_N=16, BLOCK_K=128)]
        for cfg in int4_cfgs if kind == "int4" else ():  # the int4 GEMV's tiles
            saved_cfg = dict(fm.GEMV_CONFIG_INT4)
            fm.GEMV_CONFIG_INT4.update(cfg)
            try:
                t = time_chain(layers, True)
            finally:
                fm.GEMV_CONFIG_INT4.clear()
                fm.GEMV_CONFIG_INT4.update(saved_cfg)
            rows[f"{kind} shipped, {cfg}"] = 1e6 * t
            print(f"{kind:4s} shipped with {cfg}: {1e6 * t:6.1f} us/block, "
                  f"{100 * nbytes / t / bw:4.1f}% of copy", flush=True)  # fmt: skip
        shipped = rows[f"{kind} + down prefetch (shipped)"]
        TABLE.append(
            (
                f"MoE block T=1 {kind} (unfused -> shipped)",
                f"{rows[f'{kind} unfused']:.1f} -> {shipped:.1f} us, "
                f"{100 * nbytes / (shipped / 1e6) / bw:.0f}% of copy",
            )
        )
        del layers
    SUMMARY["block_us"] = rows


@section("fused MoE kernel alone, grouped (16 / 256 / 4096 tokens)")
def grouped_bench(
    ceil: Ceilings, kinds: tuple[str, ...], sizes: tuple[int, ...], sweep: bool = True
) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    bw, peak = ceil.bandwidth_bytes_per_s, ceil.matmul_flops_per_s
    rows = []
    for kind in kinds:
        w13, w2, scales, router = m2.experts(kind, E, H, INTER, gen)
        m2.ORIGINALS.clear()
        per_expert = m2.expert_bytes(w13, w2, scales)
        saved = dict(fm.WEIGHT_LEFT)
        for num_tokens in sizes:
            x = torch.randn(num_tokens, H, device=DEVICE, generator=gen).bfloat16()
            _, ids = fm.route(x @ router.T, K, True)
            touched = int(torch.unique(ids).numel())
            nbytes = touched * per_expert + 2 * num_tokens * H * 2
            flops = 2 * num_tokens * K * 3 * H * INTER
            if num_tokens == 4096 and kind in ("fp8", "int4"):
                continue  # (their 8-bit twin / the first kernel's slow int4 tiles: time)
            for on in (True, False):
                weight_left(kind, on)
                t = m2.time_layer(x, router, w13, w2, scales, K)
                label = "weight-left" if on else "first"
                r = dict(
                    kind=kind,
                    kernel=label,
                    tokens=num_tokens,
                    us=1e6 * t,
                    gbs=nbytes / t / 1e9,
                    pct_copy=100 * nbytes / t / bw,
                    tflops=flops / t / 1e12,
                    pct_mm=100 * flops / t / peak,
                )
                rows.append(r)
                print(
                    f"{kind:4s} T={num_tokens:5d} {label:11s}: {r['us']:8.1f} us "
                    f"{r['gbs']:6.0f} GB/s ({r['pct_copy']:4.1f}% of copy) "
                    f"{r['tflops']:6.1f} TFLOP/s ({r['pct_mm']:4.1f}% of mm)",
                    flush=True,
                )
                TABLE.append(
                    (
                        f"grouped {kind} T={num_tokens} {label}",
                        f"{r['us']:.0f} us, {r['pct_copy']:.0f}% copy, {r['tflops']:.0f} TF/s",
                    )
                )
            fm.WEIGHT_LEFT.update(saved)
            if sweep and num_tokens == 16 and kind in ("int8", "int4"):
                sweep_weight_left(kind, x, router, w13, w2, scales, nbytes, bw)
        del w13, w2, scales, router
    SUMMARY["grouped"] = rows


T_SWEEP = [dict(BLOCK_N=128, num_warps=8), dict(BLOCK_N=64, num_warps=8),
           dict(NUM_STAGES=3), dict(BLOCK_N=128, num_warps=8, NUM_STAGES=3)]  # fmt: skip


def sweep_weight_left(kind, x, router, w13, w2, scales, nbytes, bw) -> None:
    """A few tiles of the weight-left kernel (weight rows, warps, stages) at this size."""
    saved = dict(fm.WEIGHT_LEFT)
    weight_left(kind, True)
    best = None
    try:
        for cfg in T_SWEEP:
            fm.GEMM_T_OVERRIDES.clear()
            fm.GEMM_T_OVERRIDES.update(cfg)
            try:
                t = m2.time_layer(x, router, w13, w2, scales, K)
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit
                print(f"  {kind} T={x.shape[0]} weight-left {cfg}: {exc!r:.120}")
                continue
            print(f"  {kind} T={x.shape[0]} weight-left {cfg}: {1e6 * t:7.1f} us "
                  f"({100 * nbytes / t / bw:4.1f}% of copy)", flush=True)  # fmt: skip
            if best is None or t < best[0]:
                best = (t, cfg)
    finally:
        fm.GEMM_T_OVERRIDES.clear()
        fm.WEIGHT_LEFT.update(saved)
    if best is not None:
        pct = 100 * nbytes / best[0] / bw
        TABLE.append(
            (
                f"sweep weight-left {kind} T={x.shape[0]} best",
                f"{1e6 * best[0]:.0f} us, {pct:.0f}% {best[1]}",
            )
        )


def profiled_kernels(engine, steps: int, label: str) -> list[tuple[float, float, str]]:
    """(start, end, name) of every CUDA kernel, in start order, over ``steps`` profiled decode
    steps of one request (prompt 128 tokens, 20 steps in before the profile)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
    engine.add_request(f"prof {label}", list(range(1000, 1128)), params)
    prof = profiled_steps(engine, 20, steps)
    while engine.has_unfinished_requests():
        engine.step()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return kernels


def profile_steps(engine, steps: int, label: str = "shipped") -> None:
    """Each kernel's share of a batch-1 step's critical path (its end minus the previous
    kernel's end, in stream order), summed by kernel name."""
    kernels = profiled_kernels(engine, steps, label)
    share: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.Counter()
    busy: dict[str, float] = collections.defaultdict(float)
    last_end = kernels[0][0] if kernels else 0
    idle = 0.0
    for start, end, name in kernels:
        share[name] += max(0.0, end - max(last_end, start))
        idle += max(0.0, start - last_end)  # the GPU ran nothing (host, graph launch)
        busy[name] += end - start
        count[name] += 1
        last_end = max(last_end, end)
    span = (kernels[-1][1] - kernels[0][0]) / steps if kernels else 0.0
    print(
        f"profiled {steps} steps: GPU span {span:.1f} us/step (idle {idle / steps:.1f}), "
        f"{len(kernels) / steps:.0f} kernels/step; per kernel: critical-path us/step, "
        "launches/step, busy us/launch (busy includes a PDL launch's wait)"
    )
    rows = sorted(share, key=lambda n: -share[n])
    prof_rows = []
    for name in rows[:24]:
        n = count[name] / steps
        print(
            f"  {share[name] / steps:8.1f} us  {n:5.0f}x  {busy[name] / count[name]:7.1f} us"
            f"  {name[:100]}"
        )
        prof_rows.append((name[:100], share[name] / steps, n, busy[name] / count[name]))
    SUMMARY[f"profile_bs1 {label}"] = dict(span_us=span, rows=prof_rows)
    TABLE.append(
        (
            f"48l bs=1 profiled GPU span ({label})",
            f"{span:.0f} us/step, {len(kernels) / steps:.0f} kernels",
        )
    )


@section("Qwen3-30B-A3B, 48 layers, bf16")
def full_model(ceil: Ceilings, quick: bool, switches: bool = True) -> None:
    free, total = torch.cuda.mem_get_info()
    print(f"GPU memory free {free / 2**30:.1f} of {total / 2**30:.1f} GiB", flush=True)
    t0 = time.perf_counter()
    llm = LLM(
        "qwen3-30b-a3b",
        load_format="dummy",
        device=DEVICE,
        max_model_len=2048,
        max_num_seqs=128,
        gpu_memory_utilization=0.92,
    )
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    gib = torch.cuda.memory_allocated() / 2**30
    print(
        f"loaded 48 layers (dummy weights drawn on the GPU) in {load_s:.1f}s, {gib:.1f} GiB",
        flush=True,
    )
    TABLE.append(("48l load (dummy, on the GPU)", f"{load_s:.0f} s, {gib:.1f} GiB"))
    engine = llm.llm_engine
    rows = latency.run(engine, ceil, [1], 128, 128)
    print(latency.format_rows(rows), flush=True)
    r = rows[0]
    TABLE.append(
        (
            "48l bs=1 bf16",
            f"{r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}% of "
            f"roofline ({r.roofline_step_ms:.2f} ms; goal 70%, 315 tok/s)",
        )
    )
    SUMMARY["decode_48l_bs1"] = latency.as_dicts(rows)
    try:
        profile_steps(engine, 8)
    except Exception:  # noqa: BLE001 - the figures above stand without the profile
        traceback.print_exc()
    rows = latency.run(engine, ceil, [8, 32, 128], 128, 64)
    print(latency.format_rows(rows), flush=True)
    SUMMARY["decode_48l"] = latency.as_dicts(rows)
    for r in rows:
        TABLE.append(
            (
                f"48l bs={r.batch_size} step",
                f"{r.step_ms_p50:.2f} ms, {r.roofline_pct:.1f}% of touched-experts roofline",
            )
        )
    if not quick:
        offline(llm, ceil)
    batch1_variants(engine, ceil, None if switches else ("attention: the fused kernel",))
    engine.shutdown()
    del llm, engine


def offline(llm, ceil: Ceilings) -> None:
    """The 256-request workload (input 100-1024, output 512) on the 48-layer engine."""
    engine = llm.llm_engine
    wl = workloads.synthetic(256, (100, 1024), (512, 512), engine.model_config.vocab_size)
    res = throughput.run(llm, ceil, wl, use_tqdm=False)
    print(
        f"{wl.name}: {res.output_tok_s:.0f} out tok/s, {res.roofline_pct:.1f}% of "
        f"roofline, preemptions {res.num_preemptions}, max running {res.max_running}, "
        f"host {100 * res.host_fraction:.0f}%",
        flush=True,
    )
    SUMMARY["offline_48l"] = vars(res)
    TABLE.append(
        (
            "48l offline 256 req",
            f"{res.output_tok_s:.0f} out tok/s, {res.roofline_pct:.1f}% of roofline",
        )
    )


def _variant_flags():
    from roofline.kernels import decode_attention_fused as attn
    from roofline.kernels import gemv_preload

    def moe_pdl(on: bool, late: bool = False) -> None:
        fm.DECODE_PDL, fm.LATE_TRIGGER = on, late

    return {  # label: (setter, restorer); each recaptures the decode graph under its setting
        "MoE launches as PDL dependents": (lambda: moe_pdl(True), lambda: moe_pdl(False)),
        "MoE PDL, late triggers": (lambda: moe_pdl(True, True), lambda: moe_pdl(False)),
        "PDL off (all kernels)": (lambda: pdl.set_pdl(False), lambda: pdl.set_pdl(True)),
        "attention: the fused kernel": (
            lambda: _fused_attention(True),
            lambda: _fused_attention(False),
        ),
        "attention split 256 tokens": (
            lambda: attn.set_split_tokens(256),
            lambda: attn.set_split_tokens(attn.SPLIT_TOKENS_DEFAULT),
        ),
        "GEMV preload on (qkv, o_proj)": (
            lambda: gemv_preload.set_enabled(True),
            lambda: gemv_preload.set_enabled(False),
        ),
    }


def recapture_batch1(runner) -> None:
    """The runner's decode graphs again, for batch 1 only (the mixed and cascade graphs stay
    as they are: batch-1 decode steps do not use them)."""
    from roofline.worker.cuda_graph import DecodeGraphs

    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.backend, 1,
                                 runner.scheduler_config.max_model_len, runner.page_size,
                                 runner.device, heads=True)  # fmt: skip
    runner.graphs.capture()


def _fused_attention(on: bool) -> None:
    """The fused decode attention kernel for Qwen3-30B-A3B's heads (32 / 4 / 128) or not."""
    from roofline.kernels import decode_attention_fused as attn

    shape = (32, 4, 128)
    if on:
        attn.UNFUSED_FASTER.discard(shape)
    else:
        attn.UNFUSED_FASTER.add(shape)


def batch1_variants(engine, ceil: Ceilings, only: tuple[str, ...] | None = None) -> None:
    """Batch-1 decode of the 48-layer engine under each switch of ``_variant_flags`` (the
    decode graphs recaptured for batch 1 only), the PDL-off one profiled (each kernel's own
    time)."""
    from roofline.kernels import decode_attention_fused as attn

    attn.SPLIT_TOKENS_DEFAULT = attn.SPLIT_TOKENS
    runner = engine.runner
    rows = {}
    try:
        switches = [(k, v) for k, v in _variant_flags().items() if only is None or k in only]
        for label, (on, off) in [("shipped (recaptured)", (lambda: None, lambda: None))] + switches:
            try:
                on()
                recapture_batch1(runner)
                r = latency.run(engine, ceil, [1], 128, 64)[0]
                rows[label] = r.step_ms_p50
                print(
                    f"48l bs=1 {label:28s}: {r.output_tok_s:6.1f} tok/s, step "
                    f"{r.step_ms_p50:.3f} ms, {r.roofline_pct:5.1f}% of roofline",
                    flush=True,
                )
                TABLE.append(
                    (f"48l bs=1 {label}", f"{r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}%")
                )
                if label == "PDL off (all kernels)":
                    profile_steps(engine, 4, "PDL off")
            except Exception:  # noqa: BLE001 - the next variant still runs
                traceback.print_exc()
                TABLE.append((f"48l bs=1 {label}", "FAILED"))
            finally:
                off()
    finally:
        SUMMARY["batch1_variants_ms"] = rows


@section("8 layers, batch-1 decode: expert precisions")
def variants(ceil: Ceilings, quick: bool) -> None:
    """Batch-1 decode with bf16, int8, fp8 and int4 experts and linears (quantized on the fly;
    the 48-layer section has the bf16 switches)."""
    from roofline.layers import fused_decode

    model = m2.config_with_layers("qwen3-30b-a3b", 8)
    cases = [("int8", "int8", {}), ("int4", "int4", {})]
    if not quick:
        cases.append(("fp8", "fp8", {}))
    for label, quant, flags in cases:
        pdl.set_pdl(flags.get("pdl", True))
        fused_decode.set_moe_enabled(flags.get("moe", True))
        llm = None
        try:
            llm = LLM(
                model,
                load_format="dummy",
                device=DEVICE,
                quantization=quant,
                max_model_len=1024,
                max_num_seqs=8,
                kv_cache_memory_bytes=2 << 30,
            )
            rows = latency.run(llm.llm_engine, ceil, [1], 128, 64)
            r = rows[0]
            print(
                f"{label:24s} {r.output_tok_s:7.1f} tok/s, step {r.step_ms_p50:.3f} ms, "
                f"{r.roofline_pct:5.1f}% of roofline ({r.roofline_step_ms:.3f} ms)",
                flush=True,
            )
            SUMMARY[f"8l {label}"] = latency.as_dicts(rows)
            TABLE.append((f"8l bs=1 {label}", f"{r.output_tok_s:.0f} tok/s, "
                          f"{r.roofline_pct:.1f}% of roofline"))  # fmt: skip
        except Exception:  # noqa: BLE001 - the next case still runs
            traceback.print_exc()
            TABLE.append((f"8l bs=1 {label}", "FAILED"))
        finally:
            pdl.set_pdl(True)
            fused_decode.set_moe_enabled(True)
            if llm is not None:
                llm.llm_engine.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()


@section("8 layers: roofline vs HF transformers generate (same weights)")
def vs_hf(ceil: Ceilings) -> None:
    llm = LLM(
        m2.config_with_layers("qwen3-30b-a3b", 8),
        load_format="dummy",
        device=DEVICE,
        max_model_len=1024,
        max_num_seqs=8,
        gpu_memory_utilization=0.4,
    )
    rows = latency.run(llm.llm_engine, ceil, [1], 128, 128)
    print(latency.format_rows(rows), flush=True)
    ours = rows[0].output_tok_s
    hf = peers.hf_model_from_engine(llm.llm_engine)
    hf_tok_s = peers.hf_decode_tok_s(hf, list(range(1000, 1128)), 32)
    print(
        f"8 layers bs 1: roofline {ours:.0f} tok/s ({rows[0].roofline_pct:.1f}%), "
        f"HF generate {hf_tok_s:.1f} tok/s: x{ours / hf_tok_s:.1f}",
        flush=True,
    )
    SUMMARY["vs_hf_8l"] = dict(ours=ours, hf=hf_tok_s, pct=rows[0].roofline_pct)
    TABLE.append(
        (
            "8l bs=1 vs HF generate",
            f"{ours:.0f} vs {hf_tok_s:.1f} tok/s "
            f"(x{ours / hf_tok_s:.1f}), {rows[0].roofline_pct:.1f}% of roofline",
        )
    )
    llm.llm_engine.shutdown()
    del llm, hf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="no 4096 tokens, offline, HF")
    ap.add_argument(
        "--final",
        action="store_true",
        help="the figures only (~2.5 min): 48 layers (offline, attention A/B), HF",
    )
    ap.add_argument(
        "--skip", default="", help="comma-separated: parity,block,grouped,full,variants,hf"
    )
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.final:  # the figures: no parity (CI and the checks have it), no switches or sweeps
        skip |= {"parity", "block", "grouped", "variants", "switches"}
    t0 = time.perf_counter()
    ceil = measure(torch.device(DEVICE), torch.bfloat16)
    print(
        f"ceilings ({ceil.device_name}): copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, "
        f"bf16 matmul {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    SUMMARY["ceilings"] = vars(ceil)
    if "parity" not in skip:
        parity()
    if "block" not in skip:
        block_bench(ceil)
    if "grouped" not in skip:
        kinds = ("bf16", "int8", "int4") if args.final else m2.KINDS
        grouped_bench(ceil, kinds, (16, 256) if args.quick else (16, 256, 4096), not args.final)
    if "full" not in skip:
        full_model(ceil, args.quick, "switches" not in skip)
    if "variants" not in skip:
        variants(ceil, args.quick)
    if "hf" not in skip and not args.quick:
        vs_hf(ceil)
    print(f"\n=== summary ({time.perf_counter() - t0:.0f}s)")
    width = max(len(k) for k, _ in TABLE) if TABLE else 0
    for k, v in TABLE:
        print(f"{k:<{width}}  {v}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "gpu_moe3.json", "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
