"""CPU benchmark in one process: roofline (the GGUF's Q4_1/Q8_0 blocks kept, the CPU kernels)
vs HF transformers (the same weights dequantized, fp32) vs llama.cpp (same GGUF, as many
threads as torch uses) on SmolLM2-135M-Instruct: batch-1 decode and offline throughput of 32
chat prompts x 128 new tokens, beside the copy bandwidth measured in the run. Batch-1 decode
alternates between roofline and llama.cpp ``--repeat`` times, roofline's offline run repeats
``--throughput-repeat`` times (medians reported, with the process CPU time per output token).
Prints the load average (the dev machine is shared) and a table last.

    python scripts/cpu_bench.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from roofline import LLM, SamplingParams
from roofline.bench import peers, throughput, workloads
from roofline.bench.ceilings import measure
from roofline.engine.heap import frozen_heap
from roofline.models.weights import gguf_path


def decode_tok_s(llm: LLM, prompt: list[int], n: int) -> float:
    engine = llm.llm_engine
    engine.add_request("bs1", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    stamps = []
    with frozen_heap():  # as LLM.generate steps
        while engine.has_unfinished_requests():
            if engine.step():
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="batch-1 runs (medians reported)")
    ap.add_argument(
        "--throughput-repeat", type=int, default=3, help="roofline offline runs (median reported)"
    )
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    ceil = measure(torch.device("cpu"), torch.float32)
    print(
        f"CPU: copy {ceil.bandwidth_bytes_per_s / 1e9:.1f} GB/s, fp32 matmul "
        f"{ceil.matmul_flops_per_s / 1e9:.0f} GFLOP/s",
        flush=True,
    )
    rows: dict[str, float] = {}
    threads = torch.get_num_threads()
    # HF transformers on the very weights roofline's fp32 reference path holds (the GGUF
    # dequantized), with torch's own threads
    ref = LLM("smollm2", dtype="float32", device="cpu", gguf_keep_quantized=False)
    wl = workloads.chat(ref.get_tokenizer(), args.num_prompts, args.output_len)
    if not args.skip_hf:
        hf = peers.hf_model_from_engine(ref.llm_engine)
        del ref
        rows["hf bs1 decode"] = peers.hf_decode_tok_s(hf, wl.prompts[0], args.output_len)
        print(f"HF batch-1 decode: {rows['hf bs1 decode']:.1f} tok/s", flush=True)
        for bs in (16, 32):
            pr = peers.hf_generate(hf, wl, bs)
            rows[f"hf generate batch {bs}"] = pr.output_tok_s
            print(f"{pr.name}: {pr.output_tok_s:.1f} out tok/s (load {os.getloadavg()[0]:.2f})",
                  flush=True)  # fmt: skip
        del hf
    else:
        del ref
    path = str(gguf_path())
    # roofline: the Q4_1 / Q8_0 blocks as stored (the CPU default); its kernels take the cores.
    # Batch-1 decode alternates with llama.cpp's, --repeat times; medians are reported.
    llm = LLM("smollm2", dtype="float32", device="cpu")
    ours, theirs = [], []
    for i in range(args.repeat):
        ours.append(decode_tok_s(llm, wl.prompts[0], args.output_len))
        line = f"run {i}: roofline batch-1 decode {ours[-1]:.1f} tok/s"
        if not args.skip_llamacpp:
            theirs.append(
                peers.llamacpp_decode_tok_s(path, wl.prompts[0], args.output_len, threads=threads)
            )
            line += f", llama.cpp {theirs[-1]:.1f} tok/s ({ours[-1] / theirs[-1]:.2f}x)"
        print(line, flush=True)
    rows["roofline bs1 decode"] = statistics.median(ours)
    if theirs:
        rows["llama.cpp bs1 decode"] = statistics.median(theirs)
        pr = peers.llamacpp(path, wl, threads=threads)
        rows["llama.cpp sequential"] = pr.output_tok_s
        print(f"{pr.name}: {pr.output_tok_s:.1f} out tok/s (load {os.getloadavg()[0]:.2f})",
              flush=True)  # fmt: skip
    runs, cpu_ms = [], []
    for i in range(args.throughput_repeat):
        cpu0 = time.process_time()
        res = throughput.run(llm, ceil, wl, use_tqdm=False)
        # process CPU time (both threads, spinning included) per output token: less sensitive
        # to other jobs on a shared machine than the wall-clock rate
        cpu_ms.append((time.process_time() - cpu0) / res.output_tokens * 1e3)
        runs.append(res.output_tok_s)
        print(
            f"run {i}: roofline throughput {res.output_tok_s:.1f} out tok/s ({res.elapsed_s:.1f} s,"
            f" {cpu_ms[-1]:.2f} CPU ms/token, load average {os.getloadavg()[0]:.2f})",
            flush=True,
        )
    rows["roofline throughput"] = statistics.median(runs)
    rows["roofline throughput CPU ms/token"] = statistics.median(cpu_ms)
    print(f"roofline throughput, median of {len(runs)}: {rows['roofline throughput']:.1f} tok/s")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print("\n| figure | tok/s |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |" if "CPU ms" in k else f"| {k} | {v:.1f} |")
    ours_bs1, ours_tp = rows["roofline bs1 decode"], rows["roofline throughput"]
    if "hf bs1 decode" in rows:
        hf_best = max(rows["hf generate batch 16"], rows["hf generate batch 32"])
        print(f"\nvs HF: batch-1 {ours_bs1 / rows['hf bs1 decode']:.2f}x (target 3x), "
              f"offline {ours_tp / hf_best:.2f}x of HF's best batched (target 3x)")  # fmt: skip
    if "llama.cpp bs1 decode" in rows:
        print(f"vs llama.cpp: batch-1 {ours_bs1 / rows['llama.cpp bs1 decode']:.2f}x (target 1x), "
              f"offline {ours_tp / rows['llama.cpp sequential']:.2f}x (target 3x)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": vars(ceil), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
