"""The workload presets of `roofline bench throughput` on the GPU, with issue 13's switches on
and off: Llama-3.1-8B config, random bf16 weights, one engine for every preset. Sections, in
the order they run (each in try/except: an error is printed and the next section runs):

1. parity: a tiny fp32 Llama on the GPU, a shared-prefix workload (48 x (512 shared + 24), 16
   out): greedy tokens with cascade attention off vs each cascade variant (identical expected);
3. the cascade decode attention alone at the shared-prefix preset's decode shape (B = 256,
   prefix 2,000, suffix 128), replayed from CUDA graphs: prefix tiles x split counts (x the
   prefix pass on a side stream beside the suffix pass, ``TUNING.concurrent``), then (full run)
   suffix tiles for the best, plain decode attention per tile config at B = 256 over 256 and
   800 tokens of context, and the prefill part of a short-preset mixed bucket per tile config;
2. the shared-prefix preset (256 x (2,000 shared + 64), 128 out): time, % of its roofline,
   host share, GPU time by phase (prefill steps vs decode steps: CUDA events recorded as each
   step is scheduled), cascade steps, with cascade off, the default cascade, the sweep's best
   (if another) and, in the full run, the passes in turn (the old default);
4. the other presets (quick: short only; full: short, default, long-prompt);
6. the host share of steady decode at 256 running (goal < 15%) per way of waiting for the
   device: spinning, the default DeviceWaiter (sleeping on its CPU), a plain sleep, the thread
   pinned throughout; host milliseconds per step by piece (schedule with allocate; launch with
   the host batch, upload, graph staging and replay, LM head, sampler; fold-in);
5. (full run) a kernel-time profile of the shared-prefix preset: time by kernel name.

A table last; JSON into $OUT/presets.json.

    python scripts/gpu_presets.py --quick   # the first check (~80 s)
    python scripts/gpu_presets.py           # everything (< 4 min)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from gpu_common import print_rows, rows_and_sections  # scripts/ is on sys.path when run as a script

from roofline import LLM, SamplingParams
from roofline.bench import throughput, workloads
from roofline.bench.ceilings import measure, time_fn
from roofline.engine.heap import frozen_heap
from roofline.kernels import cascade_attention as ca
from roofline.kernels.decode_attention import decode_attention
from roofline.worker.device_wait import DeviceWaiter, _current_cpu
from roofline.worker.host_batch import HostBatch

DEV = torch.device("cuda")
ROWS: list[tuple[str, str]] = []
RESULTS: dict[str, object] = {}
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "eos_token_id": 2,
}
VARIANTS: dict[str, ca.CascadeTuning] = {
    "default": ca.DEFAULT_TUNING,
    "passes in turn (old default)": ca.CascadeTuning(
        prefix_config=(128, 64, 8, 2), prefix_splits=5
    ),
    "in turn, 64-row prefix tiles, 2 splits": ca.CascadeTuning(prefix_splits=2),
}


row, section = rows_and_sections(ROWS)


class PhaseClock:
    """GPU time by kind of step. An event is recorded on the stream as each step is scheduled
    (before its launch), so the time between two events is the device's time on the steps
    launched in between (and any idle gap): with one step in flight, the earlier step."""

    def __init__(self) -> None:
        self.marks: list[tuple[torch.cuda.Event, str]] = []

    def kind(self, sched_out) -> str:
        """The step's kind (subclasses split it finer)."""
        decode = sched_out.num_batched_tokens == len(sched_out.scheduled)
        return "decode" if decode else "prefill"

    def __call__(self, sched_out) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.marks.append((ev, self.kind(sched_out)))

    def phases(self) -> dict[str, tuple[int, float]]:
        """kind -> (steps, GPU seconds)."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        torch.cuda.synchronize()
        out: dict[str, list] = defaultdict(lambda: [0, 0.0])
        marks = self.marks + [(end, "")]
        for (a, kind), (b, _) in zip(marks, marks[1:]):
            out[kind][0] += 1
            out[kind][1] += a.elapsed_time(b) / 1e3
        return {k: (n, s) for k, (n, s) in out.items()}


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def set_cascade(llm: LLM, tuning: ca.CascadeTuning | None) -> None:
    """Cascade off (None) or on with ``tuning``; the cascade graphs are captured again (their
    split counts and launches are fixed at capture)."""
    runner = llm.llm_engine.runner
    if not hasattr(runner, "_saved_cascade"):
        runner._saved_cascade = runner.cascade  # type: ignore[attr-defined]
    if tuning is None:
        runner.cascade = None
        return
    runner.cascade = runner._saved_cascade  # type: ignore[attr-defined]
    if ca.TUNING != tuning:
        ca.TUNING = tuning
        cg = runner.cascade_graphs
        if cg is not None:  # the warm-up forwards store K/V at the buffers' slots: none
            cg.slot_mapping.fill_(-1)
            cg.seq_lens.fill_(1)
            cg.suffix_start.fill_(0)
            cg.capture(next(iter(runner.graphs.graphs.values())).pool())


@contextlib.contextmanager
def queued_preset(engine, name: str, tag: str, max_tokens: int = 128):
    """The preset's prompts queued on ``engine`` (the prefix cache reset first; greedy,
    ``max_tokens`` each, ids ``tag-i``) for a caller that steps the engine itself; on exit the
    rest is aborted and the engine drained."""
    engine.kv_manager.reset_prefix_cache()
    wl = workloads.preset(name, engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(wl.num_requests)]
    for rid, p in zip(ids, wl.prompts):
        engine.add_request(rid, p, params, stream=False)
    try:
        yield ids
    finally:
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()


def run_preset(llm: LLM, ceil, name: str, tag: str = "", count_cascade: bool = False):
    engine = llm.llm_engine
    engine.kv_manager.reset_prefix_cache()
    wl = workloads.preset(name, engine.model_config.vocab_size)
    clock = PhaseClock()
    runner = engine.runner
    cascade_steps = [0]
    plan = None
    if count_cascade and runner.cascade is not None:
        plan = runner.cascade.plan_rows

        def counted(rows):
            p = plan(rows)
            cascade_steps[0] += p is not None
            return p

        runner.cascade.plan_rows = counted
    waiter = runner.device_waiter
    over0 = waiter.num_overslept if waiter is not None else 0
    try:
        res = throughput.run(llm, ceil, wl, use_tqdm=False, observe=clock)
    finally:
        if plan is not None:
            del runner.cascade.plan_rows
    phases = clock.phases()
    if waiter is not None:
        phases["waits overslept"] = (waiter.num_overslept - over0, 0.0)
    label = f"{name}{' (' + tag + ')' if tag else ''}"
    ph = ", ".join(
        f"{k} steps {n}: {s:.3f} s ({1e3 * s / max(n, 1):.2f} ms/step)"
        for k, (n, s) in sorted(phases.items())
    )
    row(
        f"preset {label}",
        f"{res.elapsed_s:.3f} s, {res.output_tok_s:,.0f} out tok/s, {res.roofline_pct:.1f}% of "
        f"roofline ({res.roofline_s:.3f} s), host {100 * res.host_fraction:.1f}%, max running "
        f"{res.max_running}, {res.num_preemptions} preemptions, {len(res.jit_compiles)} JIT "
        f"compiles" + (f", cascade steps {cascade_steps[0]}" if count_cascade else ""),
    )
    row(f"  phases {label}", ph)
    RESULTS[f"preset {label}"] = vars(res) | {"phases": phases}
    return res


@section("1. parity: tiny fp32 Llama, 48 x (512 shared + 24), 16 out, cascade off vs variants")
def parity(quick: bool) -> None:
    n = 48
    wl = workloads.shared_prefix(n, 512, (24, 24), (16, 16), TINY["vocab_size"], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(TINY))
        llm = LLM(folder, load_format="dummy", device="cuda", dtype="float32", max_num_seqs=64,
                  max_model_len=1024, kv_cache_memory_bytes=512 << 20)  # fmt: skip
    runs, planned = {}, {}
    saved = ca.TUNING
    detector = llm.llm_engine.runner.cascade
    count = [0]
    if detector is not None:
        plan_rows = detector.plan_rows

        def counted(rows):
            p = plan_rows(rows)
            count[0] += p is not None
            return p

        detector.plan_rows = counted
    try:
        for name, tuning in [("off", None), *VARIANTS.items()][: 3 if quick else None]:
            set_cascade(llm, tuning)
            llm.llm_engine.kv_manager.reset_prefix_cache()
            count[0] = 0
            outs = llm.generate(wl.prompts, params, use_tqdm=False)
            runs[name], planned[name] = [o.outputs[0].token_ids for o in outs], count[0]
    finally:
        set_cascade(llm, saved)
    for name in [v for v in VARIANTS if v in runs]:
        same = sum(a == b for a, b in zip(runs["off"], runs[name]))
        row(
            f"parity tiny fp32 greedy, cascade off vs {name}",
            f"{same}/{n} identical ({planned[name]} cascade steps)",
        )
    del llm
    free()


def graph_time(fn, iters: int = 30) -> float:
    """Median seconds of ``fn`` replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    t = time_fn(graph.replay, DEV, iters=iters)
    del graph
    return t


