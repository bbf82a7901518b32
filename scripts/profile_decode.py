"""Where a decode step's time goes on the GPU: kernel time per step (by kernel name) against
the step's wall time, for a model and batch size, through torch.profiler.

    python scripts/profile_decode.py --model qwen3-0.6b --batch 1 [--eager]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from roofline import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--mem", type=float, default=0.5)
    ap.add_argument("--sync", action="store_true", help="async scheduling off")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", device="cuda", max_model_len=2048,
              max_num_seqs=max(args.batch, 8), gpu_memory_utilization=args.mem,
              enforce_eager=args.eager)  # fmt: skip
    engine = llm.llm_engine
    engine.async_scheduling = not args.sync
    params = SamplingParams(temperature=0.0, max_tokens=10_000 // 10, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", [(7 * i + j) % 1000 + 10 for j in range(args.input_len)],
                           params)  # fmt: skip
    for _ in range(30):  # prefill and settle
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name].append(e.device_time)
            spans.append((e.time_range.start, e.time_range.end))
    busy_us = sum(sum(v) for v in per_name.values()) / args.steps
    spans.sort()
    gap_us = sum(max(0, b[0] - a[1]) for a, b in zip(spans, spans[1:])) / args.steps
    mode = ("eager" if args.eager else "graphs") + (", sync" if args.sync else ", async")
    print(
        f"{args.model} batch {args.batch} ({mode}): wall {wall_ms:.3f} ms/step, kernels "
        f"{busy_us / 1e3:.3f} ms/step, idle gaps {gap_us / 1e3:.3f} ms/step, "
        f"{len(spans) / args.steps:.0f} kernels/step"
    )
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:18]
    for name, times in rows:
        n = len(times) / args.steps
        total, mean = sum(times) / args.steps, sum(times) / len(times)
        print(f"  {total:8.1f} us/step  {n:5.0f}x  {mean:7.1f} us  {name[:90]}")


if __name__ == "__main__":
    main()
