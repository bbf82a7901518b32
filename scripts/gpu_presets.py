"""The workload presets of `roofline bench throughput` in one process on the GPU: each preset's
time, output tok/s, % of its roofline, host share of the step, most running, preemptions.
Llama-3.1-8B config, random bf16 weights; a short table last.

    python scripts/gpu_presets.py [--presets default,short,shared-prefix,long-prompt]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from roofline import LLM
from roofline.bench import throughput, workloads
from roofline.bench.ceilings import measure


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--presets", default=",".join(workloads.PRESETS))
    ap.add_argument("--engine-kwargs", default="{}", help="JSON of extra LLM(...) arguments")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceil = measure(dev, torch.bfloat16)
    print(
        f"ceilings: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    t0 = time.perf_counter()
    kw = dict(max_model_len=8448, max_num_seqs=256, max_num_batched_tokens=8192)
    kw.update(json.loads(args.engine_kwargs))
    llm = LLM(args.model, load_format="dummy", device="cuda", **kw)
    print(f"start-up {time.perf_counter() - t0:.1f} s ({kw})", flush=True)
    vocab = llm.llm_engine.model_config.vocab_size
    rows = []
    for name in args.presets.split(","):
        try:
            wl = workloads.preset(name, vocab)
            llm.llm_engine.kv_manager.reset_prefix_cache()
            res = throughput.run(llm, ceil, wl, use_tqdm=False)
            rows.append((name, res))
            print(
                f"{name}: {res.elapsed_s:.2f} s, {res.output_tok_s:.0f} out tok/s, "
                f"{res.roofline_pct:.1f}% of roofline ({res.roofline_s:.2f} s), host "
                f"{100 * res.host_fraction:.0f}%, max running {res.max_running}, "
                f"{res.num_preemptions} preemptions, {len(res.jit_compiles)} JIT compiles",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - report and go on to the next preset
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
    print("\n| preset | s | out tok/s | % roofline | host % |\n|---|---:|---:|---:|---:|")
    for name, r in rows:
        print(
            f"| {name} | {r.elapsed_s:.2f} | {r.output_tok_s:.0f} | {r.roofline_pct:.1f} | "
            f"{100 * r.host_fraction:.0f} |"
        )
    with open(os.path.join(args.out, "presets.json"), "w") as f:
        json.dump({n: vars(r) for n, r in rows} | {"ceilings": vars(ceil)}, f, indent=1)


if __name__ == "__main__":
    main()
