"""Structured outputs on the GPU, for the lead's session (one H100, under 4 minutes).

1. Parity: xgrammar's masking kernel on the GPU equals the CPU's on the same bitmask; a masked
   greedy pick is always an allowed token.
2. Mask cost per step at 1, 16 and 64 constrained rows (JSON schema, a synthetic vocabulary of
   Llama-3.1-8B's 128,256 tokens): host fill, copy + kernel, against the Llama-3.1-8B decode step
   (random weights) at the same batch, measured in the same run.
3. Offline throughput, Llama-3.1-8B (random weights), 64 requests: every request constrained
   by the JSON schema vs none (goal >= 0.9x), and the decode step with and without masks.

Needs xgrammar (``pip install xgrammar==0.2.8``; the GPU image may lack it: copy the wheels of
xgrammar, apache-tvm-ffi and pydantic(-core) for its Python and install with --no-index).

    python scripts/gpu_structured.py
"""

from __future__ import annotations

import json
import os
import time
import traceback

import torch

from roofline import LLM, SamplingParams
from roofline.bench.ceilings import measure
from roofline.structured_output import StructuredOutputsParams
from roofline.structured_output.bench import (
    BENCH_SCHEMA,
    format_costs,
    mask_cost,
    synthetic_backend,
)

VOCAB, STOP = 128256, 128009
ROWS = (1, 16, 64)
summary: dict[str, object] = {}


def section(name: str):
    def wrap(fn):
        def run(*a, **kw):
            print(f"\n=== {name}", flush=True)
            try:
                return fn(*a, **kw)
            except Exception:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                summary[name] = "failed"
                return None

        return run

    return wrap


@section("parity")
def parity(backend) -> None:
    import xgrammar as xgr

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, VOCAB, generator=gen)  # [64, V]
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (64, (VOCAB + 31) // 32), generator=gen, dtype=torch.int32
    )
    cpu = logits.clone()
    xgr.apply_token_bitmask_inplace(cpu, bitmask, vocab_size=VOCAB)
    gpu = logits.to(dev)
    backend.apply_bitmask(gpu, bitmask.to(dev))
    same = torch.equal(cpu, gpu.cpu())
    picks = gpu.argmax(-1).cpu()  # [64]
    allowed = ((bitmask[torch.arange(64), picks // 32] >> (picks % 32)) & 1).bool()
    print(f"GPU mask == CPU mask: {same}; greedy picks allowed: {bool(allowed.all())}")
    summary["parity"] = {"mask_equal": same, "picks_allowed": bool(allowed.all())}


@section("mask cost per step")
def mask_costs(backend) -> list:
    costs = [mask_cost(backend, rows, torch.device("cuda"), 100) for rows in ROWS]
    print(format_costs(costs), flush=True)
    summary["mask_cost"] = [{**vars(c), "total_ms": c.total_ms} for c in costs]
    return costs


def _run(llm: LLM, num_reqs: int, max_tokens: int, constrained: bool) -> tuple[float, float, int]:
    """(output tokens/s, ms per step, output tokens) of one offline batch."""
    so = StructuredOutputsParams(json=BENCH_SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=not constrained, structured_outputs=so
    )
    prompts = [[100 + (7 * i + j) % 30000 for j in range(64)] for i in range(num_reqs)]
    engine = llm.llm_engine
    before = engine.step_timing.steps, engine.step_timing.total_s
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    steps = engine.step_timing.steps - before[0]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / dt, 1e3 * (engine.step_timing.total_s - before[1]) / max(steps, 1), tokens


@section("decode step and throughput, Llama-3.1-8B")
def engine_runs(backend, costs) -> None:
    llm = LLM(
        "llama-3.1-8b", load_format="dummy", device="cuda", max_model_len=2048, max_num_seqs=64
    )
    llm.llm_engine.grammars.use_backend(backend)
    rows = []
    for b in ROWS:
        _run(llm, b, 16, False)  # warm
        free_tok_s, free_ms, _ = _run(llm, b, 128, False)
        _run(llm, b, 16, True)
        con_tok_s, con_ms, con_tokens = _run(llm, b, 128, True)
        mask = next((c.total_ms for c in costs or [] if c.num_rows == b), float("nan"))
        rows.append((b, free_ms, con_ms, mask, free_tok_s, con_tok_s, con_tokens))
        print(
            f"batch {b:3d}: step {free_ms:.2f} ms free, {con_ms:.2f} ms constrained; isolated mask "
            f"{mask:.3f} ms = {100 * mask / free_ms:.1f}% of the step; throughput {free_tok_s:.0f} "
            f"vs {con_tok_s:.0f} tok/s = {con_tok_s / free_tok_s:.2f}x ({con_tokens} tokens)",
            flush=True,
        )
    summary["llama8b"] = [
        dict(
            zip(
                (
                    "batch",
                    "step_ms",
                    "step_ms_constrained",
                    "mask_ms",
                    "tok_s",
                    "tok_s_constrained",
                    "tokens_constrained",
                ),
                r,
            )
        )
        for r in rows
    ]


def main() -> None:
    ceil = measure(torch.device("cuda"), torch.bfloat16)
    print(
        f"ceilings: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, "
        f"bf16 {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s"
    )
    print(f"host CPUs: {os.cpu_count()}")
    backend = synthetic_backend(VOCAB, STOP)
    parity(backend)
    costs = mask_costs(backend)
    engine_runs(backend, costs)
    print("\n=== summary")
    print(json.dumps(summary, indent=1, default=str))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_structured.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)


if __name__ == "__main__":
    main()
