"""The shared-prefix preset's attention on the GPU: the grouped cascade kernels
(``kernels/cascade_grouped.py``) against the previous cascade and plain decode, then the preset
and the figures the change could regress. Sections (each in try/except: an error is printed and
the next section runs):

1. parity: greedy tokens with cascade off vs on (fp32: a tiny Llama at 160 rows and the
   Qwen3-0.6B config at 64 rows, both past the grouped kernels' batch threshold), and the
   kernels against plain decode at the preset's decode shape with some non-member rows;
2. the cascade decode attention at B = 256, prefix 2,000, suffix 64 / 128 / 192 (CUDA-graph
   timed): plain decode, the previous default, the grouped default, each grouped kernel alone,
   then a staged sweep of the grouped launch choices (prefix tile and splits, suffix requests
   per program and tile, the passes side by side or in turn);
3. the shared-prefix preset (Llama-3.1-8B config, random bf16 weights): cascade off, the
   previous default, the grouped default, the sweep's best; time, % of roofline, GPU time by
   phase (prefill-bearing vs decode steps);
2b. prefill attention at the preset's admission shape (127 requests x 64 new tokens over a
   2,000-token cached prefix) and over fresh short prompts: per-head tiles vs GQA-packed;
4. no regression: the default preset, the short preset (GQA prefill on; off too in the full
   run) and 8B batch-1 decode (>= 169 tok/s);
5. (full run) a kernel-time profile of the shared-prefix preset.

    python scripts/gpu_shared_prefix.py --quick   # first check (~100 s)
    python scripts/gpu_shared_prefix.py           # everything (< 4 min)
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
                 ("previous", OLD, True), ("grouped", ca.DEFAULT_TUNING, True)]  # fmt: skip
        for name, tuning, gqa_on in modes:
            if quick and name == "previous":
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
    if not quick:
        greedy_parity("qwen3-0.6b", 64, 512, 32, 16, "Qwen3-0.6B-config fp32 64 x (512 + 32)")
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
        other = GroupedTuning(concurrent=False, prefix_splits=2, suffix_reqs=1)
        for name, tuning in [("default", GroupedTuning()), ("in turn, 2 splits, 1 req", other)]:
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


@section("2. cascade decode attention, B=256, prefix 2000 (CUDA-graph timed)")
def kernel_sweep(ceil, quick: bool) -> GroupedTuning | None:
    best: tuple[float, GroupedTuning] | None = None
    for suffix in (64, 128, 192) if not quick else (128,):
        b = shared_batch(256, 2000, suffix)
        ref = decode_attention(b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], 128**-0.5,
                               max_seq_len=2000 + suffix).float()  # fmt: skip
        kv = 8 * 128 * 2 * 2
        floor = (2000 + 256 * suffix) * kv / ceil.bandwidth_bytes_per_s
        flops = 4 * 256 * 32 * 2000 * 128 / ceil.matmul_flops_per_s
        row(f"attn floors, suffix {suffix}",
            f"K/V reads {floor * 1e6:.1f} us (suffix alone {256 * suffix * kv / ceil.bandwidth_bytes_per_s * 1e6:.1f}), "  # noqa: E501
            f"prefix MMA {flops * 1e6:.1f} us")  # fmt: skip
        t_plain = _time(f"plain decode, suffix {suffix}", lambda: decode_attention(
            b["q"], b["kc"], b["vc"], b["table"], b["seq_lens"], 128**-0.5, max_seq_len=8448))  # fmt: skip  # noqa: B023, E501
        t_prev = _time(f"previous cascade default, suffix {suffix}", lambda: previous(b), ref)  # noqa: B023
        t_new = _time(f"grouped default, suffix {suffix}", lambda: grouped(b, GroupedTuning()),  # noqa: B023
                      ref)  # fmt: skip
        _time(f"  grouped prefix kernel alone, suffix {suffix}",
              lambda: grouped(b, GroupedTuning(), "prefix"))  # fmt: skip  # noqa: B023
        _time(f"  grouped suffix kernel alone, suffix {suffix}",
              lambda: grouped(b, GroupedTuning(), "suffix"))  # fmt: skip  # noqa: B023
        tma = GroupedTuning(suffix_tma=True, suffix=(16, 4, 3))
        _time(f"  grouped TMA suffix kernel alone, suffix {suffix}",
              lambda: grouped(b, tma, "suffix"))  # fmt: skip  # noqa: B023
        _time(f"grouped, TMA suffix, suffix {suffix}", lambda: grouped(b, tma), ref)  # noqa: B023
        if None not in (t_plain, t_prev, t_new):
            row(f"attn suffix {suffix}: plain / previous / grouped",
                f"{t_plain * 1e6:.1f} / {t_prev * 1e6:.1f} / {t_new * 1e6:.1f} us")  # fmt: skip
        if suffix != 128:
            continue
        # staged sweep at suffix 128
        base = GroupedTuning()
        stage1 = [base, dataclasses.replace(base, prefix_splits=2)]
        prefix_cfgs = [(128, (64, 8, 2), 1), (128, (64, 8, 2), 2), (64, (64, 4, 2), 1)]
        if not quick:
            prefix_cfgs += [(128, (64, 8, 3), 1), (128, (64, 8, 3), 2), (128, (32, 8, 3), 2)]
            prefix_cfgs += [(64, (32, 4, 3), 1), (64, (128, 4, 2), 1), (64, (64, 4, 2), 2)]
        for bm, pcfg, splits in prefix_cfgs:
            stage1.append(dataclasses.replace(base, block_m=bm, prefix=pcfg, prefix_splits=splits))
        best = _sweep(b, ref, stage1, best)
        stage2 = []
        for reqs in (1, 2, 8, 16) if not quick else (1, 8):
            stage2.append(dataclasses.replace(best[1], suffix_reqs=reqs))
        for scfg in [(16, 4, 4), (64, 4, 3)] + ([] if quick else [(32, 8, 3), (32, 4, 4)]):
            stage2.append(dataclasses.replace(best[1], suffix=scfg))
        tma_cfgs = [(16, 4, 3)] if quick else [(16, 4, 3), (16, 4, 4), (16, 8, 3)]
        for scfg in tma_cfgs:  # pages through descriptors
            for reqs in (4, 8) if not quick else (4,):
                stage2.append(dataclasses.replace(best[1], suffix=scfg, suffix_reqs=reqs,
                                                  suffix_tma=True))  # fmt: skip
        best = _sweep(b, ref, stage2, best)
        stage3 = [dataclasses.replace(best[1], concurrent=not best[1].concurrent),
                  dataclasses.replace(best[1], merge_rows=16)]  # fmt: skip
        best = _sweep(b, ref, stage3, best)
        row("attn grouped best (suffix 128)", f"{best[0] * 1e6:.1f} us: {best[1]}")
    # the suffix kernels as plain decode (no prefix): what they could do for other presets
    for ctx in (128, 256):
        b = shared_batch(256, 0, ctx)
        gb = ctx * 256 * 8 * 128 * 2 * 2 / 1e9
        for name, fn in [
            ("plain decode", lambda: decode_attention(b["q"], b["kc"], b["vc"], b["table"],  # noqa: B023
                                                      b["seq_lens"], 128**-0.5, max_seq_len=8448)),  # noqa: B023,E501
            ("grouped suffix kernel", lambda: grouped(b, GroupedTuning(), "suffix")),  # noqa: B023
            ("grouped TMA suffix kernel", lambda: grouped(b, tma, "suffix")),  # noqa: B023
        ]:  # fmt: skip
            t = _time(f"{name} as plain decode, B=256 ctx {ctx}", fn)
            if t is not None:
                row(f"{name} as plain decode, B=256 ctx {ctx}",
                    f"{t * 1e6:.1f} us, {gb / t / 1e3:.2f} TB/s")  # fmt: skip
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
    tma = " tma" if t.suffix_tma else ""
    return (f"bm {t.block_m} prefix {t.prefix} x{t.prefix_splits} | {t.suffix_reqs} req "
            f"{t.suffix}{tma} | {way} merge {t.merge_rows}")  # fmt: skip


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
        cfgs = [None, (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3)]
        for cfg in cfgs if not quick else cfgs[:4]:
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


@section("3. shared-prefix preset: cascade off / previous / grouped / best")
def presets(llm: LLM, ceil, best: GroupedTuning | None, quick: bool) -> None:
    saved = ca.TUNING
    tunings = {"previous default": OLD, "grouped default": ca.DEFAULT_TUNING}
    if best is not None and best != ca.DEFAULT_TUNING.grouped:
        tunings["grouped best of sweep"] = dataclasses.replace(ca.DEFAULT_TUNING, grouped=best)
    try:
        if not quick:
            set_cascade(llm, None)
            run_preset(llm, ceil, "shared-prefix", "cascade off")
        for name, tuning in tunings.items():
            set_cascade(llm, tuning)
            run_preset(llm, ceil, "shared-prefix", name, count_cascade=True)
            if name == "grouped default":  # a second run: the figure's spread; GQA prefill off
                if not quick:
                    run_preset(llm, ceil, "shared-prefix", name + ", again", count_cascade=True)
                gqa.ENABLED = False
                try:
                    run_preset(llm, ceil, "shared-prefix", name + ", GQA prefill off",
                               count_cascade=True)  # fmt: skip
                finally:
                    gqa.ENABLED = True
    finally:
        set_cascade(llm, saved)


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
    rows = latency.run(llm.llm_engine, ceil, [1], 512, 128)
    print(latency.format_rows(rows), flush=True)
    for r in latency.as_dicts(rows):
        row("8B batch-1 decode", json.dumps(r)[:300])


@section("5. kernel-time profile of the shared-prefix preset")
def profile(llm: LLM, ceil) -> None:
    from collections import defaultdict

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
    presets(llm, ceil, best, args.quick)
    regressions(llm, ceil, args.quick)
    if not args.quick:
        profile(llm, ceil)
    print(f"\n=== gpu_shared_prefix summary ({time.perf_counter() - t_start:.0f} s) ===")
    width = max(len(n) for n, _ in ROWS)
    for name, value in ROWS:
        print(f"{name.ljust(width)}  {value}")
    with open(os.path.join(args.out, "shared_prefix.json"), "w") as f:
        json.dump(RESULTS | {"ceilings": vars(ceil)}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
