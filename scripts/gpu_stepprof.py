"""Where one engine step's device time goes, kernel by kernel, for a weight method: the 256-row
decode step (256 requests, 512-token prompts) and one 8,192-token prefill, each profiled under
the engine's own CUDA graphs / eager path. Run once per method (each engine in its own process)
and compare the printed tables: what a quantized step spends that the bf16 step does not.

    python scripts/gpu_stepprof.py --method bf16
    python scripts/gpu_stepprof.py --method int8 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from roofline import LLM, SamplingParams


def kernel_table(prof, steps: int) -> dict[str, tuple[float, float]]:
    """name -> (us per step, calls per step)."""
    per: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name].append(e.device_time)
    return {k: (sum(v) / steps, len(v) / steps) for k, v in per.items()}


def show(title: str, table: dict, wall_ms: float, top: int) -> None:
    busy = sum(us for us, _ in table.values()) / 1e3
    print(f"\n== {title}: wall {wall_ms:.3f} ms/step, kernels {busy:.3f} ms/step")
    for name, (us, calls) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us:9.1f} us {calls:6.1f}x  {name[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="bf16")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    llm = LLM(
        args.model, load_format="dummy", device="cuda", max_model_len=8448, max_num_seqs=256,
        max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
        quantization=None if args.method == "bf16" else args.method,
    )  # fmt: skip
    eng = llm.llm_engine
    vocab = eng.model_config.vocab_size
    rng = random.Random(0)
    # warm: every graph bucket the runs below touch
    llm.generate([[7] * 600, [9] * 40], SamplingParams(max_tokens=4), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 40, ignore_eos=True)
    for i in range(args.rows):
        eng.add_request(f"d{i}", [rng.randrange(10, vocab - 10) for _ in range(512)], params)
    started: set[str] = set()
    while len(started) < args.rows:
        started.update(o.request_id for o in eng.step())
    for _ in range(8):  # steady decode (async scheduling settled)
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    dec = kernel_table(prof, args.steps)
    show(f"{args.method} decode, {args.rows} rows", dec, wall, args.top)
    for i in range(args.rows):
        eng.abort_request(f"d{i}")
    while eng.has_unfinished_requests():
        eng.step()
    out: dict = {"method": args.method, "decode_wall_ms": wall, "decode": dec}
    if args.prefill:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        walls = []
        for rep in range(4):
            eng.kv_manager.reset_prefix_cache()
            toks = [rng.randrange(10, vocab - 10) for _ in range(args.prefill)]
            eng.add_request(f"p{rep}", toks, one)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if rep == 3:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    while eng.has_unfinished_requests():
                        eng.step()
                    torch.cuda.synchronize()
            else:
                while eng.has_unfinished_requests():
                    eng.step()
                torch.cuda.synchronize()
            walls.append(1e3 * (time.perf_counter() - t0))
        pre = kernel_table(prof, 1)
        show(f"{args.method} prefill {args.prefill} (walls {walls})", pre, walls[-1], args.top)
        out.update(prefill_walls_ms=walls, prefill=pre)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
