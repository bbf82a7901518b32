"""Where the shared-prefix preset's time goes, on the GPU (issue 13: 256 x (2,000 shared + 64),
128 out; Llama-3.1-8B config, random bf16 weights). Sections (each in try/except: an error is
printed and the next section runs):

1. parity: greedy tokens cascade off vs on (tiny fp32 Llama, 160 x (512 + 24)); the grouped
   cascade kernels (the default and the previous default) against plain decode at the
   preset's decode shape (bf16, fp32);
2. the preset twice (the second warm): time, % of roofline, host share, GPU time by phase, and
   the host timeline (generate() to the first step, schedule-to-schedule wall per kind);
3. a kernel-time profile by kind of the admission steps and of 24 steady decode steps (every
   kernel's time, the GPU's busy share of the window's wall time), beside the roofline's own
   split of that decode step (weights, KV, GEMM FLOPs, attention FLOPs);
6. no regression: the default preset (with --full or --final twice, and the short preset);
5. the grouped cascade's kernels against the previous default and the default's neighbours
   (alone and paired), and (7) the preset twice with the fastest if it beats the default by
   3%; the engine is then dropped for:
4. the dense GEMMs at the decode step's 256 rows and a prefill step's 8,192 (cuBLAS, weights
   cycled out of L2), each against max(bytes / bandwidth, FLOPs / peak).

A table last; JSON into $OUT/prefix.json. (Measured and concluded in its earlier versions:
plain decode, the GQA-packed admission prefill and the prefix part on torch's attention ops,
see docs/architecture.md.)

    python scripts/gpu_prefix.py           # everything (~2.5 min)
    python scripts/gpu_prefix.py --final   # no sweeps: parity, preset, profile, default x2, short
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import print_rows  # noqa: E402
from gpu_presets import (  # noqa: E402
    RESULTS,
    ROWS,
    TINY,
    PhaseClock,
    free,
    graph_time,
    queued_preset,
    row,
    run_preset,
    section,
    set_cascade,
    shared_batch,
)
from gpu_shared_prefix import greedy_parity, grouped  # noqa: E402

from roofline import LLM  # noqa: E402
from roofline.bench import workloads  # noqa: E402
from roofline.bench.ceilings import measure  # noqa: E402
from roofline.bench.latency import precision_of  # noqa: E402
from roofline.kernels.cascade_grouped import GroupedTuning  # noqa: E402
from roofline.kernels.decode_attention import decode_attention  # noqa: E402
from roofline.planner.roofline import step_cost  # noqa: E402

DEV = torch.device("cuda")
PREVIOUS = GroupedTuning(prefix=(64, 4, 2), suffix=(64, 4, 3), prefix_priority=False)
"""The grouped cascade's launch choices before the second check of this script."""
KINDS = [  # (kind, substrings of the lowercased kernel name), first match wins
    ("input staging", ("stage_decode", "staging")),
    ("rope + kv store", ("rotary_kv_store", "norm_rope")),
    ("attn cascade prefix", ("grouped_prefix", "shared_prefix")),
    ("attn cascade suffix", ("grouped_suffix", "cascade")),
    ("attn prefill", ("prefill",)),
    ("attn decode", ("decode_attention", "_decode_", "split_kv", "merge")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "matmul", "sm90_", "cublas", "skinny")),
    ("norm", ("rms", "norm")),
    ("rope", ("rotary", "rope")),
    ("kv store", ("kv_store", "store_kv", "_store", "cache")),
    ("activation", ("silu", "act_", "gelu")),
    ("LM head argmax / sampler", ("argmax", "sample", "softmax", "topk", "logit", "gumbel")),
    ("embedding / index", ("embedding", "index", "gather", "scatter")),
    ("copy / memset", ("memcpy", "memset", "copy", "fill")),
    ("torch elementwise", ("elementwise", "vectorized", "reduce", "unrolled")),
]


