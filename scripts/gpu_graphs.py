"""Mixed-step CUDA graphs on the GPU: parity, share of steps replayed, throughput against the
roofline, batch-1 decode. Each section prints its error and goes on; a table comes last.

    python scripts/gpu_graphs.py --quick     # ~100 s: parity, preset short (2 variants), batch 1
    python scripts/gpu_graphs.py             # ~4 min: + split-eager, 2 rounds, preset default

Variants on one Llama-3.1-8B engine (dummy bf16 weights, captured once with
``cuda_graph_mode="full"``): ``full`` (decode graphs + mixed graphs per token bucket, split
attention), ``split-eager`` (mixed graphs switched off: mixed steps eager with split attention)
and ``decode-only`` (the runner's mixed path off: today's ``full_decode_only``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from roofline import LLM, SamplingParams  # noqa: E402
from roofline.bench import latency, throughput, workloads  # noqa: E402
from roofline.bench.ceilings import measure  # noqa: E402

TABLE: list[tuple[str, str]] = []


def row(name: str, value: str) -> None:
    TABLE.append((name, value))
    print(f"  {name}: {value}", flush=True)


def section(title: str):
    def wrap(fn):
        def run(*a, **k):
            print(f"\n=== {title}", flush=True)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            except Exception as e:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                row(title, f"FAILED {type(e).__name__}: {e}")
            finally:
                print(f"--- {title}: {time.perf_counter() - t0:.1f} s", flush=True)

        return run

    return wrap


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run_with_arrivals(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """One new request per step (the rest arrive while earlier ones decode): mixed steps."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    done: dict[str, list[int]] = {}
    i = 0
    while i < len(prompts) or engine.has_unfinished_requests():
        if i < len(prompts):
            engine.add_request(f"r{i}", prompts[i], params)
            i += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"r{j}"] for j in range(len(prompts))]


class StepCounter:
    """Counts a runner's steps and the graph replays among them (wraps instance methods)."""

    def __init__(self, runner) -> None:
        self.steps = self.decode = self.mixed = 0
        launch = runner.launch_batch

        def counted_launch(*a, **k):
            self.steps += 1
            return launch(*a, **k)

        runner.launch_batch = counted_launch
        if runner.graphs is not None:
            replay = runner.graphs.replay

            def counted_decode(*a, **k):
                self.decode += 1
                return replay(*a, **k)

            runner.graphs.replay = counted_decode
        mixed = getattr(runner, "mixed", None)
        if mixed is not None and mixed.graphs is not None:
            mreplay = mixed.graphs.replay

            def counted_mixed(*a, **k):
                self.mixed += 1
                return mreplay(*a, **k)

            mixed.graphs.replay = counted_mixed

    def reset(self) -> None:
        self.steps = self.decode = self.mixed = 0

    def summary(self) -> str:
        s = max(self.steps, 1)
        return (
            f"{self.steps} steps: {100 * self.decode / s:.0f}% decode graphs, "
            f"{100 * self.mixed / s:.0f}% mixed graphs, "
            f"{100 * (self.steps - self.decode - self.mixed) / s:.0f}% eager"
        )


@section("parity: tiny fp32 models, eager vs decode graphs vs mixed graphs")
def parity_tiny(archs: tuple[str, ...]) -> None:
    from tests.e2e.hf_reference import tiny_hf_model

    for arch in archs:
        path = tempfile.mkdtemp(prefix=f"tiny_{arch}_")
        tiny_hf_model(arch, path)
        prompts = [[3 + (7 * i + j) % 300 for j in range(n)] for i, n in enumerate(
            [5, 40, 1, 130, 17, 300, 64, 9, 220, 33, 2, 90]
        )]  # fmt: skip
        got = {}
        for mode in ("none", "full_decode_only", "full"):
            llm = LLM(
                path, dtype="float32", device="cuda", cuda_graph_mode=mode,
                max_num_batched_tokens=192, max_num_seqs=16, max_model_len=512,
                kv_cache_memory_bytes=64 << 20,
            )  # fmt: skip
            counter = StepCounter(llm.llm_engine.runner)
            got[mode] = run_with_arrivals(llm, prompts, 48)
            print(f"  {arch} {mode}: {counter.summary()}", flush=True)
            del llm
            free()
        same = [got["full"] == got[m] for m in ("none", "full_decode_only")]
        row(f"parity {arch} fp32 (full == none, full == decode-only)", str(same))


def load_8b(**kw) -> tuple[LLM, float]:
    t0 = time.perf_counter()
    llm = LLM(
        "llama-3.1-8b", load_format="dummy", device="cuda", max_model_len=8448,
        max_num_seqs=256, max_num_batched_tokens=8192, **kw,
    )  # fmt: skip
    torch.cuda.synchronize()
    return llm, time.perf_counter() - t0


