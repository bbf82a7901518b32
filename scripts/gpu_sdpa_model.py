"""Sections 4-6 of ``scripts/gpu_sdpa.py`` (imported by it, not run alone): the whole
Llama-3.1-8B with the cuDNN prefill path on and off (8192 and 8000 fresh, 7808 over 192 cached,
2048 over 8192 cached: % of the matmul ceiling), the long-prompt and default presets on and off,
and a FRESH process with the path on (start-up with the bucket warm-up, the presets' first runs,
batch-1 decode at --max-model-len 8448). cuDNN's attention kernel
(``cudnn_generated_fort_native_sdpa_...``) counts under "attention" in the kernel split."""

from __future__ import annotations

import sys
import time

import gpu_prefill as gp
import torch
from gpu_startup_prefill import (
    SUMMARY,
    kernel_split,
    print_split,
    run_child,
    section,
    step_timeline,
    timed_generate,
)

from roofline.attention import sdpa_prefill as sp
from roofline.bench.ceilings import measure


def set_path(llm, on: bool) -> sp.SdpaPrefill:  # noqa: ANN001
    s = llm.llm_engine.runner.backend.sdpa_prefill
    s.enabled = on
    return s


@section("4. the whole Llama-3.1-8B: 8192 (and 8000) fresh, 2048 over 8k; path on / off")
def model_prefill(llm, ceil) -> dict[str, float]:  # noqa: ANN001
    from roofline.planner.roofline import step_cost

    res: dict[str, float] = {}
    if llm is None:
        print("  (dry run: no model)")
        return res
    s = set_path(llm, True)
    built = sorted(s.ready or [])
    print(f"  warm-up: {len(built)} buckets {built[:3]}..{built[-1:]} in "
          f"{sum(s.warmup_s.values()):.2f} s (slowest {max(s.warmup_s.values(), default=0):.3f} s)",
          flush=True)  # fmt: skip
    print("  per bucket (ms): " + ", ".join(f"{b} {1e3 * t:.0f}" for b, t in
                                            sorted(s.warmup_s.items())), flush=True)  # fmt: skip
    SUMMARY.append(("bucket warm-up", f"{len(built)} buckets, {sum(s.warmup_s.values()):.2f} s"))
    cfg, rate = llm.llm_engine.model_config, ceil.matmul_flops_per_s
    base = list(range(100, 100 + 8192))
    for n in (8192, 8000):
        cost = step_cost(cfg, ceil.as_gpu_spec(), num_prefill_tokens=n)

        def fresh(i: int, n: int = n) -> list[int]:
            llm.llm_engine.kv_manager.reset_prefix_cache()
            return [5 + i] + base[1:n]

        for on in (True, False):
            set_path(llm, on)
            timed_generate(llm, fresh, 1)
            t = timed_generate(llm, fresh, 5)
            pct = 100 * cost.flops / t / rate
            res[f"{n} {'on' if on else 'off'}"] = pct
            print(
                f"  {n}-token prefill, path {'on' if on else 'off'}: {t * 1e3:.1f} ms, "
                f"{cost.flops / t / 1e12:.0f} TFLOP/s = {pct:.1f}% of matmul",
                flush=True,
            )
            SUMMARY.append((f"8B prefill {n} path {'on' if on else 'off'}",
                            f"{t * 1e3:.1f} ms, {pct:.1f}% of matmul"))  # fmt: skip
        if n == 8192:
            set_path(llm, True)
            print_split("8192 fresh, path on", *kernel_split(llm, fresh(7)))
            step_timeline(llm, fresh(8), "8192 fresh, path on")
    # a long prompt's second chunk (the long-prompt preset's steps): ~7808 over ~192 cached
    short_cost = step_cost(cfg, ceil.as_gpu_spec(), prefill_chunks=[(7808, 192)])
    llm.llm_engine.kv_manager.reset_prefix_cache()
    llm.generate([base[:192]], None, use_tqdm=False)  # the short prefix, cached
    tails = iter(range(30000, 400000, 7900))

    def second_chunk(i: int) -> list[int]:
        start = next(tails)
        return base[:192] + list(range(start, start + 7808))

    for on in (True, False):
        set_path(llm, on)
        timed_generate(llm, second_chunk, 1)
        t = timed_generate(llm, second_chunk)
        pct = 100 * short_cost.flops / t / rate
        res[f"7808/192 {'on' if on else 'off'}"] = pct
        print(f"  7808 over 192 cached, path {'on' if on else 'off'}: {t * 1e3:.1f} ms = "
              f"{pct:.1f}% of matmul", flush=True)  # fmt: skip
        SUMMARY.append((f"8B chunk 7808 over 192 path {'on' if on else 'off'}",
                        f"{t * 1e3:.1f} ms, {pct:.1f}%"))  # fmt: skip
    chunk_cost = step_cost(cfg, ceil.as_gpu_spec(), prefill_chunks=[(2048, 8192)])
    chunk = gp.chunks_over_cached(llm, base)

    for on in (True, False):
        set_path(llm, on)
        timed_generate(llm, chunk, 1)
        t = timed_generate(llm, chunk)
        pct = 100 * chunk_cost.flops / t / rate
        print(f"  2048 chunk over 8192 cached, path {'on' if on else 'off'}: {t * 1e3:.1f} ms = "
              f"{pct:.1f}% of matmul", flush=True)  # fmt: skip
        SUMMARY.append((f"8B chunk 2048 over 8k path {'on' if on else 'off'}",
                        f"{t * 1e3:.1f} ms, {pct:.1f}%"))  # fmt: skip
    set_path(llm, True)
    return res