def kind_of(name: str) -> str:
    n = name.lower()
    for kind, keys in KINDS:
        if any(k in n for k in keys):
            return kind
    return "other"


@section("1. parity: greedy tokens cascade off vs on; grouped kernels vs plain decode")
def parity(final: bool = False) -> None:
    greedy_parity(TINY, 160, 512, 24, 16, "tiny fp32 Llama 160 x (512 + 24)", quick=True)
    variants = {"default": GroupedTuning()}
    if not final:
        variants["previous default"] = PREVIOUS
    # (fp32 runs through the greedy parity above: a tiny fp32 Llama at 160 rows)
    for dtype in (torch.bfloat16,) if final else (torch.bfloat16, torch.float32):
        b = shared_batch(256, 2000, 128)
        if dtype is torch.float32:
            for key in ("q", "kc", "vc"):
                b[key] = b[key].float()
        b["starts"][::7] = 0  # every 7th row not a member
        ref = decode_attention(b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], 128**-0.5,
                               max_seq_len=2128).float()  # fmt: skip
        for name, tuning in variants.items():  # (fp32 tiles: fewer stages, fit_stages)
            out = grouped(b, tuning).float()
            row(f"kernel parity {str(dtype)[6:]} grouped {name} vs plain decode",
                f"max|diff| {(out - ref).abs().max().item():.1e}")  # fmt: skip
    free()


class Timeline:
    """Host wall time of each schedule (the ``observe`` hook), by kind of step."""

    def __init__(self) -> None:
        self.t0 = self.added = time.perf_counter()
        self.marks: list[tuple[float, str, int]] = []

    def __call__(self, sched_out) -> None:
        decode = sched_out.num_batched_tokens == len(sched_out.scheduled)
        self.marks.append((time.perf_counter(), "decode" if decode else "prefill",
                           sched_out.num_batched_tokens))  # fmt: skip

    def prefill_tokens(self) -> list[int]:
        return [n for _, kind, n in self.marks if kind == "prefill"]

    def report(self, label: str, end: float) -> None:
        if not self.marks:
            return
        by: dict[str, list[float]] = defaultdict(list)
        marks = self.marks + [(end, "", 0)]
        for (a, kind, _), (b, _, _) in zip(marks, marks[1:]):
            by[kind].append(b - a)
        first = self.marks[0][0] - self.t0
        added = self.added - self.t0
        parts = ", ".join(f"{k} {len(v)} steps {sum(v):.3f} s" for k, v in sorted(by.items()))
        row(f"host timeline {label}",
            f"generate() to first schedule {first * 1e3:.0f} ms (requests queued after "
            f"{added * 1e3:.0f} ms); schedule-to-schedule wall: "
            f"{parts}; prefill steps' tokens {self.prefill_tokens()}")  # fmt: skip


@section("2. the shared-prefix preset, twice (the second warm), with its host timeline")
def preset_runs(llm: LLM, ceil) -> None:
    from roofline.bench import throughput

    for i in (1, 2):
        run_preset(llm, ceil, "shared-prefix", f"run {i}", count_cascade=True)
    # once more with the host timeline (the phase clock's events beside it)
    engine = llm.llm_engine
    engine.kv_manager.reset_prefix_cache()
    wl = workloads.preset("shared-prefix", engine.model_config.vocab_size)
    tl = Timeline()
    clock = PhaseClock()

    def observe(s) -> None:
        tl(s)
        clock(s)

    generate = llm.generate

    def timed_generate(prompts, *a, **k):  # the workload's call (not the 1-prompt warm-up)
        if len(prompts) > 1:
            tl.t0 = time.perf_counter()
        return generate(prompts, *a, **k)

    add = llm._add

    def timed_add(*a, **k):  # when the requests are all queued (the first step follows)
        ids = add(*a, **k)
        tl.added = time.perf_counter()
        return ids

    llm.generate = timed_generate  # type: ignore[method-assign]
    llm._add = timed_add  # type: ignore[method-assign]
    try:
        res = throughput.run(llm, ceil, wl, use_tqdm=False, observe=observe)
    finally:
        del llm.generate, llm._add
    end = time.perf_counter()
    phases = clock.phases()
    row("preset shared-prefix (timeline run)",
        f"{res.elapsed_s:.3f} s, {res.roofline_pct:.1f}% of roofline ({res.roofline_s:.3f} s), "
        f"host {100 * res.host_fraction:.1f}%; GPU phases " + ", ".join(
            f"{k} {n} steps {s:.3f} s" for k, (n, s) in sorted(phases.items())))  # fmt: skip
    tl.report("shared-prefix", end)


