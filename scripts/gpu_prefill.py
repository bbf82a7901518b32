"""Issue 13's prefill targets on the GPU (Llama-3.1-8B config, random bf16 weights, H100):

1. parity of the prefill attention variants (``tma_hf``, the GQA-packed ``tma_gqa``) against
   torch SDPA / the fp32 reference: an 8k prompt in the model's layout, a ragged batch with
   chunks over paged and gathered prefixes;
2. the attention kernel alone at 8k (and a 2,048-token chunk over an 8k prefix): tile sweep of
   ``tma_gqa`` beside ``tma_hf`` and SDPA (cuDNN, flash), compiles on a thread pool first;
3. in a FRESH process: start-up, the default preset's first run (JIT compiles during it, % of
   roofline; goal: none), then the long-prompt preset;
4. the 8192-token prefill through the whole model per variant: ms, TFLOP/s, % of the matmul
   ceiling measured in this run, a per-kernel-kind profile and the step's timeline; a 2,048-token
   chunk over an 8k cached prefix; the long-prompt preset with the best variant;
5. batch-1 decode of the 8B (regression: >= 169 tok/s).

A table last.    python scripts/gpu_prefill.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from gpu_startup_prefill import (
    SUMMARY,
    kernel_split,
    print_split,
    section,
    step_timeline,
    timed_generate,
)

from roofline.bench.ceilings import measure, time_fn
from roofline.kernels import prefill_attention as pa
from roofline.kernels import prefill_attention_tma_gqa as tma_gqa
from roofline.kernels.prefill_attention import (
    causal_attention_flops,
    prefill_attention,
    prefill_attention_ref,
)
from roofline.kernels.prefix_gather import gather_prefix, plan_prefix

DEV = torch.device("cuda")
H, HK, D, PS = 32, 8, 128, 16
ENGINE_KW = dict(max_model_len=8448, max_num_seqs=256, max_num_batched_tokens=8192)
# (BLOCK_M rows, BLOCK_N keys, warps, stages); tma_gqa rows = BLOCK_M / 4 tokens x 4 heads
GQA_CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3),
               (128, 64, 8, 4), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 8, 4),
               (128, 64, 4, 3)]  # fmt: skip
HF_CONFIGS = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 4)]
N_FRESH, CHUNK = 8192, (8192, 2048)  # the fresh prompt; (cached, new) of the chunk
RAGGED = ([300, 1, 1000, 0, 2048, 17], [0, 800, 1500, 5, 4000, 3])  # (new, cached) per request


def model_layout(n: int):
    """q/k/v views of one QKV row per token (as the model passes them), pages in order."""
    qkv = torch.randn(n, (H + 2 * HK) * D, device=DEV, dtype=torch.bfloat16)
    q, k, v = qkv.split([H * D, HK * D, HK * D], dim=-1)
    q, k, v = q.view(n, H, D), k.view(n, HK, D), v.view(n, HK, D)
    npg = -(-n // PS)
    kc = torch.zeros(npg, PS, HK, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kc.view(-1, HK, D)[:n] = k
    vc.view(-1, HK, D)[:n] = v
    pages = torch.arange(npg, device=DEV, dtype=torch.int32)
    qsl = torch.tensor([0, n], device=DEV, dtype=torch.int32)
    sl = torch.tensor([n], device=DEV, dtype=torch.int32)
    return q, k, v, kc, vc, pages[None], qsl, sl


def sdpa(q, k, v, backend, repeat: bool = False) -> torch.Tensor:  # noqa: ANN001
    """Causal SDPA over [N, H, D] views (GQA by ``enable_gqa``, or K/V repeated)."""
    if repeat:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=not repeat)
    return o[0].transpose(0, 1)


def sdpa_ref(q, k, v) -> torch.Tensor:  # noqa: ANN001
    """The reference output: flash with K/V repeated (every torch build has it)."""
    return sdpa(q, k, v, torch.nn.attention.SDPBackend.FLASH_ATTENTION, repeat=True).float()


def ragged_batch(group: int, dtype: torch.dtype):
    """A ragged batch over shuffled pages (fresh prompts, chunks over prefixes, a decode row,
    an empty request): the reference's args and q/k/v as views of one QKV row per token."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
    from kernel_utils import make_paged

    (query_lens, context_lens), hk = RAGGED, 2
    b = make_paged(query_lens, context_lens, hk * group, hk, D, PS, dtype, seed=group)
    lens = list(zip(b.seq_lens_list, b.query_lens, strict=True))
    k = torch.cat([ks[s - q :] for ks, (s, q) in zip(b.k_seqs, lens, strict=True)])
    v = torch.cat([vs[s - q :] for vs, (s, q) in zip(b.v_seqs, lens, strict=True)])
    t = k.shape[0]
    qkv = torch.cat([b.q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    q_v, k_v, v_v = qkv.split([hk * group * D, hk * D, hk * D], dim=-1)
    args = (q_v.view(t, hk * group, D), b.k_cache, b.v_cache, b.block_table, b.query_start_loc,
            b.seq_lens, D**-0.5)  # fmt: skip
    return args, k_v.view(t, hk, D), v_v.view(t, hk, D), b


@section("1. parity on the GPU: tma_hf / tma_gqa vs SDPA (8k) and the fp32 reference (ragged)")
def parity() -> None:
    n = N_FRESH
    q, k, v, kc, vc, bt, qsl, sl = model_layout(n)
    cases = []  # (label, call, reference, tolerance); compiled on a pool first
    ref8k = sdpa_ref(q, k, v)
    for variant in ("tma_hf", "tma_gqa"):
        for has_prefix in (True, False):
            call = functools.partial(prefill_attention, q, kc, vc, bt, qsl, sl, D**-0.5, n,
                                     k_new=k, v_new=v, variant=variant,
                                     has_prefix=has_prefix)  # fmt: skip
            cases.append((f"8k fresh vs SDPA flash, {variant}, prefix code {has_prefix}", call,
                           ref8k, 3e-2))  # fmt: skip
    for group, dtype in ((4, torch.bfloat16), (2, torch.float32)):
        args, k_new, v_new, b = ragged_batch(group, dtype)
        ref = prefill_attention_ref(*args).float()
        plan = plan_prefix(b.block_table, b.seq_lens_list, b.query_lens, PS)
        prefix = gather_prefix(plan, b.k_cache, b.v_cache)
        for variant in ("tma_hf", "tma_gqa", "base"):
            for label, pre in (("paged prefix", None), ("gathered prefix", prefix)):
                call = functools.partial(prefill_attention, *args, max(b.query_lens),
                                         k_new=k_new, v_new=v_new, variant=variant,
                                         prefix=pre)  # fmt: skip
                tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
                cases.append((f"ragged, group {group}, {dtype}, {variant}, {label}", call, ref,
                              tol))  # fmt: skip
    compile_all([c[1] for c in cases])
    for label, call, ref, tol in cases:
        err = (call().float() - ref).abs().max().item()
        ok = err < tol
        print(f"  {label}: max abs diff {err:.3g} {'ok' if ok else 'MISMATCH'}", flush=True)
        if not ok:
            SUMMARY.append((f"parity {label}", f"MISMATCH {err:.3g}"))
    SUMMARY.append(("parity cases", f"{len(cases)} run"))


def compile_all(calls) -> None:  # noqa: ANN001
    """Compile every launch of ``calls`` on a thread pool (nothing runs)."""
    from roofline.kernels.parallel_compile import ParallelCompiler

    t0 = time.perf_counter()
    pc = ParallelCompiler()
    with pc.dry_run():
        for fn in calls:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - reported when timed
                print(f"  (dry run: {type(e).__name__}: {str(e)[:120]})")
    stats = pc.finish(wait=True)
    pc.close()
    print(f"  compiled {stats.num_kernels} ({stats.num_failed} failed) in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip


@section("2. attention alone: 8192-token prompt (model layout) and 2048 over an 8k prefix")
def kernel_sweep(quick: bool) -> tuple[int, int, int, int] | None:
    n = N_FRESH
    q, k, v, kc, vc, bt, qsl, sl = model_layout(n)
    flops = causal_attention_flops([n], [n], H, D)
    args = (q, kc, vc, bt, qsl, sl, D**-0.5, n)
    runs = {}  # name -> (tiles, variant, the kernel's prefix code in)
    runs[f"tma_hf {HF_CONFIGS[0]} +prefix code"] = (HF_CONFIGS[0], "tma_hf", True)
    for cfg in HF_CONFIGS[: 1 if quick else None]:
        runs[f"tma_hf {cfg}"] = (cfg, "tma_hf", False)
    runs[f"tma_gqa {GQA_CONFIGS[0]} +prefix code"] = (GQA_CONFIGS[0], "tma_gqa", True)
    for cfg in GQA_CONFIGS[: 6 if quick else None]:
        runs[f"tma_gqa {cfg}"] = (cfg, "tma_gqa", False)

    def call(cfg, variant, has_prefix):  # noqa: ANN001, ANN202
        bm, bn, w, s = cfg
        return lambda: prefill_attention(*args, k_new=k, v_new=v, variant=variant, block_m=bm,
                                         block_n=bn, num_warps=w, num_stages=s,
                                         has_prefix=has_prefix)  # fmt: skip

    compile_all([call(*r) for r in runs.values()])
    ref = sdpa_ref(q, k, v)
    results = []
    for name, (cfg, variant, has_prefix) in runs.items():
        try:
            fn = call(cfg, variant, has_prefix)
            err = (fn().float() - ref).abs().max().item()
            t = time_fn(fn, DEV, iters=10)
            results.append((flops / t / 1e12, name, t, err, cfg, variant))
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    backends = torch.nn.attention.SDPBackend
    sdpas = (("SDPA cudnn, gqa", backends.CUDNN_ATTENTION, False),
             ("SDPA flash, K/V repeated", backends.FLASH_ATTENTION, True))  # fmt: skip
    for name, backend, repeat in sdpas:
        try:
            fn = functools.partial(sdpa, q, k, v, backend, repeat)
            t = time_fn(fn, DEV, iters=10)
            results.append((flops / t / 1e12, name, t, 0.0, None, None))
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    for tf, name, t, err, _, _ in sorted(results, key=lambda r: -r[0]):
        print(f"  {name:28s} {t * 1e3:6.3f} ms {tf:5.0f} TFLOP/s (max diff {err:.2g})", flush=True)
    ours = [r for r in results if r[5] is not None]
    best_hf = max((r for r in ours if r[5] == "tma_hf"), default=None, key=lambda r: r[0])
    best_gqa = max((r for r in ours if r[5] == "tma_gqa" and "prefix code" not in r[1]),
                   default=None, key=lambda r: r[0])  # fmt: skip
    for r in (best_hf, best_gqa):
        if r is not None:
            SUMMARY.append((f"8k attention best {r[5]}", f"{r[2] * 1e3:.3f} ms, {r[0]:.0f} TF/s "
                                                         f"{r[4]}"))  # fmt: skip
    for r in results:
        if r[5] is None:
            SUMMARY.append((f"8k attention {r[1]}", f"{r[2] * 1e3:.3f} ms, {r[0]:.0f} TF/s"))
    best = best_gqa[4] if best_gqa is not None else None

    # 2048-token chunk over an 8192-token prefix (pages shuffled), prefix gathered
    ctx, m = CHUNK
    total = ctx + m
    pages = torch.randperm(total // PS, device=DEV, dtype=torch.int32)
    kc2 = torch.randn(total // PS, PS, HK, D, device=DEV, dtype=torch.bfloat16)
    vc2 = torch.randn_like(kc2)
    q2 = torch.randn(m, H, D, device=DEV, dtype=torch.bfloat16)
    k_new = kc2[pages[ctx // PS :].long()].reshape(m, HK, D)
    v_new = vc2[pages[ctx // PS :].long()].reshape(m, HK, D)
    qsl2 = torch.tensor([0, m], device=DEV, dtype=torch.int32)
    sl2 = torch.tensor([total], device=DEV, dtype=torch.int32)
    cflops = causal_attention_flops([total], [m], H, D)
    cargs = (q2, kc2, vc2, pages[None], qsl2, sl2, D**-0.5, m)
    pref = gather_prefix(plan_prefix(pages[None], [total], [m], PS), kc2, vc2)
    base = prefill_attention(*cargs, k_new=k_new, v_new=v_new, prefix=pref, variant="tma_hf")
    paged_code = pref._replace(complete=False)  # the kernel with its paged-prefix path too
    cases = [("tma_hf", None, pref), ("tma_hf +paged code", None, paged_code),
             ("tma_gqa", best, pref), ("tma_gqa +paged code", best, paged_code)]  # fmt: skip
    for variant, cfg, pre in cases:
        tiles = {} if cfg is None else dict(zip(("block_m", "block_n", "num_warps", "num_stages"),
                                                cfg, strict=True))  # fmt: skip
        fn = functools.partial(prefill_attention, *cargs, k_new=k_new, v_new=v_new, prefix=pre,
                               variant=variant.split()[0], **tiles)  # fmt: skip
        err = (fn().float() - base.float()).abs().max().item()
        t = time_fn(fn, DEV, iters=10)
        print(f"  2048 over 8k (gathered), {variant} {cfg or ''}: {t * 1e6:.0f} us, "
              f"{cflops / t / 1e12:.0f} TFLOP/s (diff vs tma_hf {err:.2g})",
              flush=True)  # fmt: skip
        SUMMARY.append((f"chunk attention {variant}", f"{cflops / t / 1e12:.0f} TF/s"))
    return best


@section("3. a FRESH process: start-up, the default preset's first run, the long-prompt preset")
def fresh_presets(variant: str | None, config) -> None:  # noqa: ANN001
    cmd = [sys.executable, __file__, "--child-presets"]
    if variant:
        cmd += ["--variant", variant, "--config", json.dumps(config)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    print("\n".join("  " + ln for ln in lines[-30:]), flush=True)
    if done.returncode:
        print(done.stderr[-3000:], flush=True)
    for ln in lines:
        if ln.startswith("SUMMARY "):
            name, _, value = ln[8:].partition(" :: ")
            SUMMARY.append((name, value))


def child_presets(variant: str | None, config) -> None:  # noqa: ANN001
    sys.argv = sys.argv[:1]
    from gpu_presets import run_preset

    from roofline import LLM

    if variant:
        set_variant(variant, config)
    ceil = measure(DEV, torch.bfloat16)
    t0 = time.perf_counter()
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **ENGINE_KW)
    t_start = time.perf_counter() - t0
    print(f"SUMMARY fresh process start-up :: {t_start:.1f} s", flush=True)
    tag = variant or pa.DEFAULT_VARIANT
    for name, label in (("default", "run 1"), ("long-prompt", "run 1")):
        res = run_preset(llm, ceil, name, f"{label}, {tag}")
        print(f"SUMMARY preset {name} ({label}, fresh process, {tag}) :: "
              f"{res.roofline_pct:.1f}% of roofline, {res.elapsed_s:.2f} s, "
              f"{len(res.jit_compiles)} JIT compiles {sorted(set(res.jit_compiles))}",
              flush=True)  # fmt: skip


def set_variant(variant: str, config) -> None:  # noqa: ANN001
    pa.DEFAULT_VARIANT = variant
    if variant == "tma_gqa" and config:
        tma_gqa.CONFIG = tuple(config)


@section("4. 8192-token prefill through Llama-3.1-8B, per variant; a 2048 chunk over 8k")
def model_prefill(llm, ceil, best) -> str:  # noqa: ANN001
    from roofline.planner.roofline import step_cost

    cfg = llm.llm_engine.model_config
    rate = ceil.matmul_flops_per_s
    base = list(range(100, 100 + 8192))
    cost = step_cost(cfg, ceil.as_gpu_spec(), num_prefill_tokens=8192)

    def fresh(i: int) -> list[int]:
        llm.llm_engine.kv_manager.reset_prefix_cache()
        return [5 + i] + base[1:]

    default = pa.DEFAULT_VARIANT
    results = {}
    for variant in ("tma_hf", "tma_gqa"):
        set_variant(variant, best)
        try:
            timed_generate(llm, fresh, 1)
            t = timed_generate(llm, fresh, 5)
        finally:
            pa.DEFAULT_VARIANT = default
        pct = 100 * cost.flops / t / rate
        results[variant] = t
        print(f"  8192-token prefill, {variant}: {t * 1e3:.1f} ms, {cost.flops / t / 1e12:.0f} "
              f"TFLOP/s = {pct:.1f}% of matmul", flush=True)  # fmt: skip
        SUMMARY.append((f"8B prefill 8192 ({variant})", f"{t * 1e3:.1f} ms, {pct:.1f}% of matmul"))
    winner = min(results, key=results.get)
    set_variant(winner, best)
    print_split(f"8192 fresh ({winner})", *kernel_split(llm, fresh(7)))
    step_timeline(llm, fresh(8), f"8192 fresh ({winner})")

    chunk_cost = step_cost(cfg, ceil.as_gpu_spec(), prefill_chunks=[(2048, 8192)])
    llm.llm_engine.kv_manager.reset_prefix_cache()
    llm.generate([base], None, use_tqdm=False)  # the prefix, cached
    suffixes = iter(range(20000, 120000, 2100))

    def chunk(i: int) -> list[int]:
        start = next(suffixes)
        return base + list(range(start, start + 2048))

    for variant in ("tma_hf", "tma_gqa"):
        set_variant(variant, best)
        timed_generate(llm, chunk, 1)
        t = timed_generate(llm, chunk)
        pct = 100 * chunk_cost.flops / t / rate
        print(f"  2048-token chunk over 8192 cached, {variant}: {t * 1e3:.1f} ms = {pct:.1f}% "
              "of matmul", flush=True)  # fmt: skip
        SUMMARY.append((f"8B chunk 2048 over 8k ({variant})", f"{t * 1e3:.1f} ms, {pct:.1f}%"))
    set_variant(winner, best)
    return winner


@section("5. the long-prompt preset with the best variant; 8B batch-1 decode")
def long_prompt_and_decode(llm, ceil, winner: str) -> None:  # noqa: ANN001
    from gpu_presets import run_preset

    from roofline.bench import latency

    res = run_preset(llm, ceil, "long-prompt", winner)
    SUMMARY.append((f"preset long-prompt ({winner})", f"{res.roofline_pct:.1f}% of roofline, "
                                                      f"{len(res.jit_compiles)} JIT"))  # fmt: skip
    rows = latency.run(llm.llm_engine, ceil, [1], 512, 128)
    print(latency.format_rows(rows), flush=True)
    SUMMARY.append(("8B batch-1 decode", f"{rows[0].output_tok_s:.1f} tok/s"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child-presets", action="store_true")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--config", default="null")
    args = ap.parse_args()
    if args.child_presets:
        child_presets(args.variant, json.loads(args.config))
        return
    t0 = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    print(f"ceilings: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
    parity()
    best = kernel_sweep(args.quick)
    torch.cuda.empty_cache()
    fresh_presets(None, None)  # the engine's defaults as committed
    from roofline import LLM

    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **ENGINE_KW)
    winner = model_prefill(llm, ceil, best) or pa.DEFAULT_VARIANT
    long_prompt_and_decode(llm, ceil, winner)
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s)")
    width = max(len(n) for n, _ in SUMMARY)
    for name, value in SUMMARY:
        print(f"{name.rjust(width)}: {value}")
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_prefill.json"), "w") as f:
        json.dump(dict(SUMMARY), f, indent=1)


if __name__ == "__main__":
    main()
