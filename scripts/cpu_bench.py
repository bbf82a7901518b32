"""Issue-2 CPU benchmark in one process: roofline vs HF transformers (same weights, fp32) vs
llama.cpp (same GGUF, 2 threads) on SmolLM2-135M-Instruct: batch-1 decode and offline
throughput of 32 chat prompts x 128 new tokens. Prints a table last.

    python scripts/cpu_bench.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from roofline import LLM, SamplingParams
from roofline.bench import peers, throughput, workloads
from roofline.bench.ceilings import measure
from roofline.models.weights import gguf_path


def decode_tok_s(llm: LLM, prompt: list[int], n: int) -> float:
    engine = llm.llm_engine
    engine.add_request("bs1", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    llm = LLM("smollm2", dtype="float32", device="cpu")
    ceil = measure(torch.device("cpu"), torch.float32)
    print(
        f"CPU: copy {ceil.bandwidth_bytes_per_s / 1e9:.1f} GB/s, fp32 matmul "
        f"{ceil.matmul_flops_per_s / 1e9:.0f} GFLOP/s",
        flush=True,
    )
    wl = workloads.chat(llm.get_tokenizer(), args.num_prompts, args.output_len)
    rows: dict[str, float] = {}
    rows["roofline bs1 decode"] = decode_tok_s(llm, wl.prompts[0], args.output_len)
    print(f"roofline batch-1 decode: {rows['roofline bs1 decode']:.1f} tok/s", flush=True)
    res = throughput.run(llm, ceil, wl, use_tqdm=False)
    rows["roofline throughput"] = res.output_tok_s
    print(
        f"roofline throughput: {res.output_tok_s:.1f} out tok/s ({res.elapsed_s:.1f} s, "
        f"{res.roofline_pct:.1f}% of the workload roofline)",
        flush=True,
    )
    hf = peers.hf_model_from_engine(llm.llm_engine)
    del llm
    rows["hf bs1 decode"] = peers.hf_decode_tok_s(hf, wl.prompts[0], args.output_len)
    print(f"HF batch-1 decode: {rows['hf bs1 decode']:.1f} tok/s", flush=True)
    for bs in (16, 32):
        pr = peers.hf_generate(hf, wl, bs)
        rows[f"hf generate batch {bs}"] = pr.output_tok_s
        print(f"{pr.name}: {pr.output_tok_s:.1f} out tok/s", flush=True)
    del hf
    path = str(gguf_path())
    rows["llama.cpp bs1 decode"] = peers.llamacpp_decode_tok_s(path, wl.prompts[0], args.output_len)
    print(f"llama.cpp batch-1 decode: {rows['llama.cpp bs1 decode']:.1f} tok/s", flush=True)
    pr = peers.llamacpp(path, wl)
    rows["llama.cpp sequential"] = pr.output_tok_s
    print(f"{pr.name}: {pr.output_tok_s:.1f} out tok/s", flush=True)
    hf_best = max(rows["hf generate batch 16"], rows["hf generate batch 32"])
    print("\n| figure | tok/s |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")
    print(
        f"\nthroughput vs HF best batched: {rows['roofline throughput'] / hf_best:.2f}x; "
        f"vs llama.cpp: {rows['roofline throughput'] / rows['llama.cpp sequential']:.2f}x"
    )
    print(
        f"batch-1 vs HF: {rows['roofline bs1 decode'] / rows['hf bs1 decode']:.2f}x; "
        f"vs llama.cpp: {rows['roofline bs1 decode'] / rows['llama.cpp bs1 decode']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"ceilings": vars(ceil), "rows": rows, "roofline_pct": res.roofline_pct},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
