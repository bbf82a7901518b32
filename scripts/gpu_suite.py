"""The GPU session in one process: parity, start-up, latency, throughput and prefill against the
roofline and HF transformers on the same random weights. Prints a short table last.

    python scripts/gpu_suite.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from roofline import LLM
from roofline.bench import latency, peers, throughput, workloads
from roofline.bench.ceilings import measure
from roofline.planner.roofline import step_cost


def load(model: str, **kw) -> tuple[LLM, float]:
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", device="cuda", **kw)
    torch.cuda.synchronize()
    return llm, time.perf_counter() - t0


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def prefill_tflops(llm: LLM, ceilings, num_tokens: int) -> tuple[float, float]:
    from roofline.sampling_params import SamplingParams

    engine = llm.llm_engine
    prompt = list(range(100, 100 + num_tokens))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt[:512]], params, use_tqdm=False)
    times = []
    for i in range(3):
        engine.kv_manager.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([[5 + i] + prompt[1:]], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    cost = step_cost(engine.model_config, ceilings.as_gpu_spec(), num_prefill_tokens=num_tokens)
    t = sorted(times)[1]
    return cost.flops / t / 1e12, t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-requests", type=int, default=32)
    ap.add_argument("--throughput-mem", type=float, default=0.9)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    summary: dict[str, object] = {}
    dev = torch.device("cuda")
    ceil = measure(dev, torch.bfloat16)
    print(
        f"ceilings: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    summary["ceilings"] = vars(ceil)

    # --- Qwen3-0.6B batch 1
    llm, t_load = load(
        "qwen3-0.6b", max_model_len=4096, max_num_seqs=64, kv_cache_memory_bytes=4 << 30
    )
    rows = latency.run(llm.llm_engine, ceil, [1], 128, 256)
    print(f"qwen3-0.6b start-up {t_load:.1f}s\n" + latency.format_rows(rows), flush=True)
    summary["qwen3_0.6b_bs1"] = latency.as_dicts(rows)
    llm.llm_engine.async_scheduling = False
    rows = latency.run(llm.llm_engine, ceil, [1], 128, 256)
    print("qwen3-0.6b, async scheduling off:\n" + latency.format_rows(rows), flush=True)
    summary["qwen3_0.6b_bs1_sync"] = latency.as_dicts(rows)
    del llm
    free()

    # --- Llama-3.1-8B: start-up, latency, prefill, throughput
    llm, t_load = load(
        "llama-3.1-8b",
        max_model_len=8448,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.55,  # room for the HF peer on the same weights
    )
    print(f"llama-3.1-8b start-up (dummy weights, graphs captured): {t_load:.1f} s", flush=True)
    summary["llama8b_startup_s"] = t_load
    rows = latency.run(llm.llm_engine, ceil, [1, 8, 32, 128], 512, 128)
    print(latency.format_rows(rows), flush=True)
    summary["llama8b_latency"] = latency.as_dicts(rows)
    llm.llm_engine.async_scheduling = False
    rows = latency.run(llm.llm_engine, ceil, [1, 128], 512, 128)
    print("async scheduling off:\n" + latency.format_rows(rows), flush=True)
    summary["llama8b_latency_sync"] = latency.as_dicts(rows)
    llm.llm_engine.async_scheduling = True
    tf, t = prefill_tflops(llm, ceil, 8192)
    print(
        f"prefill 8192 tokens: {t * 1e3:.0f} ms, {tf:.0f} TFLOP/s = "
        f"{100 * tf * 1e12 / ceil.matmul_flops_per_s:.0f}% of matmul",
        flush=True,
    )
    summary["llama8b_prefill"] = {"s": t, "tflops": tf}
    wl = workloads.synthetic(256, (100, 1024), (512, 512), llm.llm_engine.model_config.vocab_size)
    hf = peers.hf_model_from_engine(llm.llm_engine)
    del llm
    free()
    sub = workloads.Workload(
        wl.prompts[: args.hf_requests],
        wl.output_lens[: args.hf_requests],
        f"first {args.hf_requests} requests",
    )
    try:
        pr = peers.hf_generate_batch(hf, sub)
        print(f"HF generate_batch on {sub.name}: {pr.output_tok_s:.0f} out tok/s", flush=True)
        summary["hf_generate_batch"] = {"requests": args.hf_requests, "tok_s": pr.output_tok_s}
    except Exception as e:  # noqa: BLE001 - the peer's failure is reported, not fatal
        print(f"HF generate_batch failed: {type(e).__name__}: {e}", flush=True)
    try:
        ids = torch.arange(100, 100 + 8192, device=dev)[None]
        with torch.inference_mode():
            hf(ids)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf(ids)
            torch.cuda.synchronize()
        t_hf = time.perf_counter() - t0
        print(f"HF prefill 8192 tokens (sdpa): {t_hf * 1e3:.0f} ms", flush=True)
        summary["hf_prefill_s"] = t_hf
        r = hf_decode = peers.hf_decode_tok_s(hf, list(range(100, 612)), 64)
        print(f"HF generate batch-1 decode: {r:.1f} tok/s", flush=True)
        summary["hf_decode_bs1"] = hf_decode
    except Exception as e:  # noqa: BLE001
        print(f"HF prefill/decode failed: {type(e).__name__}: {e}", flush=True)
    del hf
    free()

    # --- offline throughput with the memory the engine would normally get
    llm, _ = load(
        "llama-3.1-8b",
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=args.throughput_mem,
    )
    res = throughput.run(llm, ceil, wl, use_tqdm=False)
    print(
        f"throughput (gpu_memory_utilization {args.throughput_mem}): {res.output_tok_s:.0f} "
        f"out tok/s, {res.elapsed_s:.1f} s, {res.roofline_pct:.1f}% of workload roofline, "
        f"at most {res.max_running} running, {res.num_preemptions} preemptions, host work "
        f"{100 * res.host_fraction:.0f}% of step time, {len(res.jit_compiles)} JIT compiles "
        f"{sorted(set(res.jit_compiles))}",
        flush=True,
    )
    summary["llama8b_throughput"] = vars(res)
    with open(os.path.join(args.out, "gpu_suite.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)


if __name__ == "__main__":
    main()
