"""The MoE GPU session in one process (random bf16 weights from roofline/model_configs), each
section in try/except so one failure does not hide the others; a short table last.

1. Kernel parity: ``fused_moe`` (decode GEMV and grouped GEMM paths) and ``route`` against the
   torch reference at Qwen3-30B-A3B and Mixtral-8x7B layer shapes.
2. The fused MoE layer alone at 1, 16, 256, 4096 tokens (routing included): GB/s over the
   weights of the experts actually touched vs the measured copy bandwidth, TFLOP/s vs the
   measured bf16 matmul; the GEMV-vs-grouped crossover at 1-8 tokens.
3. Qwen3-30B-A3B, all 48 layers (~61 GB bf16): decode steps at batch 1/8/32/128, % of the
   planner's roofline (batch 1: the active parameters; larger: the experts the batch touches),
   then offline throughput on a short version of the 256-request workload.
4. Qwen3-30B-A3B with 12 layers, roofline vs HF transformers ``generate`` on the same weights
   (both would not fit at 48 layers): batch-1 tok/s and the ratio; greedy tokens compared.
5. Mixtral-8x7B with 4 of its 32 layers (the whole model needs ~93 GB): batch-1/32 decode.

    python scripts/gpu_moe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from roofline import LLM
from roofline.bench import latency, peers, throughput, workloads
from roofline.bench.ceilings import Ceilings, measure, time_fn
from roofline.kernels.fused_moe import fused_moe, fused_moe_ref, route, route_ref
from roofline.models.weights import MODEL_CONFIGS_DIR

SUMMARY: dict[str, object] = {}
TABLE: list[tuple[str, str]] = []


def section(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            print(f"\n=== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                fn(*args, **kwargs)
            except Exception:  # report and go on with the next section
                traceback.print_exc()
                TABLE.append((name, "FAILED"))
            finally:
                gc.collect()
                torch.cuda.empty_cache()
                print(f"({name}: {time.perf_counter() - t0:.1f}s)", flush=True)

        return run

    return wrap


def config_with_layers(name: str, num_layers: int) -> str:
    """A config.json of a bundled model with fewer layers (random weights)."""
    d = json.loads((MODEL_CONFIGS_DIR / name / "config.json").read_text())
    d["num_hidden_layers"] = num_layers
    folder = Path(tempfile.mkdtemp()) / f"{name}-{num_layers}l"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return str(folder / "config.json")


def moe_weights(num_experts: int, hidden: int, inter: int, gen: torch.Generator):
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * 0.02
    router = torch.randn(num_experts, hidden, device="cuda", generator=gen) * 0.02
    return w13.bfloat16(), w2.bfloat16(), router.bfloat16()


SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


@section("kernel parity")
def kernel_parity() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model, (e, k, h, i) in SHAPES.items():
        w13, w2, router = moe_weights(e, h, i, gen)
        for num_tokens in (1, 3, 64, 300):
            x = torch.randn(num_tokens, h, device="cuda", generator=gen).bfloat16()
            logits = x @ router.T
            w, ids = route(logits, k, True)
            w_ref, ids_ref = route_ref(logits, k, True)
            same_ids = torch.equal(ids, ids_ref)
            ref = fused_moe_ref(x.float(), w13.float(), w2.float(), w_ref.float(), ids_ref)
            for path in ("gemv", "grouped"):
                out = fused_moe(x, w13, w2, w_ref, ids_ref, force_path=path)
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                ok = err < 2e-2 and same_ids
                print(f"{model} T={num_tokens} {path}: rel max err {err:.2e}, ids equal {same_ids}")
                if not ok:
                    TABLE.append((f"parity {model} T={num_tokens} {path}", f"BAD err {err:.1e}"))
        del w13, w2, router
    TABLE.append(("kernel parity", "done (BAD rows listed if any)"))


def time_layer(x, logits, w13, w2, top_k: int, path: str) -> float:
    """Seconds of routing + fused_moe, replayed from a CUDA graph as decode runs it."""

    def layer():
        w, ids = route(logits, top_k, True)
        return fused_moe(x, w13, w2, w, ids, force_path=path)

    layer()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    return time_fn(graph.replay, torch.device("cuda"), iters=20)


@section("fused MoE layer alone")
def kernel_bench(ceil: Ceilings) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    bw, flops_peak = ceil.bandwidth_bytes_per_s, ceil.matmul_flops_per_s
    rows = []
    for model, (e, k, h, i) in SHAPES.items():
        w13, w2, router = moe_weights(e, h, i, gen)
        expert_bytes = 3 * h * i * 2
        for num_tokens in (1, 2, 4, 8, 16, 256, 4096):
            x = torch.randn(num_tokens, h, device="cuda", generator=gen).bfloat16()
            logits = x @ router.T
            _, ids = route(logits, k, True)
            touched = int(torch.unique(ids).numel())
            paths = ("gemv", "grouped") if num_tokens <= 8 else ("grouped",)
            for path in paths:
                t = time_layer(x, logits, w13, w2, k, path)
                nbytes = touched * expert_bytes + 2 * num_tokens * h * 2
                flops = 2 * num_tokens * k * 3 * h * i
                row = (
                    model,
                    num_tokens,
                    path,
                    touched,
                    1e6 * t,
                    nbytes / t / 1e9,
                    flops / t / 1e12,
                )
                rows.append(row)
                print(
                    f"{model} T={num_tokens:5d} {path:7s} experts {touched:3d}: {1e6 * t:8.1f} us "
                    f"{nbytes / t / 1e9:7.0f} GB/s ({100 * nbytes / t / bw:5.1f}% of copy) "
                    f"{flops / t / 1e12:6.1f} TFLOP/s ({100 * flops / t / flops_peak:5.1f}% of mm)",
                    flush=True,
                )
        del w13, w2, router
    SUMMARY["kernel"] = rows
    for model, n, path, _, us, gbs, tf in rows:
        if n in (1, 16, 256, 4096) and (path == "grouped" or n == 1):
            TABLE.append(
                (f"kernel {model} T={n} {path}", f"{us:.0f} us, {gbs:.0f} GB/s, {tf:.1f} TF/s")
            )


def load(model: str, **kw) -> LLM:
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", device="cuda", **kw)
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated() / 2**30
    print(
        f"loaded {model} in {time.perf_counter() - t0:.1f}s, {used:.1f} GiB allocated", flush=True
    )
    return llm


@section("Qwen3-30B-A3B 48 layers: decode steps and throughput")
def qwen_full(ceil: Ceilings, num_requests: int) -> None:
    free, total = torch.cuda.mem_get_info()
    print(f"GPU memory free {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
    llm = load("qwen3-30b-a3b", max_model_len=2048, max_num_seqs=128, gpu_memory_utilization=0.92)
    rows = latency.run(llm.llm_engine, ceil, [1, 8, 32, 128], 128, 64)
    print(latency.format_rows(rows), flush=True)
    SUMMARY["qwen3_30b_decode"] = latency.as_dicts(rows)
    for r in rows:
        TABLE.append(
            (
                f"qwen3-30b-a3b decode bs={r.batch_size}",
                f"{r.output_tok_s:.0f} tok/s, {r.roofline_pct:.0f}% of roofline",
            )
        )
    wl = workloads.synthetic(
        num_requests, (100, 1024), (128, 128), llm.llm_engine.model_config.vocab_size
    )
    res = throughput.run(llm, ceil, wl, use_tqdm=False)
    print(
        f"{wl.name}: {res.output_tok_s:.0f} out tok/s, {res.total_tok_s:.0f} total tok/s, "
        f"{res.roofline_pct:.0f}% of roofline, preemptions {res.num_preemptions}, "
        f"max running {res.max_running}, jit compiles {len(res.jit_compiles)}",
        flush=True,
    )
    SUMMARY["qwen3_30b_throughput"] = vars(res)
    TABLE.append(
        (
            f"qwen3-30b-a3b offline n={num_requests}",
            f"{res.output_tok_s:.0f} out tok/s, {res.roofline_pct:.0f}%",
        )
    )


@section("Qwen3-30B-A3B 12 layers vs HF transformers")
def qwen_vs_hf(ceil: Ceilings) -> None:
    llm = load(
        config_with_layers("qwen3-30b-a3b", 12),
        max_model_len=1024,
        max_num_seqs=8,
        gpu_memory_utilization=0.5,
    )
    rows = latency.run(llm.llm_engine, ceil, [1], 128, 128)
    print(latency.format_rows(rows), flush=True)
    hf = peers.hf_model_from_engine(llm.llm_engine)
    prompt = list(range(1000, 1128))
    hf_tok_s = peers.hf_decode_tok_s(hf, prompt, 64)
    ours = rows[0].output_tok_s
    print(
        f"12 layers bs 1: roofline {ours:.0f} tok/s, HF {hf_tok_s:.1f} tok/s, "
        f"x{ours / hf_tok_s:.1f}"
    )
    from roofline.sampling_params import SamplingParams
    from tests.e2e.hf_reference import hf_greedy

    prompts = [list(range(100 + 7 * j, 140 + 7 * j)) for j in range(4)]
    got = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False
    )
    agree = []
    for p, o in zip(prompts, got):
        ref = hf_greedy(hf, p, 32)
        mine = o.outputs[0].token_ids
        agree.append(next((n for n, (a, b) in enumerate(zip(mine, ref)) if a != b), len(ref)))
    print(f"greedy tokens equal to HF before the first difference (of 32, bf16): {agree}")
    SUMMARY["qwen3_12l_vs_hf"] = dict(ours=ours, hf=hf_tok_s, agree=agree)
    TABLE.append(
        (
            "qwen3-30b-a3b 12 layers bs=1 vs HF",
            f"{ours:.0f} vs {hf_tok_s:.1f} tok/s (x{ours / hf_tok_s:.1f}), agree {agree}",
        )
    )


@section("Mixtral-8x7B 4 layers: decode steps")
def mixtral_reduced(ceil: Ceilings) -> None:
    llm = load(
        config_with_layers("mixtral-8x7b", 4),
        max_model_len=1024,
        max_num_seqs=32,
        gpu_memory_utilization=0.6,
    )
    rows = latency.run(llm.llm_engine, ceil, [1, 32], 128, 64)
    print(latency.format_rows(rows), flush=True)
    SUMMARY["mixtral_4l_decode"] = latency.as_dicts(rows)
    for r in rows:
        TABLE.append(
            (
                f"mixtral 4 layers decode bs={r.batch_size}",
                f"{r.output_tok_s:.0f} tok/s, {r.roofline_pct:.0f}%",
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--requests", type=int, default=64, help="offline workload size")
    ap.add_argument("--skip", default="", help="comma-separated: parity,kernel,full,hf,mixtral")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.perf_counter()
    ceil = measure(torch.device("cuda"), torch.bfloat16)
    print(
        f"ceilings ({ceil.device_name}): copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, "
        f"bf16 matmul {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    SUMMARY["ceilings"] = vars(ceil)
    if "parity" not in skip:
        kernel_parity()
    if "kernel" not in skip:
        kernel_bench(ceil)
    if "full" not in skip:
        qwen_full(ceil, args.requests)
    if "hf" not in skip:
        qwen_vs_hf(ceil)
    if "mixtral" not in skip:
        mixtral_reduced(ceil)
    print(f"\n=== summary ({time.perf_counter() - t0:.0f}s)")
    width = max(len(k) for k, _ in TABLE) if TABLE else 0
    for k, v in TABLE:
        print(f"{k:<{width}}  {v}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "gpu_moe.json", "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