def shared_batch(num_reqs: int, prefix_len: int, suffix_len: int, heads=(32, 8), dim=128):
    """Random paged bf16 K/V: every row = the shared prefix pages + its own pages."""
    page = 16
    num_heads, num_kv = heads
    prefix_pages, own = prefix_len // page, -(-suffix_len // page)
    num_pages = prefix_pages + num_reqs * own + 1
    gen = torch.Generator(device=DEV).manual_seed(0)
    kc = torch.randn(num_pages, page, num_kv, dim, device=DEV, generator=gen).to(torch.bfloat16)
    vc = torch.randn(num_pages, page, num_kv, dim, device=DEV, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(num_pages, device=DEV, generator=gen).to(torch.int32)
    shared = perm[:prefix_pages]
    table = torch.cat([shared.expand(num_reqs, -1), perm[prefix_pages:-1].view(num_reqs, own)], 1)
    i32 = torch.int32
    return dict(
        q=torch.randn(num_reqs, num_heads, dim, device=DEV, generator=gen).to(torch.bfloat16),
        kc=kc, vc=vc, table=table.contiguous(),
        seq_lens=torch.full((num_reqs,), prefix_len + suffix_len, dtype=i32, device=DEV),
        pages=shared.contiguous(), prefix_len=torch.tensor([prefix_len], dtype=i32, device=DEV),
        starts=torch.full((num_reqs,), prefix_len, dtype=i32, device=DEV),
    )  # fmt: skip


def run_cascade(b: dict, max_len: int = 8448):
    return ca.cascade_attention(
        b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], b["pages"], b["prefix_len"],
        b["starts"], 128**-0.5, max_suffix_len=max_len, max_prefix_len=max_len,
    )  # fmt: skip


