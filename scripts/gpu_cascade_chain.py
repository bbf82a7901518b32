"""The grouped cascade's two passes side by side, in the engine (issue 13's shared-prefix preset:
256 x (2,000 shared + 64), 128 out; Llama-3.1-8B config, random bf16 weights), on the GPU.

1. ``ab``: the preset with each launch choice in alternation (``--rounds`` runs each after one
   warm run, one process): the medians of the run time and of the decode step;
2. ``timeline``: per choice, greedy tokens against the first choice's, the preset twice, and a
   kernel timeline of six decode steps (torch.profiler's chrome trace): per layer, the window
   from the end of the kernel before the cascade (RoPE + K/V store) to the next kernel after
   both passes, each pass's duration and start.

The choices: two streams (the side stream's prefix pass at high priority; the previous
default), ``chained`` (one stream, PDL) with 5- and 4-stage suffix tiles, and the passes in
turn. Kernel sweeps outside the engine (``scripts/gpu_shared_prefix.py``) do not predict the
engine's step here (docs/architecture.md, Cascade).

    python scripts/gpu_cascade_chain.py [--sections ab,timeline] [--rounds 4] [--more]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import print_rows, profiled_steps  # noqa: E402
from gpu_presets import (  # noqa: E402
    RESULTS,
    ROWS,
    queued_preset,
    row,
    run_preset,
    set_cascade,
)

from roofline import LLM, SamplingParams  # noqa: E402
from roofline.bench import workloads  # noqa: E402
from roofline.bench.ceilings import measure  # noqa: E402
from roofline.kernels import cascade_attention as ca  # noqa: E402

DEV = torch.device("cuda")


def choices(more: bool = False) -> dict:
    g, r = ca.TUNING.grouped, dataclasses.replace
    if more:  # the prefix pass in shorter programs (two slices of the prefix per unit)
        return {
            "chained, suffix (32, 4, 4)": r(g, chained=True, suffix=(32, 4, 4)),
            "chained, prefix (64, 4, 3) x2": r(g, prefix=(64, 4, 3), prefix_splits=2),
            "chained, prefix (64, 4, 5) x2": r(g, prefix_splits=2),
            "chained, 128-row units (64, 8, 3) x2": r(g, block_m=128, prefix=(64, 8, 3),
                                                      prefix_splits=2),
        }  # fmt: skip
    return {
        "two streams, suffix (32, 4, 5)": r(g, chained=False, suffix=(32, 4, 5)),
        "chained, suffix (32, 4, 5)": r(g, chained=True, suffix=(32, 4, 5)),
        "chained, suffix (32, 4, 4)": r(g, chained=True, suffix=(32, 4, 4)),
        "in turn": r(g, concurrent=False),
    }


def ab(llm: LLM, ceil, rounds: int, more: bool = False) -> None:
    saved = ca.TUNING
    tunings = {k: v for k, v in choices(more).items() if k != "in turn"}
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in tunings}
    try:
        for i in range(rounds + 1):
            for name, t in tunings.items():
                set_cascade(llm, dataclasses.replace(saved, grouped=t))
                tag = f"{name} ab {i}"
                res = run_preset(llm, ceil, "shared-prefix", tag, count_cascade=True)
                n, secs = RESULTS[f"preset shared-prefix ({tag})"]["phases"].get("decode", (0, 0))
                if i:  # the first round warms each choice's graphs
                    got[name].append((res.elapsed_s, 1e3 * secs / max(n, 1)))
    finally:
        set_cascade(llm, saved)
    med = statistics.median
    for name, runs in got.items():
        row(f"A/B {name}", f"median {med(x for x, _ in runs):.3f} s over {len(runs)} runs "
            f"({', '.join(f'{x:.3f}' for x, _ in runs)}); decode step median "
            f"{med(d for _, d in runs):.2f} ms")  # fmt: skip


def timeline(llm: LLM, label: str, steps: int = 6) -> None:
    engine = llm.llm_engine
    with queued_preset(engine, "shared-prefix", f"tl-{label}"):
        prof = profiled_steps(engine, 20, steps)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as src:
            trace = json.load(src)
    ks = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"),
                key=lambda e: e["ts"])  # fmt: skip
    win, pre, suf, pre_off, suf_off = [], [], [], [], []
    for i, e in enumerate(ks):
        if "grouped_suffix" not in e["name"]:
            continue
        p = next((k for k in ks[max(0, i - 4) : i + 4] if "grouped_prefix" in k["name"]), None)
        if p is None:
            continue
        first = min(e["ts"], p["ts"])
        end = max(e["ts"] + e["dur"], p["ts"] + p["dur"])
        prev = next((k for k in reversed(ks[:i]) if "grouped" not in k["name"]
                     and k["ts"] < first), None)  # fmt: skip
        nxt = next((k for k in ks[i + 1 :] if "grouped" not in k["name"]
                    and k["ts"] >= end - 1), None)  # fmt: skip
        if prev is None or nxt is None:
            continue
        t0 = prev["ts"] + prev["dur"]
        win.append(nxt["ts"] - t0)
        pre.append(p["dur"])
        suf.append(e["dur"])
        pre_off.append(p["ts"] - t0)
        suf_off.append(e["ts"] - t0)
    med = statistics.median
    if win:
        row(f"timeline {label}",
            f"{len(win)} layers: window {med(win):.1f} us (RoPE/store end -> next kernel); "
            f"prefix {med(pre):.1f} us from +{med(pre_off):.1f}, suffix {med(suf):.1f} us from "
            f"+{med(suf_off):.1f}")  # fmt: skip


def timelines(llm: LLM, ceil, more: bool = False) -> None:
    saved = ca.TUNING
    wl = workloads.preset("shared-prefix", llm.llm_engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in wl.output_lens]  # fmt: skip
    first = None
    try:
        for name, t in choices(more).items():
            set_cascade(llm, dataclasses.replace(saved, grouped=t))
            llm.llm_engine.kv_manager.reset_prefix_cache()
            tokens = [o.outputs[0].token_ids for o in llm.generate(wl.prompts, params,
                                                                    use_tqdm=False)]  # fmt: skip
            first = first or tokens
            same = sum(a == b for a, b in zip(first, tokens))
            row(f"greedy {name}", f"{same}/{len(tokens)} identical to the first choice's")
            for i in (1, 2):
                run_preset(llm, ceil, "shared-prefix", f"{name} {i}", count_cascade=True)
            timeline(llm, name)
    finally:
        set_cascade(llm, saved)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="ab,timeline")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--more", action="store_true", help="prefix slices and 128-row units")
    args = ap.parse_args()
    t0 = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", max_model_len=8448,
              max_num_seqs=256, max_num_batched_tokens=8192)  # fmt: skip
    llm.generate([[7] * 600, [9] * 40], SamplingParams(max_tokens=4), use_tqdm=False)
    if "ab" in args.sections:
        ab(llm, ceil, args.rounds, args.more)
    if "timeline" in args.sections:
        timelines(llm, ceil, args.more)
    print_rows("gpu_cascade_chain", ROWS, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
