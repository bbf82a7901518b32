"""Where a throughput preset's time goes on the GPU: steps split into prefill-bearing and
decode-only (count, wall time, tokens), then one profiled run's kernel time by name and the
device's idle time, so the gap to the preset's roofline can be attributed.

    python scripts/gpu_profile_presets.py [--presets shared-prefix,short] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from roofline import LLM
from roofline.bench import throughput, workloads
from roofline.bench.ceilings import measure


def phase_split(llm: LLM, ceil, wl) -> tuple[object, dict[str, list]]:
    """One run of the preset with each step's wall time attributed to its kind (a step is
    timed from its schedule() call to the next one)."""
    sched = llm.llm_engine.scheduler
    phases: dict[str, list] = collections.defaultdict(list)
    last: list = [None, 0.0]  # kind and start time of the step in flight
    inner = sched.schedule

    def schedule(*a, **k):
        out = inner(*a, **k)
        now = time.perf_counter()
        if last[0] is not None:
            phases[last[0]].append(now - last[1])
        if out.scheduled:
            n = len(out.scheduled)
            kind = "prefill" if out.num_batched_tokens > n else "decode"
            phases[kind + "_tokens"].append(out.num_batched_tokens)
            phases[kind + "_rows"].append(n)
            last[0], last[1] = kind, now
        else:
            last[0] = None
        return out

    sched.schedule = schedule
    try:
        return throughput.run(llm, ceil, wl, use_tqdm=False), phases
    finally:
        del sched.schedule


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--presets", default="shared-prefix,short")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--engine-kwargs", default="{}")
    args = ap.parse_args()
    ceil = measure(torch.device("cuda"), torch.bfloat16)
    kw = dict(max_model_len=8448, max_num_seqs=256, max_num_batched_tokens=8192)
    kw.update(json.loads(args.engine_kwargs))
    llm = LLM(args.model, load_format="dummy", device="cuda", **kw)
    vocab = llm.llm_engine.model_config.vocab_size
    for name in args.presets.split(","):
        wl = workloads.preset(name, vocab)
        llm.llm_engine.kv_manager.reset_prefix_cache()
        res, phases = phase_split(llm, ceil, wl)
        print(
            f"\n== {name}: {res.elapsed_s:.3f} s, roofline {res.roofline_s:.3f} s "
            f"({res.roofline_pct:.1f}%), host {100 * res.host_fraction:.0f}%, max running "
            f"{res.max_running}, preemptions {res.num_preemptions}"
        )
        for kind in ("prefill", "decode"):
            t = phases.get(kind, [])
            if not t:
                continue
            toks, rows = phases[kind + "_tokens"], phases[kind + "_rows"]
            med_ms = 1e3 * sorted(t)[len(t) // 2]
            print(
                f"  {kind} steps {len(t)}: {sum(t):.3f} s total, median {med_ms:.2f} ms, "
                f"tokens/step mean {sum(toks) / len(toks):.0f}, rows/step mean "
                f"{sum(rows) / len(rows):.0f}"
            )
        llm.llm_engine.kv_manager.reset_prefix_cache()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            throughput.run(llm, ceil, wl, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        per_name: dict[str, list[float]] = collections.defaultdict(list)
        spans = []
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per_name[e.name].append(e.device_time)
                spans.append((e.time_range.start, e.time_range.end))
        spans.sort()
        busy = sum(sum(v) for v in per_name.values()) / 1e6
        gaps = sum(max(0, b[0] - a[1]) for a, b in zip(spans, spans[1:])) / 1e6
        print(
            f"  profiled run {wall:.3f} s: kernels {busy:.3f} s, device idle gaps {gaps:.3f} s, "
            f"{len(spans)} kernels"
        )
        for kname, times in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
            print(
                f"    {sum(times) / 1e3:9.1f} ms {len(times):7d}x {sum(times) / len(times):8.1f} us"
                f"  {kname[:100]}"
            )


if __name__ == "__main__":
    main()