def _profile_window(engine, steps: range, label: str, num_steps_total: int) -> dict:
    """Profile ``engine.step()`` calls ``steps`` (0-based, counted by the caller's loop) and
    print kernel time by kind per step, the top kernels, and the GPU's busy share."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    torch.cuda.synchronize()
    prof.start()
    t0 = time.perf_counter()
    for _ in steps:
        engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    prof.stop()
    n = len(steps)
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    spans = []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = evt.time_range.elapsed_us()
        by_kind[kind_of(evt.name)] += us
        by_name[evt.name][0] += 1
        by_name[evt.name][1] += us
        spans.append((evt.time_range.start, evt.time_range.end))
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    total = sum(by_kind.values())
    row(f"profile {label}",
        f"{n} steps, wall {1e3 * wall / n:.2f} ms/step, kernel time {total / n / 1e3:.2f} ms/step "
        f"(sum; GPU busy {busy / n / 1e3:.2f} ms/step = {busy / 1e4 / max(wall, 1e-9):.0f}% of "
        f"the wall), {sum(c for c, _ in by_name.values()) / n:.0f} kernels/step")  # fmt: skip
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        row(f"  {label}: {kind}", f"{us / n / 1e3:.3f} ms/step ({100 * us / total:.1f}%)")
    print(f"  top kernels of {label} (us per step, launches per step):")
    for name, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:28]:
        print(f"    {us / n:9.1f} us  x{c / n:5.1f}  [{kind_of(name)}] {name[:100]}")
    return {"wall_ms": 1e3 * wall / n, "busy_ms": busy / n / 1e3, "by_kind": dict(by_kind)}


@section(
    "3. kernel-time profile by kind: admission steps, steady decode steps; the roofline's split"
)
def profile_steps(llm: LLM, ceil) -> None:
    engine = llm.llm_engine
    with queued_preset(engine, "shared-prefix", "prof"):
        RESULTS["profile admission"] = _profile_window(engine, range(4), "admission (steps 0-3)", 0)
        for _ in range(16):
            engine.step()
        RESULTS["profile decode"] = _profile_window(engine, range(24), "decode (steps 20-43)", 0)
        running = engine.scheduler.running
        ctx = [r.num_tokens for r in running]
    spec = ceil.as_gpu_spec()
    mc = engine.model_config
    members = len(ctx)
    cost = step_cost(mc, spec, decode_context_lens=ctx, precision=precision_of(engine),
                     decode_shared_tokens=max(0, members - 1) * 2000)  # fmt: skip
    bw, peak = spec.hbm_bandwidth_bytes_per_s, ceil.matmul_flops_per_s
    row("roofline split of that decode step",
        f"{members} rows, mean context {sum(ctx) / max(members, 1):.0f}: weights "
        f"{cost.weight_bytes / bw * 1e3:.2f} ms, KV read {cost.kv_read_bytes / bw * 1e3:.2f} ms "
        f"(bytes: {cost.memory_time_s * 1e3:.2f} ms); GEMM FLOPs "
        f"{cost.linear_flops / peak * 1e3:.2f} ms, attention FLOPs "
        f"{cost.attention_flops / peak * 1e3:.2f} ms (FLOPs: {cost.compute_time_s * 1e3:.2f} ms); "
        f"step {cost.time_s * 1e3:.2f} ms ({cost.bound})")  # fmt: skip


SHAPES = {  # Llama-3.1-8B: (N, K) of each linear layer, per layer count
    "qkv": (6144, 4096, 32),
    "o": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 1),
}


@section("4. dense GEMMs (F.linear / cuBLAS) at 256 and 8,192 rows vs their roofline")
def gemms(ceil) -> None:
    bw, peak = ceil.bandwidth_bytes_per_s, ceil.matmul_flops_per_s
    for m in (256, 8192):
        tot_t = tot_roof = 0.0
        for name, (n, k, count) in SHAPES.items():
            if name == "lm_head" and m > 256:
                continue  # a prefill step's LM head runs on its sampled rows only
            copies = max(1, min(4, (256 << 20) // (n * k * 2)))  # out of L2 between uses
            ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]

            def fn(ws=ws, x=x, outs=outs) -> None:
                for w, o in zip(ws, outs):
                    torch.matmul(x, w.t(), out=o)

            t = graph_time(fn) / copies
            flops = 2 * m * n * k
            roof = max((n * k + m * k + m * n) * 2 / bw, flops / peak)
            tot_t += t * count
            tot_roof += roof * count
            row(f"GEMM M={m} {name} {n}x{k}",
                f"{t * 1e6:.1f} us, {flops / t / 1e12:.0f} TFLOP/s, {100 * roof / t:.0f}% of its "
                f"roofline ({roof * 1e6:.1f} us)")  # fmt: skip
            del ws, outs, x
        row(f"GEMM M={m} whole model (32 layers{' + LM head' if m <= 256 else ''})",
            f"{tot_t * 1e3:.2f} ms against {tot_roof * 1e3:.2f} ms roofline "
            f"({100 * tot_roof / tot_t:.0f}%)")  # fmt: skip
    free()


@section("5. grouped cascade prefix kernel: split counts and tiles (B=256, prefix 2000)")
def prefix_sweep(ceil) -> GroupedTuning | None:
    """Each candidate alone (its prefix pass, its suffix pass) and both passes; returns the
    fastest of both passes if it beats the default by 3%."""
    b = shared_batch(256, 2000, 128)
    ref = decode_attention(b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], 128**-0.5,
                           max_seq_len=2128).float()  # fmt: skip
    base = GroupedTuning()
    t_base = graph_time(lambda: grouped(b, base))
    row("attn grouped default (both passes)", f"{t_base * 1e6:.1f} us")
    best: tuple[float, GroupedTuning] | None = None
    t_alone = graph_time(lambda: grouped(b, base, "prefix"))
    t_sfx = graph_time(lambda: grouped(b, base, "suffix"))
    row("attn grouped default prefix / suffix alone",
        f"{t_alone * 1e6:.1f} / {t_sfx * 1e6:.1f} us")  # fmt: skip
    # the previous default (2- and 3-stage tiles: Triton keeps no gathered tile in flight below
    # 5 stages; the prefix stream at normal priority) and the default's neighbours
    r = dataclasses.replace
    cands = [PREVIOUS, r(base, prefix_priority=False), r(base, prefix_splits=2),
             r(base, suffix=(64, 4, 3))]  # fmt: skip
    for t in cands:
        label = (f"bm {t.block_m} prefix {t.prefix} x{t.prefix_splits} suffix {t.suffix}"
                 f"{' prio' if t.prefix_priority else ''}")  # fmt: skip
        try:
            alone = graph_time(lambda t=t: grouped(b, t, "prefix"))
            both = graph_time(lambda t=t: grouped(b, t))
            if t.suffix != base.suffix:
                t_sfx = graph_time(lambda t=t: grouped(b, t, "suffix"))
                row(f"attn grouped suffix {t.suffix} alone", f"{t_sfx * 1e6:.1f} us")
            err = (grouped(b, t).float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001 - a config may not compile
            print(f"  {label}: {type(e).__name__}: {str(e)[:160]}")
            continue
        row(f"attn grouped {label}",
            f"prefix alone {alone * 1e6:.1f} us, both {both * 1e6:.1f} us, "
            f"max|diff| {err:.1e}")  # fmt: skip
        if err < 3e-2 and both < 0.97 * t_base and (best is None or both < best[0]):
            best = (both, t)
    if best is not None:  # the winner with its passes in turn (one stream)
        t = dataclasses.replace(best[1], concurrent=False)
        try:
            turn = graph_time(lambda: grouped(b, t))
            row("attn grouped best, passes in turn", f"{turn * 1e6:.1f} us")
            if turn < best[0]:
                best = (turn, t)
        except Exception as e:  # noqa: BLE001
            print(f"  best in turn: {type(e).__name__}: {str(e)[:160]}")
    # the suffix pass's fixed cost per program against its streaming: alone at 64 tokens
    for n_sfx in (64,):
        b2 = shared_batch(256, 2000, n_sfx)
        for sfx in (base.suffix, PREVIOUS.suffix):
            t = dataclasses.replace(base, suffix=sfx)
            try:
                dt = graph_time(lambda t=t, b2=b2: grouped(b2, t, "suffix"))
            except Exception as e:  # noqa: BLE001
                print(f"  suffix {sfx} at {n_sfx}: {type(e).__name__}: {str(e)[:120]}")
                continue
            nbytes = 256 * n_sfx * 8 * 128 * 2 * 2
            row(f"attn grouped suffix {sfx} alone, suffix {n_sfx}",
                f"{dt * 1e6:.1f} us, {nbytes / dt / 1e12:.2f} TB/s")  # fmt: skip
    free()
    return None if best is None else best[1]


@section("7. the shared-prefix preset with the sweep's fastest grouped tuning")
def winner(llm: LLM, ceil, cascade: GroupedTuning) -> None:
    """Twice, the cascade graphs captured again with it; then back to the default."""
    from roofline.kernels import cascade_attention as ca

    row("winner", str(cascade))
    saved_tuning = ca.TUNING
    try:
        set_cascade(llm, dataclasses.replace(ca.DEFAULT_TUNING, grouped=cascade))
        for i in (1, 2):
            run_preset(llm, ceil, "shared-prefix", f"winner {i}", count_cascade=True)
    finally:
        set_cascade(llm, saved_tuning)


@section("6. no regression: the default preset (and short)")
def regressions(llm: LLM, ceil, full: bool) -> None:
    """The default preset (its first run compiles its long prompts' prefill kernels), with
    ``full`` once more warm and the short preset."""
    run_preset(llm, ceil, "default", "run 1")
    if full:
        run_preset(llm, ceil, "default", "run 2, warm")
        run_preset(llm, ceil, "short")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="the short preset too")
    ap.add_argument("--final", action="store_true", help="no kernel sweeps")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t_start = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    row("ceilings", f"copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s")  # fmt: skip
    parity(args.final)
    t0 = time.perf_counter()
    kw = dict(max_model_len=8448, max_num_seqs=256, max_num_batched_tokens=8192)
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **kw)
    row("start-up", f"{time.perf_counter() - t0:.1f} s")
    preset_runs(llm, ceil)
    profile_steps(llm, ceil)
    regressions(llm, ceil, args.full or args.final)
    if args.final:
        del llm
        free()
        gemms(ceil)
        _summary(ceil, args.out, t_start)
        return
    cascade = prefix_sweep(ceil)
    if cascade is not None:
        winner(llm, ceil, cascade)
    del llm
    free()
    gemms(ceil)
    _summary(ceil, args.out, t_start)


def _summary(ceil, out_dir: str, t_start: float) -> None:
    print_rows("gpu_prefix", ROWS, time.perf_counter() - t_start)
    with open(os.path.join(out_dir, "prefix.json"), "w") as f:
        json.dump(RESULTS | {"ceilings": vars(ceil)}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