@section("3. cascade decode attention at B=256, prefix 2000, suffix 128 (CUDA-graph timed)")
def kernel_sweep(ceil, quick: bool) -> ca.CascadeTuning | None:
    b = shared_batch(256, 2000, 128)
    ref = decode_attention(b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], 128**-0.5,
                           max_seq_len=2128).float()  # fmt: skip
    t_plain = graph_time(
        lambda: decode_attention(
            b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], 128**-0.5, max_seq_len=8448
        )  # fmt: skip
    )
    floor = (2000 + 256 * 128) * 8 * 128 * 2 * 2 / ceil.bandwidth_bytes_per_s
    row("attn plain decode", f"{t_plain * 1e6:.1f} us (cascade's K/V-read floor {floor * 1e6:.1f})")
    prefix_cfgs = [(64, 64, 4, 3), (64, 32, 4, 4), (64, 128, 4, 2), (128, 64, 8, 3)]
    stage1: list[tuple[str, ca.CascadeTuning]] = list(VARIANTS.items())
    for cfg in prefix_cfgs:
        for splits in (1, 2) if quick else (1, 2, 3, 5):
            for conc in (True,) if quick else (False, True):
                tuning = ca.CascadeTuning(
                    prefix_splits=splits, prefix_config=cfg, concurrent=conc,
                    suffix_config=ca.DEFAULT_TUNING.suffix_config,
                )  # fmt: skip
                stage1.append((f"prefix {cfg} x{splits}{' conc' if conc else ''}", tuning))
    best = _time_cascades(b, ref, stage1)
    if best is None:
        return None
    sfx_cfgs = [(64, 4, 3), (32, 4, 2), (16, 4, 3), (64, 4, 2), (32, 2, 3), (64, 8, 3)]
    stage2 = [
        (f"{best[1]} + suffix {sfx}", dataclasses.replace(best[2], suffix_config=sfx))
        for sfx in ([] if quick else sfx_cfgs)
    ]
    best2 = _time_cascades(b, ref, stage2) if stage2 else None
    if best2 is not None and best2[0] < best[0]:
        best = best2
    t, name, tuning = best
    row("attn cascade best", f"{name}: {t * 1e6:.1f} us ({t_plain / t:.2f}x plain)")
    for key in VARIANTS:
        if f"attn {key} us" in RESULTS:
            row(f"attn cascade {key}", f"{RESULTS[f'attn {key} us']} us")
    if not quick:  # measured in the first check (no gain over the default for plain decode)
        _plain_decode_configs(quick)
        _prefill_bucket_configs()
    free()
    return tuning


