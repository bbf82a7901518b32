"""The workload presets of `roofline bench throughput` with each weight method (Llama-3.1-8B
config, random bf16 weights quantized on the fly): one engine per method, each preset run
twice and the second (warm) run reported, beside bf16 in the same call. Run once per method,
each in its own process (a finished engine's memory is not given back in-process):

    python scripts/gpu_quant_presets.py --method bf16 --json bf16.json
    python scripts/gpu_quant_presets.py --method int8 --json int8.json
    python scripts/gpu_quant_presets.py --method int4 --dtype float16   # a GPTQ / AWQ fp16 run
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from roofline import LLM, SamplingParams
from roofline.bench import throughput, workloads
from roofline.bench.ceilings import measure


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="bf16")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--presets", default="short,long-prompt,shared-prefix")
    ap.add_argument("--json", default="")
    ap.add_argument("--dtype", default="auto", help="the model's dtype (float16: fp16 x)")
    args = ap.parse_args()
    ceil = measure(torch.device("cuda"), torch.bfloat16)
    t0 = time.perf_counter()
    llm = LLM(
        args.model, load_format="dummy", device="cuda", max_model_len=8448, max_num_seqs=256,
        max_num_batched_tokens=8192, quantization=None if args.method == "bf16" else args.method,
        dtype=args.dtype,
    )  # fmt: skip
    print(f"{args.method:5} start-up {time.perf_counter() - t0:.1f} s", flush=True)
    llm.generate([[7] * 600, [9] * 40], SamplingParams(max_tokens=4), use_tqdm=False)
    vocab = llm.llm_engine.model_config.vocab_size
    got = {}
    for name in args.presets.split(","):
        wl = workloads.preset(name, vocab)
        runs = []
        for _ in range(2):
            llm.llm_engine.kv_manager.reset_prefix_cache()
            runs.append(throughput.run(llm, ceil, wl, use_tqdm=False))
        res = runs[-1]
        got[name] = {"s": res.elapsed_s, "out_tok_s": res.output_tok_s, "pct": res.roofline_pct}
        compiles = sorted(set(runs[0].jit_compiles + res.jit_compiles))
        print(
            f"{args.method:5} {name:13} {res.elapsed_s:7.3f} s (first {runs[0].elapsed_s:.3f}), "
            f"{res.output_tok_s:8.0f} out tok/s, {res.roofline_pct:5.1f}% of its roofline, JIT "
            f"compiles in the runs: {len(runs[0].jit_compiles)} + {len(res.jit_compiles)} "
            f"{compiles}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"method": args.method, "presets": got}, f)


if __name__ == "__main__":
    main()
