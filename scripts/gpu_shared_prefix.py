"""The shared-prefix preset's attention on the GPU: the grouped cascade kernels
(``kernels/cascade_grouped.py``) against the previous cascade and plain decode, then the preset
and the figures the change could regress. Sections (each in try/except: an error is printed and
the next section runs):

1. parity: greedy tokens with cascade off vs on and GQA prefill off vs on (fp32, a tiny Llama
   at 160 rows: past the grouped kernels' batch threshold), and the kernels against plain
   decode at the preset's decode shape with some non-member rows;
2. the cascade decode attention at B = 256, prefix 2,000, suffix 128 (CUDA-graph timed):
   plain decode, the previous default, the grouped default, each grouped kernel alone per
   launch choice, the fastest of each paired (side by side and in turn); the best at suffix
   64 / 192 against the previous default;
3. the shared-prefix preset (Llama-3.1-8B config, random bf16 weights): the previous default
   and the sweep's best alternating, twice each, and the best with GQA prefill off; time, % of
   roofline, GPU time by phase (prefill-bearing vs decode steps);
2b. prefill attention at the preset's admission shape (127 requests x 64 new tokens over a
   2,000-token cached prefix) and over fresh short prompts: per-head tiles vs GQA-packed;
4. no regression: the default preset, the short preset (GQA prefill on; in the full run also
   off, and on in the mixed-step graph buckets too) and 8B batch-1 decode (>= 169 tok/s);
5. (full run) a kernel-time profile of the shared-prefix preset.

    python scripts/gpu_shared_prefix.py --quick   # the defaults, no sweeps (~2 min)
    python scripts/gpu_shared_prefix.py           # everything (~4.5 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import print_rows  # noqa: E402
from gpu_presets import (  # noqa: E402
    RESULTS,
    ROWS,
    TINY,
    free,
    graph_time,
    row,
    run_preset,
    section,
    set_cascade,
    shared_batch,
)

from roofline import LLM, SamplingParams  # noqa: E402
from roofline.bench import latency, workloads  # noqa: E402
from roofline.bench.ceilings import measure  # noqa: E402
from roofline.kernels import cascade_attention as ca  # noqa: E402
from roofline.kernels import prefill_attention_gqa as gqa  # noqa: E402
from roofline.kernels.cascade_grouped import GroupedTuning, grouped_cascade_attention  # noqa: E402
from roofline.kernels.decode_attention import decode_attention  # noqa: E402
from roofline.kernels.prefill_attention import prefill_attention  # noqa: E402

DEV = torch.device("cuda")
OLD = dataclasses.replace(ca.DEFAULT_TUNING, grouped=None)  # the previous default


def greedy_parity(config: dict | str, n: int, prefix: int, own: int, out_len: int,
                  label: str, quick: bool = False) -> None:  # fmt: skip
    kw = dict(load_format="dummy", device="cuda", dtype="float32", max_num_seqs=n,
              max_model_len=2048, kv_cache_memory_bytes=2 << 30)  # fmt: skip
    if isinstance(config, str):  # a shipped config's name
        llm = LLM(config, **kw)
    else:
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "config.json").write_text(json.dumps(config))
            llm = LLM(folder, **kw)
    vocab = llm.llm_engine.model_config.vocab_size
    wl = workloads.shared_prefix(n, prefix, (own, own), (out_len, out_len), vocab, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    runner = llm.llm_engine.runner
    count = [0]
    detector = runner.cascade
    if detector is not None:
        plan_rows = detector.plan_rows

        def counted(rows):
            p = plan_rows(rows)
            count[0] += p is not None
            return p

        detector.plan_rows = counted
    runs, planned = {}, {}
    saved = ca.TUNING
    try:
        modes = [("off", None, True), ("off, GQA prefill off", None, False),
                 ("grouped", ca.DEFAULT_TUNING, True)]  # fmt: skip
        for name, tuning, gqa_on in modes:
            if quick and name != "grouped" and name != "off":
                continue
            set_cascade(llm, tuning)
            gqa.ENABLED = gqa_on
            llm.llm_engine.kv_manager.reset_prefix_cache()
            count[0] = 0
            outs = llm.generate(wl.prompts, params, use_tqdm=False)
            runs[name], planned[name] = [o.outputs[0].token_ids for o in outs], count[0]
    finally:
        set_cascade(llm, saved)
        gqa.ENABLED = True
    for name in [n for n in ("off, GQA prefill off", "previous", "grouped") if n in runs]:
        same = sum(a == b for a, b in zip(runs["off"], runs[name]))
        row(f"parity {label}, cascade off vs {name}",
            f"{same}/{n} identical ({planned[name]} cascade steps)")  # fmt: skip
    del llm
    free()


@section("1. parity: greedy tokens cascade off vs on (fp32), kernels vs plain decode")
def parity(quick: bool) -> None:
    greedy_parity(TINY, 160, 512, 24, 16, "tiny fp32 Llama 160 x (512 + 24)", quick)
    # kernel level: 256 rows at the preset's shape, every 7th row not a member (its whole
    # context in the suffix pass), bf16 and fp32
    for dtype in (torch.bfloat16, torch.float32):
        b = shared_batch(256, 2000, 128)
        if dtype is torch.float32:
            for key in ("q", "kc", "vc"):
                b[key] = b[key].float()
        b["starts"][::7] = 0
        ref = decode_attention(b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], 128**-0.5,
                               max_seq_len=2128).float()  # fmt: skip
        other = GroupedTuning(concurrent=False, prefix_splits=2)
        for name, tuning in [("default", GroupedTuning()), ("in turn, 2 splits", other)]:
            out = grouped(b, tuning).float()
            out2 = grouped(b, tuning).float()
            row(f"kernel parity {str(dtype)[6:]} grouped {name}",
                f"max|diff| vs plain {(out - ref).abs().max().item():.1e}, relaunch identical "
                f"{bool(torch.equal(out, out2))}")  # fmt: skip


def grouped(b: dict, tuning: GroupedTuning, passes: str = "both"):
    return grouped_cascade_attention(
        b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], b["pages"], b["prefix_len"],
        b["starts"], 128**-0.5, tuning, passes=passes,
    )  # fmt: skip


def previous(b: dict):
    saved = ca.TUNING
    ca.TUNING = OLD
    try:
        return ca.cascade_attention(
            b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], b["pages"], b["prefix_len"],
            b["starts"], 128**-0.5, max_suffix_len=8448, max_prefix_len=8448,
        )  # fmt: skip
    finally:
        ca.TUNING = saved


def _time(name: str, fn, ref=None) -> float | None:
    try:
        t = graph_time(fn)
        err = "" if ref is None else f"  max|diff| {(fn().float() - ref).abs().max().item():.1e}"
    except Exception as e:  # noqa: BLE001 - a config may not compile
        print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    print(f"  {name:64s} {t * 1e6:7.1f} us{err}", flush=True)
    RESULTS[f"attn {name}"] = round(t * 1e6, 2)
    return t


PREFIX_CANDS = [  # (block_m, (BLOCK_N, warps, stages), splits, maxnreg)
    (64, (64, 4, 2), 1, None), (64, (64, 4, 2), 2, None), (64, (64, 4, 3), 1, None),
    (64, (64, 8, 2), 1, None), (64, (64, 8, 2), 2, None), (64, (32, 4, 3), 2, None),
    (128, (64, 8, 2), 1, None), (128, (64, 8, 2), 2, None), (128, (64, 8, 2), 2, 168),
    (128, (128, 8, 2), 2, None), (64, (64, 4, 2), 1, 128), (64, (64, 8, 3), 2, None),
    (64, (128, 8, 2), 2, None),
]  # fmt: skip
SUFFIX_CANDS = [  # ((BLOCK_N, warps, stages), maxnreg)
    ((64, 4, 3), None), ((64, 4, 3), 96), ((32, 4, 3), None), ((32, 4, 3), 96),
    ((64, 4, 2), None), ((64, 8, 3), None), ((128, 4, 2), None),
]  # fmt: skip


@section("2. cascade decode attention, B=256, prefix 2000 (CUDA-graph timed)")
def kernel_sweep(ceil, quick: bool) -> GroupedTuning | None:
    """Each grouped kernel alone per launch choice, then the fastest of each paired side by
    side and in turn; the previous default and plain decode beside them."""
    b = shared_batch(256, 2000, 128)
    ref = decode_attention(b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], 128**-0.5,
                           max_seq_len=2128).float()  # fmt: skip
    kv = 8 * 128 * 2 * 2
    bw, mm = ceil.bandwidth_bytes_per_s, ceil.matmul_flops_per_s
    row("attn floors, suffix 128",
        f"K/V reads {(2000 + 256 * 128) * kv / bw * 1e6:.1f} us (suffix alone "
        f"{256 * 128 * kv / bw * 1e6:.1f}), prefix MMA {4 * 256 * 32 * 2000 * 128 / mm * 1e6:.1f} us")  # fmt: skip  # noqa: E501
    t_plain = _time("plain decode", lambda: decode_attention(
        b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], 128**-0.5, max_seq_len=8448))  # fmt: skip  # noqa: E501
    t_prev = _time("previous cascade default", lambda: previous(b), ref)
    t_new = _time("grouped default", lambda: grouped(b, GroupedTuning()), ref)
    base = GroupedTuning()
    if quick:  # the defaults only: each kernel alone, then side by side
        tp = _time("grouped prefix kernel alone", lambda: grouped(b, base, "prefix"))
        ts = _time("grouped suffix kernel alone", lambda: grouped(b, base, "suffix"))
        if None not in (t_plain, t_prev, t_new, tp, ts):
            row("attn plain / previous / grouped default (prefix alone, suffix alone)",
                f"{t_plain * 1e6:.1f} / {t_prev * 1e6:.1f} / {t_new * 1e6:.1f} us "
                f"({tp * 1e6:.1f}, {ts * 1e6:.1f})")  # fmt: skip
        free()
        return None
    prefix_alone = []
    for bm, cfg, splits, cap in PREFIX_CANDS[: 5 if quick else None]:
        t = dataclasses.replace(base, block_m=bm, prefix=cfg, prefix_splits=splits,
                                prefix_maxnreg=cap)  # fmt: skip
        dt = _time(f"prefix alone: bm {bm} {cfg} x{splits} cap {cap}",
                   lambda t=t: grouped(b, t, "prefix"))  # fmt: skip
        if dt is not None:
            prefix_alone.append((dt, t))
    suffix_alone = []
    for cfg, cap in SUFFIX_CANDS[: 4 if quick else None]:
        t = dataclasses.replace(base, suffix=cfg, suffix_maxnreg=cap)
        dt = _time(f"suffix alone: {cfg} cap {cap}", lambda t=t: grouped(b, t, "suffix"))
        if dt is not None:
            suffix_alone.append((dt, t))
            row(f"attn suffix alone {cfg} cap {cap}",
                f"{dt * 1e6:.1f} us, {256 * 128 * kv / dt / 1e12:.2f} TB/s")  # fmt: skip
    prefix_alone.sort(key=lambda x: x[0])
    suffix_alone.sort(key=lambda x: x[0])
    for dt, t in prefix_alone[:4]:
        row(f"attn prefix alone bm {t.block_m} {t.prefix} x{t.prefix_splits} cap "
            f"{t.prefix_maxnreg}", f"{dt * 1e6:.1f} us")  # fmt: skip
    pairs = []
    for _, tp in prefix_alone[:4]:
        for _, ts in suffix_alone[:2]:
            for conc in (True, False):
                pairs.append(dataclasses.replace(tp, suffix=ts.suffix,
                                                 suffix_maxnreg=ts.suffix_maxnreg,
                                                 concurrent=conc))  # fmt: skip
    # capped registers on both sides: more suffix programs beside each prefix program
    for bm, cfg, splits, cap in [(64, (64, 4, 2), 1, 128), (64, (64, 4, 2), 2, 128),
                                 (64, (32, 4, 3), 2, None), (128, (64, 8, 2), 2, 168)]:  # fmt: skip
        pairs.append(dataclasses.replace(base, block_m=bm, prefix=cfg, prefix_splits=splits,
                                         prefix_maxnreg=cap, suffix=(64, 4, 3),
                                         suffix_maxnreg=96))  # fmt: skip
    best = _sweep(b, ref, [base] + pairs, None)
    if best is not None:
        row("attn grouped best", f"{best[0] * 1e6:.1f} us: {_label(best[1])}")
    if None not in (t_plain, t_prev, t_new):
        row("attn plain / previous / grouped default",
            f"{t_plain * 1e6:.1f} / {t_prev * 1e6:.1f} / {t_new * 1e6:.1f} us")  # fmt: skip
    if best is not None:  # smaller batches (the threshold is 33 rows at 8 KV heads)
        for nb in (40, 96):
            b2 = shared_batch(nb, 2000, 128)
            ref2 = decode_attention(b2["q"], b2["kc"], b2["vc"], b2["table"], b2["seq_lens"],
                                    128**-0.5, max_seq_len=2128).float()  # fmt: skip
            tp = _time(f"previous, B={nb}", lambda b2=b2: previous(b2), ref2)
            tb = _time(f"grouped best, B={nb}", lambda b2=b2: grouped(b2, best[1]), ref2)
            if tp is not None and tb is not None:
                row(f"attn B={nb} suffix 128: previous / grouped best",
                    f"{tp * 1e6:.1f} / {tb * 1e6:.1f} us")  # fmt: skip
    if best is not None and not quick:  # the best at other suffix lengths
        for suffix in (64, 192):
            b2 = shared_batch(256, 2000, suffix)
            ref2 = decode_attention(b2["q"], b2["kc"], b2["vc"], b2["table"], b2["seq_lens"],
                                    128**-0.5, max_seq_len=2000 + suffix).float()  # fmt: skip
            tp = _time(f"previous, suffix {suffix}", lambda b2=b2: previous(b2), ref2)
            tb = _time(f"grouped best, suffix {suffix}", lambda b2=b2: grouped(b2, best[1]), ref2)
            if tp is not None and tb is not None:
                row(f"attn suffix {suffix}: previous / grouped best",
                    f"{tp * 1e6:.1f} / {tb * 1e6:.1f} us")  # fmt: skip
    free()
    return None if best is None else best[1]


def _sweep(b, ref, cands, best):
    for tuning in cands:
        t = _time(_label(tuning), lambda: grouped(b, tuning), ref)  # noqa: B023
        if t is not None and (best is None or t < best[0]):
            err = (grouped(b, tuning).float() - ref).abs().max().item()
            if err < 3e-2:
                best = (t, tuning)
    return best


def _label(t: GroupedTuning) -> str:
    way = "conc" if t.concurrent else "in turn"
    return (f"bm {t.block_m} prefix {t.prefix} x{t.prefix_splits} cap {t.prefix_maxnreg} | "
            f"suffix {t.suffix} cap {t.suffix_maxnreg} | {way}")  # fmt: skip


@section("2b. prefill attention at the preset's admission steps: 127 x 64 new over 2,000 cached")
def prefill_kernels(ceil, quick: bool) -> tuple | None:
    """The admission steps' attention: per-head tiles (the default descriptor variant and the
    paged one) vs GQA-packed tiles per config; then fresh short prompts (the short preset's
    kind of chunk)."""
    best = None
    fresh = [(20 + (230 * i) // 39, 0) for i in range(40)]
    shapes = [  # (label, shared prefix tokens, [(query_len, context_len)])
        ("admission step 2: 128 x (2000 cached + 64)", 2000, [(64, 2000)] * 128),
        ("admission step 1: 2064 fresh + 96 x (2000 + 64)", 2000, [(2064, 0)] + [(64, 2000)] * 96),
        ("fresh prompts 40 x 20..250", 0, fresh),
    ]
    for label, shared_len, reqs in shapes:
        gen = torch.Generator(device=DEV).manual_seed(1)
        page = 16
        n = len(reqs)
        qlens = [ql for ql, _ in reqs]
        seqs = [ql + c for ql, c in reqs]
        shared = shared_len // page
        own = [-(-(sl - shared_len) // page) for sl in seqs]
        num_pages = shared + sum(own) + 1
        kc = torch.randn(num_pages, page, 8, 128, device=DEV, generator=gen).to(torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.zeros(n, shared + max(own), dtype=torch.int32, device=DEV)
        nxt = shared
        for i, o in enumerate(own):
            table[i, :shared] = torch.arange(shared, device=DEV)
            table[i, shared : shared + o] = torch.arange(nxt, nxt + o, device=DEV)
            nxt += o
        seq = torch.tensor(seqs, dtype=torch.int32, device=DEV)
        qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32,
                           device=DEV)  # fmt: skip
        t_tok = sum(qlens)
        q = torch.randn(t_tok, 32, 128, device=DEV, generator=gen).to(torch.bfloat16)
        pos = [c + torch.arange(ql, device=DEV) for ql, c in reqs]
        slots = torch.cat([table[i, p // page].long() * page + p % page
                           for i, p in enumerate(pos)])  # fmt: skip
        k_new = kc.view(-1, 8, 128)[slots]
        v_new = vc.view(-1, 8, 128)[slots]
        mq = max(qlens)
        args = (q, kc, vc, table, qsl, seq, 128**-0.5)
        flops = sum(4 * 128 * 32 * (ql * c + ql * (ql + 1) // 2) for ql, c in reqs)
        ref = prefill_attention(*args, max_query_len=mq, variant="base").float()
        cands = [("per-head, default variant",
                  lambda: prefill_attention(*args, max_query_len=mq, k_new=k_new, v_new=v_new)),  # noqa: B023
                 ("per-head, paged variant",
                  lambda: prefill_attention(*args, max_query_len=mq, variant="base"))]  # noqa: B023  # fmt: skip
        if quick:
            cands = cands[:1]
        cfgs = [None, (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3)]
        for cfg in cfgs if not quick else cfgs[:1]:
            cands.append((f"GQA-packed {cfg or 'default'}",
                          lambda cfg=cfg: gqa.prefill_attention_gqa(*args, config=cfg)))  # noqa: B023  # fmt: skip
        for name, fn in cands:
            t = _time(f"{label}: {name}", fn, ref)
            if t is not None:
                row(f"prefill {label}: {name}", f"{t * 1e6:.1f} us, {flops / t / 1e12:.0f} TFLOP/s")
                if name.startswith("GQA") and shared_len and (best is None or t < best[0]):
                    best = (t, name)
    free()
    return best


@section("3. shared-prefix preset: previous / grouped best, each twice")
def presets(llm: LLM, ceil, best: GroupedTuning | None, quick: bool) -> ca.CascadeTuning:
    """The preset with the previous default and the grouped kernels (the sweep's best, else
    the default), alternating, twice each (runs differ by up to ~10% in decode step time);
    GQA prefill off once. Returns the grouped tuning it ran."""
    saved = ca.TUNING
    grouped_tuning = ca.DEFAULT_TUNING
    if best is not None:
        grouped_tuning = dataclasses.replace(ca.DEFAULT_TUNING, grouped=best)
    try:
        label = "grouped best" if best is not None else "grouped default"
        runs = [("previous default", OLD), (label, grouped_tuning)] * (1 if quick else 2)
        if quick:
            runs.append((label, grouped_tuning))
        for i, (name, tuning) in enumerate(runs):
            set_cascade(llm, tuning)
            run_preset(llm, ceil, "shared-prefix", f"{name} #{i // 2 + 1}", count_cascade=True)
        if not quick:
            gqa.ENABLED = False
            try:
                run_preset(llm, ceil, "shared-prefix", f"{label}, GQA prefill off",
                           count_cascade=True)  # fmt: skip
            finally:
                gqa.ENABLED = True
    finally:
        set_cascade(llm, saved)
    return grouped_tuning


@section("4. no regression: the default and short presets, 8B batch-1 decode")
def regressions(llm: LLM, ceil, quick: bool) -> None:
    run_preset(llm, ceil, "default")
    run_preset(llm, ceil, "short", "GQA prefill on")
    if not quick:
        gqa.ENABLED = False
        try:
            run_preset(llm, ceil, "short", "GQA prefill off")
        finally:
            gqa.ENABLED = True
        path = llm.llm_engine.runner.mixed
        graphs = None if path is None else path.graphs  # mixed_graph.MixedGraphs
        if graphs is not None and graphs.graphs:  # the mixed-step buckets packed too
            gqa.IN_GRAPHS = True
            try:
                t0 = time.perf_counter()
                graphs.capture()
                print(f"  mixed graphs captured again in {time.perf_counter() - t0:.1f} s")
                run_preset(llm, ceil, "short", "GQA prefill on, in graph buckets too")
            finally:
                gqa.IN_GRAPHS = False
                graphs.capture()
    rows = latency.run(llm.llm_engine, ceil, [1], 512, 128)
    print(latency.format_rows(rows), flush=True)
    for r in latency.as_dicts(rows):
        row("8B batch-1 decode", json.dumps(r)[:300])


@section("5. kernel-time profile of the shared-prefix preset (grouped best)")
def profile(llm: LLM, ceil, tuning: ca.CascadeTuning) -> None:
    from collections import defaultdict

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    saved = ca.TUNING
    set_cascade(llm, tuning)
    try:
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_preset(llm, ceil, "shared-prefix", "profiled")
    finally:
        set_cascade(llm, saved)
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.name][0] += 1
            totals[evt.name][1] += evt.time_range.elapsed_us() / 1e6
    total = sum(s for _, s in totals.values())
    print(f"  kernel time in all: {total:.3f} s")
    for name, (n, s) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:22]:
        print(f"  {s * 1e3:8.1f} ms x{n:6d} {1e6 * s / n:8.1f} us  {name[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t_start = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    row("ceilings", f"copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s")  # fmt: skip
    parity(args.quick)
    best = kernel_sweep(ceil, args.quick)
    prefill_kernels(ceil, args.quick)
    t0 = time.perf_counter()
    kw = dict(max_model_len=8448, max_num_seqs=256, max_num_batched_tokens=8192)
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **kw)
    row("start-up", f"{time.perf_counter() - t0:.1f} s")
    grouped_tuning = presets(llm, ceil, best, args.quick)
    regressions(llm, ceil, args.quick)
    if not args.quick:
        profile(llm, ceil, grouped_tuning or ca.DEFAULT_TUNING)
    print_rows("gpu_shared_prefix", ROWS, time.perf_counter() - t_start)
    with open(os.path.join(args.out, "shared_prefix.json"), "w") as f:
        json.dump(RESULTS | {"ceilings": vars(ceil)}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