def _time_cascades(b: dict, ref: torch.Tensor, cands: list[tuple[str, ca.CascadeTuning]]):
    """(seconds, name, tuning) of the fastest candidate that matches ``ref``, or None."""
    saved = ca.TUNING
    best = None
    for name, tuning in cands:
        ca.TUNING = tuning
        try:
            t = graph_time(lambda: run_cascade(b))
            err = (run_cascade(b).float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001 - a config may not compile
            print(f"  {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        finally:
            ca.TUNING = saved
        print(f"  {name:56s} {t * 1e6:7.1f} us  max|diff| vs plain {err:.1e}", flush=True)
        RESULTS[f"attn {name} us"] = round(t * 1e6, 1)
        if err < 3e-2 and (best is None or t < best[0]):
            best = (t, name, tuning)
    return best


def _plain_decode_configs(quick: bool) -> None:
    """Plain decode attention (no cascade) at B=256 over 256- and 800-token contexts, per tile
    config (BLOCK_N, warps, stages): the short and default presets' decode kernel."""
    configs = [None, (32, 4, 3), (32, 4, 2), (64, 4, 2), (128, 4, 2), (64, 8, 3)]
    for ctx in (256, 800):
        b = shared_batch(256, 0, ctx)
        args = (b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], 128**-0.5)
        floor_bytes = 256 * ctx * 8 * 128 * 2 * 2
        for cfg in configs[:3] if quick else configs:
            try:
                t = graph_time(lambda: decode_attention(*args, max_seq_len=8448, config=cfg))  # noqa: B023
            except Exception as e:  # noqa: BLE001
                print(f"  plain ctx {ctx} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            print(
                f"  plain decode B=256 ctx {ctx} config {cfg or 'default'}: {t * 1e6:6.1f} us "
                f"({floor_bytes / t / 1e12:.2f} TB/s)",
                flush=True,
            )


def _prefill_bucket_configs() -> None:
    """The prefill part of a short-preset mixed step as its 768-row graph replays it: 253 decode
    rows first (the decode kernel's), prompts of 150/200/100/30 new tokens, a 35-row padding
    request, empty slots up to 17; prefill_attention per tile config (BLOCK_M, BLOCK_N, warps,
    stages), the graph's max_query_len = 768 (the default picks 128 x 128, 8 warps)."""
    from roofline.kernels.prefill_attention import prefill_attention

    d, lens, bucket, page = 253, [150, 200, 100, 30], 768, 16
    lens = lens + [bucket - d - sum(lens)]  # the padding request
    starts = [d]
    for n in lens:
        starts.append(starts[-1] + n)
    starts += [bucket] * (17 - len(lens))
    pages = [-(-n // page) for n in lens] + [0] * (17 - len(lens))
    table = torch.zeros(17, 64, dtype=torch.int32, device=DEV)
    nxt = 0
    for i, n in enumerate(pages):
        table[i, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32, device=DEV)
        nxt += n
    i32 = torch.int32
    q = torch.randn(bucket, 32, 128, device=DEV).to(torch.bfloat16)
    kc = torch.randn(nxt + 1, page, 8, 128, device=DEV).to(torch.bfloat16)
    vc = torch.randn_like(kc)
    qsl = torch.tensor(starts, dtype=i32, device=DEV)
    seq = torch.tensor(lens + [0] * (17 - len(lens)), dtype=i32, device=DEV)
    out = torch.empty_like(q)
    args = (q, kc, vc, table, qsl, seq, 128**-0.5, bucket)
    for cfg in [None, (64, 64, 4, 3), (64, 128, 4, 3)]:
        extra = (
            {} if cfg is None else dict(zip(("block_m", "block_n", "num_warps", "num_stages"), cfg))
        )
        try:
            t = graph_time(functools.partial(prefill_attention, *args, out=out, **extra))
        except Exception as e:  # noqa: BLE001
            print(f"  prefill bucket {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        row(
            f"prefill part of a 768-row mixed bucket, config {cfg or 'default'}",
            f"{t * 1e6:.1f} us",
        )


@section("2. shared-prefix preset: cascade off, default, variants")
def shared_prefix(llm: LLM, ceil, tunings: dict[str, ca.CascadeTuning]) -> None:
    saved = ca.TUNING
    try:
        set_cascade(llm, None)
        off = run_preset(llm, ceil, "shared-prefix", "cascade off")
        for name, tuning in tunings.items():
            set_cascade(llm, tuning)
            res = run_preset(llm, ceil, "shared-prefix", f"cascade {name}", count_cascade=True)
            row(f"  speed-up over cascade off ({name})", f"{off.elapsed_s / res.elapsed_s:.2f}x")
    finally:
        set_cascade(llm, saved)


@section("6. host share of steady decode at 256 running: how the engine waits")
def steady_decode(llm: LLM, steps: int, num_reqs: int = 256) -> None:
    """The engine's host share (goal < 15%) and host pieces per step at 256 running decodes
    (prompts 100-1024, ``stream=False`` as ``LLM.generate``), for ways of waiting for the
    device, one window of ``steps`` steps each over the same running batch: spinning, the
    default DeviceWaiter, the waiter with the engine thread pinned to one core (a woken thread
    may land on another core, caches cold), a longer spun tail, the default again."""
    variants = [
        ("spin", None, False),
        ("sleep on its CPU (the default)", DeviceWaiter(), False),
        ("sleep, not pinned", DeviceWaiter(pin_sleeps=False), False),
        ("sleep, thread pinned throughout", DeviceWaiter(), True),
    ]
    engine = llm.llm_engine
    runner, sched = engine.runner, engine.scheduler
    saved_waiter, saved_affinity = runner.device_waiter, os.sched_getaffinity(0)
    engine.kv_manager.reset_prefix_cache()
    vocab = engine.model_config.vocab_size
    wl = workloads.synthetic(num_reqs, (100, 1024), (1, 1), vocab, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=len(variants) * (steps + 8) + 16,
                            ignore_eos=True)  # fmt: skip
    ids = [f"steady-{i}" for i in range(num_reqs)]
    for rid, prompt in zip(ids, wl.prompts):
        engine.add_request(rid, prompt, params, stream=False)
    pieces: dict[str, float] = defaultdict(float)
    build = HostBatch.__dict__["build"]

    def timed(obj, attr: str, key: str):
        fn = getattr(obj, attr)

        def wrapper(*a, **k):
            t0, w0 = time.perf_counter(), engine.step_timing.wait_s
            try:
                return fn(*a, **k)
            finally:
                pieces[key] += time.perf_counter() - t0 - (engine.step_timing.wait_s - w0)

        setattr(obj, attr, wrapper)

    try:
        while sched.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
        ):
            engine.step()
        timed(sched, "schedule", "schedule")
        timed(runner, "launch", "launch")
        timed(engine, "_fold", "fold-in")
        timed(engine, "_emit", "outputs")
        # inside launch: the host batch, its upload, the graph's staging and replay, the LM
        # head, the sampler, the handle (the ids' copy and event)
        timed(HostBatch, "build", "  build")
        timed(runner, "_upload", "  upload")
        for graphs in (runner.graphs, runner.cascade_graphs):
            if graphs is not None:
                timed(graphs, "stage_inputs", "  stage")
                timed(graphs, "replay", "  replay")
        timed(runner.model, "compute_logits", "  LM head")
        timed(runner, "_sample", "  sample")
        timed(sched.kv, "allocate", "  (schedule) allocate")
        for name, waiter, pin in variants:
            runner.device_waiter = waiter
            os.sched_setaffinity(
                0, {_current_cpu() or min(saved_affinity)} if pin else saved_affinity
            )
            for _ in range(8):  # the waiter learns its estimate
                engine.step()
            pieces.clear()
            t0 = dataclasses.replace(engine.step_timing)
            with frozen_heap():
                start, cpu0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    engine.step()
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
            timing = engine.step_timing.since(t0)
            over = f", {waiter.num_overslept} overslept" if isinstance(waiter, DeviceWaiter) else ""
            row(
                f"steady decode {sched.num_running}, {name}",
                f"{1e3 * elapsed / steps:.2f} ms/step, host share "
                f"{100 * timing.host_fraction:.1f}%, CPU {100 * cpu / elapsed:.0f}% of a core"
                f"{over}; host ms/step: "
                + ", ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in pieces.items()),
            )
    finally:
        HostBatch.build = build  # type: ignore[method-assign]
        for obj, attr in [(runner, "_upload"), (runner.model, "compute_logits"),
                          (runner, "_sample"), (sched.kv, "allocate")]:  # fmt: skip
            obj.__dict__.pop(attr, None)
        for graphs in (runner.graphs, runner.cascade_graphs):
            if graphs is not None:
                graphs.__dict__.pop("stage_inputs", None)
                graphs.__dict__.pop("replay", None)
        sched.__dict__.pop("schedule", None)
        runner.__dict__.pop("launch", None)
        engine.__dict__.pop("_fold", None)
        engine.__dict__.pop("_emit", None)
        os.sched_setaffinity(0, saved_affinity)
        runner.device_waiter = saved_waiter
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()


@section("5. kernel-time profile of the shared-prefix preset")
def profile(llm: LLM, ceil) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_preset(llm, ceil, "shared-prefix", "profiled")
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.name][0] += 1
            totals[evt.name][1] += evt.time_range.elapsed_us() / 1e6
    total = sum(s for _, s in totals.values())
    print(f"  kernel time in all: {total:.3f} s")
    for name, (n, s) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  {s:8.3f} s {100 * s / total:5.1f}%  x{n:6d}  {name[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the < 90 s first check")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--engine-kwargs", default="{}", help="JSON of extra LLM(...) arguments")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t_start = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    row(
        "ceilings",
        f"copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s",
    )
    parity(args.quick)
    best = kernel_sweep(ceil, args.quick)
    t0 = time.perf_counter()
    kw = dict(max_model_len=8448, max_num_seqs=256, max_num_batched_tokens=8192)
    kw.update(json.loads(args.engine_kwargs))
    llm = LLM(args.model, load_format="dummy", device="cuda", **kw)
    row("start-up", f"{time.perf_counter() - t0:.1f} s ({kw})")
    tunings = {"default": VARIANTS["default"]}
    if not args.quick:
        tunings["passes in turn (old default)"] = VARIANTS["passes in turn (old default)"]
    if best is not None and best not in tunings.values():
        tunings["best of sweep"] = best
    shared_prefix(llm, ceil, tunings)
    presets = ["short"] if args.quick else ["short", "default", "long-prompt"]
    for name in presets:
        section(f"4. preset {name}")(run_preset)(llm, ceil, name)
    steady_decode(llm, 30 if args.quick else 60)
    if not args.quick:
        profile(llm, ceil)
    print_rows("gpu_presets", ROWS, time.perf_counter() - t_start)
    with open(os.path.join(args.out, "presets.json"), "w") as f:
        json.dump(RESULTS | {"ceilings": vars(ceil)}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