@section("5. presets long-prompt and default, path on / off")
def presets(llm, ceil) -> dict[str, float]:  # noqa: ANN001
    from gpu_presets import run_preset

    res: dict[str, float] = {}
    if llm is None:
        print("  (dry run: no model)")
        return res
    for name in ("long-prompt", "default"):
        for on in (True, False):
            set_path(llm, on)
            r = run_preset(llm, ceil, name, f"path {'on' if on else 'off'}")
            res[f"{name} {'on' if on else 'off'}"] = r.roofline_pct
            SUMMARY.append(
                (
                    f"preset {name} path {'on' if on else 'off'}",
                    f"{r.roofline_pct:.1f}% of roofline, {len(r.jit_compiles)} JIT",
                )
            )
    set_path(llm, True)
    return res


@section("6. a FRESH process, path on: start-up with the bucket warm-up, presets run 1, decode")
def fresh_process(script: str, dry: bool) -> None:
    run_child([sys.executable, script, "--child"] + (["--dry"] if dry else []), 420)


def child(dry: bool) -> None:
    if dry:
        print("SUMMARY fresh process :: dry run (no model)")
        return
    from gpu_presets import run_preset

    from roofline import LLM
    from roofline.bench import latency

    ceil = measure(torch.device("cuda"), torch.bfloat16)
    t0 = time.perf_counter()
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **gp.PRESET_KW)
    s = llm.llm_engine.runner.backend.sdpa_prefill
    print(
        f"SUMMARY fresh process start-up (path on) :: {time.perf_counter() - t0:.1f} s, bucket "
        f"warm-up {len(s.ready or [])} in {sum(s.warmup_s.values()):.2f} s",
        flush=True,
    )
    for name in ("default", "long-prompt"):
        r = run_preset(llm, ceil, name, "run 1, path on")
        print(f"SUMMARY preset {name} (run 1, fresh, path on) :: {r.roofline_pct:.1f}% of "
              f"roofline, {len(r.jit_compiles)} JIT compiles {sorted(set(r.jit_compiles))}",
              flush=True)  # fmt: skip
    rows = latency.run(llm.llm_engine, ceil, [1], 512, 128)
    print(latency.format_rows(rows), flush=True)
    print(f"SUMMARY 8B batch-1 decode (max-model-len 8448) :: {rows[0].output_tok_s:.1f} tok/s")