def set_variant(runner, variant: str, saved: dict) -> None:
    """full / split-eager / decode-only on one engine (see the module docstring)."""
    saved.setdefault("mixed", runner.mixed)
    mixed = saved["mixed"]
    runner.mixed = None if variant == "decode-only" else mixed
    if mixed is not None and mixed.graphs is not None:
        mixed.graphs.ready = variant == "full"


@section("bf16 8B: mixed graphs vs decode-only tokens under arrivals")
def parity_bf16(llm: LLM) -> None:
    runner, saved = llm.llm_engine.runner, {}
    prompts = workloads.synthetic(32, (20, 300), (48, 48), 128000, seed=3).prompts
    out = {}
    for variant in ("full", "decode-only"):
        set_variant(runner, variant, saved)
        out[variant] = run_with_arrivals(llm, prompts, 48)
    set_variant(runner, "full", saved)
    same = sum(a == b for a, b in zip(out["full"], out["decode-only"]))
    first = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for a, b in zip(out["full"], out["decode-only"])
    ]
    row("bf16 8B identical sequences (of 32; random weights: near-ties)", f"{same}")
    row("bf16 8B mean first differing position (of 48)", f"{sum(first) / len(first):.1f}")


def warm_variants(llm: LLM, wl, variants: list[str]) -> None:
    """Each variant once, untimed, on the workload's first requests with short outputs (the
    runs then compile nothing and the first timed variant pays nothing the others do not)."""
    runner, saved = llm.llm_engine.runner, {}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for variant in variants:
        set_variant(runner, variant, saved)
        llm.generate(wl.prompts[:300], params, use_tqdm=False)
    set_variant(runner, "full", saved)


@section("throughput")
def bench_throughput(
    llm: LLM, ceil, name: str, wl, variants: list[str], reps: int, out: dict
) -> None:
    """The variants timed in turn (``reps`` rounds), the prefix cache emptied before each."""
    runner, saved = llm.llm_engine.runner, {}
    counter = StepCounter(runner)
    warm_variants(llm, wl, variants)
    for rep in range(reps):
        for variant in variants:
            set_variant(runner, variant, saved)
            llm.llm_engine.kv_manager.reset_prefix_cache()
            counter.reset()
            res = throughput.run(llm, ceil, wl, use_tqdm=False)
            row(
                f"{name} [{variant}] #{rep + 1}",
                f"{res.output_tok_s:.0f} out tok/s, {res.elapsed_s:.1f} s, "
                f"{res.roofline_pct:.1f}% of roofline ({res.roofline_s:.1f} s), host "
                f"{100 * res.host_fraction:.0f}%, {counter.summary()}, max running "
                f"{res.max_running}, {len(res.jit_compiles)} JIT compiles "
                f"{sorted(set(res.jit_compiles))}",
            )
            out[f"{name}/{variant}/{rep}"] = vars(res) | {"steps": counter.summary()}
    set_variant(runner, "full", saved)


@section("batch-1 decode, Llama-3.1-8B")
def bench_bs1(llm: LLM, ceil, output_len: int, out: dict) -> None:
    rows = latency.run(llm.llm_engine, ceil, [1], 512, output_len)
    print(latency.format_rows(rows), flush=True)
    r = rows[0]
    row("8B batch-1 decode", f"{r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}% of roofline")
    out["bs1"] = latency.as_dicts(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="~90 s: fewer requests, no offline")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t_start = time.perf_counter()
    summary: dict = {}
    dev = torch.device("cuda")
    ceil = measure(dev, torch.bfloat16)
    row(
        "ceilings",
        f"copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s",
    )
    parity_tiny(("llama",) if args.quick else ("llama", "qwen3"))

    llm = None
    try:
        llm, t_load = load_8b()
        mixed = llm.llm_engine.runner.mixed
        buckets = mixed.graphs.buckets if mixed is not None and mixed.graphs else []
        row("8B start-up (dummy weights, decode + mixed graphs)", f"{t_load:.1f} s")
        row("mixed buckets", f"{buckets}, captured in {getattr(mixed, 'capture_s', 0):.2f} s")
        row("8B KV pages", f"{llm.llm_engine.runner.num_pages}")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row("8B load", f"FAILED {type(e).__name__}: {e}")
    if llm is not None:
        vocab = llm.llm_engine.model_config.vocab_size
        bench_bs1(llm, ceil, 64 if args.quick else 128, summary)
        short = workloads.preset("short", vocab)
        variants = ["full", "decode-only"] if args.quick else ["full", "split-eager", "decode-only"]
        bench_throughput(llm, ceil, "short", short, variants, 1 if args.quick else 2, summary)
        if not args.quick:
            default = workloads.preset("default", vocab)
            bench_throughput(llm, ceil, "default", default, ["full", "decode-only"], 1, summary)
            parity_bf16(llm)
    print(f"\n=== table (whole run {time.perf_counter() - t_start:.0f} s)")
    for name, value in TABLE:
        print(f"{name:<62} {value}")
    with open(os.path.join(args.out, "gpu_graphs.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)


if __name__ == "__main__":
    main()
