"""Issue 13's prefill targets on the GPU (Llama-3.1-8B config, random bf16 weights, H100):

1. parity of the descriptor prefill kernel (with and without its prefix code, gathered and
   paged prefixes) and the paged one against torch SDPA / the fp32 reference;
2. the attention kernel alone at 8k and for a 2,048-token chunk over an 8k prefix: a tile sweep
   (compiled on a thread pool first) beside SDPA (cuDNN, flash);
3. in a FRESH process: start-up, the default preset's first run (JIT compiles during it, % of
   roofline; goal: none), then the long-prompt preset;
4. the 8192-token prefill through the whole model with the committed tiles and the sweep's best:
   ms, TFLOP/s, % of the matmul ceiling measured in this run, a per-kernel-kind profile, the
   device's idle gaps between kernels (which kernels they follow), the step's timeline; a
   2,048-token chunk over an 8k cached prefix;
5. the long-prompt preset with the best tiles, batch-1 decode of the 8B (>= 169 tok/s).

A table last.    python scripts/gpu_prefill.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from gpu_prefill_probes import attention_floor, device_gaps, host_phases
from gpu_startup_prefill import (
    SUMMARY,
    kernel_split,
    print_split,
    run_child,
    section,
    step_timeline,
    timed_generate,
)

from roofline.bench.ceilings import measure, time_fn
from roofline.kernels import prefill_attention as pa
from roofline.kernels.prefill_attention import (
    causal_attention_flops,
    prefill_attention,
    prefill_attention_ref,
)
from roofline.kernels.prefix_gather import gather_prefix, plan_prefix

DEV = torch.device("cuda")
H, HK, D, PS = 32, 8, 128, 16
# room for the 2,048-token chunk over an 8k cached prefix
ENGINE_KW = dict(max_model_len=10496, max_num_seqs=256, max_num_batched_tokens=8192)
PRESET_KW = dict(max_model_len=8448, max_num_seqs=256, max_num_batched_tokens=8192)
# (BLOCK_M rows, BLOCK_N keys, warps, stages) of the descriptor kernel; the first: committed
CONFIGS = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 2),
           (128, 32, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3),
           (128, 64, 8, 4)]  # fmt: skip
# (128, *, 4, *): one warpgroup per 128-row tile, two CTAs per SM that need not wait for each
# other (an 8-warp CTA's two warpgroups meet at a CTA barrier around every TMA refill: sm_90 SASS)
N_FRESH, CHUNK = 8192, (8192, 2048)  # the fresh prompt; (cached, new) of the chunk
RAGGED = ([300, 1, 1000, 0, 2048, 17], [0, 800, 1500, 5, 4000, 3])  # (new, cached) per request
GATHERED = ([1000, 2048, 300], [1500, 4000, 0])  # every context gathered: no paged path


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


def ragged_batch(group: int, dtype: torch.dtype, lens=None):  # noqa: ANN001
    """A ragged batch over shuffled pages (fresh prompts, chunks over prefixes, a decode row,
    an empty request): the reference's args and q/k/v as views of one QKV row per token."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
    from kernel_utils import make_paged

    (query_lens, context_lens), hk = lens or RAGGED, 2
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


@section("1. parity on the GPU: the descriptor kernel vs SDPA (8k) and the fp32 reference")
def parity() -> None:
    n = N_FRESH
    q, k, v, kc, vc, bt, qsl, sl = model_layout(n)
    cases = []  # (label, call, reference, tolerance); compiled on a pool first
    ref8k = sdpa_ref(q, k, v)
    for has_prefix in (True, False):
        call = functools.partial(prefill_attention, q, kc, vc, bt, qsl, sl, D**-0.5, n, k_new=k,
                                 v_new=v, has_prefix=has_prefix)  # fmt: skip
        cases.append((f"8k fresh vs SDPA flash, prefix code {has_prefix}", call, ref8k, 3e-2))
    for group, dtype, lens in ((4, torch.bfloat16, RAGGED), (2, torch.float32, RAGGED),
                               (4, torch.bfloat16, GATHERED)):  # fmt: skip
        args, k_new, v_new, b = ragged_batch(group, dtype, lens)
        ref = prefill_attention_ref(*args).float()
        plan = plan_prefix(b.block_table, b.seq_lens_list, b.query_lens, PS)
        prefix = gather_prefix(plan, b.k_cache, b.v_cache)
        tag = f"{'all gathered' if lens is GATHERED else 'ragged'}, group {group}, {dtype}"
        for variant in ("tma_hf", "base"):
            for label, pre in (("paged prefix", None), ("gathered prefix", prefix)):
                call = functools.partial(prefill_attention, *args, max(b.query_lens),
                                         k_new=k_new, v_new=v_new, variant=variant,
                                         prefix=pre)  # fmt: skip
                tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
                cases.append((f"{tag}, {variant}, {label}", call, ref, tol))
    compile_all([c[1] for c in cases])
    bad = 0
    for label, call, ref, tol in cases:
        err = (call().float() - ref).abs().max().item()
        bad += err >= tol
        print(f"  {label}: max abs diff {err:.3g} {'ok' if err < tol else 'MISMATCH'}", flush=True)
    SUMMARY.append(("parity", f"{len(cases) - bad} of {len(cases)} ok"))


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

    def call(cfg, has_prefix=False, a=args, kv=(k, v), prefix=None):  # noqa: ANN001, ANN202
        tiles = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), cfg, strict=True))
        return functools.partial(prefill_attention, *a, k_new=kv[0], v_new=kv[1],
                                 has_prefix=has_prefix, prefix=prefix, **tiles)  # fmt: skip

    runs = {f"{cfg}": call(cfg) for cfg in CONFIGS}
    runs[f"{CONFIGS[0]} +prefix code"] = call(CONFIGS[0], True)

    # 2048-token chunk over an 8192-token prefix (pages shuffled), prefix gathered
    ctx, m = CHUNK
    total = ctx + m
    pages = torch.randperm(total // PS, device=DEV, dtype=torch.int32)
    kc2 = torch.randn(total // PS, PS, HK, D, device=DEV, dtype=torch.bfloat16)
    vc2 = torch.randn_like(kc2)
    q2 = torch.randn(m, H, D, device=DEV, dtype=torch.bfloat16)
    kv2 = (kc2[pages[ctx // PS :].long()].reshape(m, HK, D),
           vc2[pages[ctx // PS :].long()].reshape(m, HK, D))  # fmt: skip
    qsl2 = torch.tensor([0, m], device=DEV, dtype=torch.int32)
    sl2 = torch.tensor([total], device=DEV, dtype=torch.int32)
    cflops = causal_attention_flops([total], [m], H, D)
    cargs = (q2, kc2, vc2, pages[None], qsl2, sl2, D**-0.5, m)
    pref = gather_prefix(plan_prefix(pages[None], [total], [m], PS), kc2, vc2)
    chunk_runs = {f"{cfg}": call(cfg, True, cargs, kv2, pref) for cfg in CONFIGS[:5]}
    compile_all([*runs.values(), *chunk_runs.values()])

    ref = sdpa_ref(q, k, v)
    results = []
    for name, fn in runs.items():
        try:
            err = (fn().float() - ref).abs().max().item()
            t = time_fn(fn, DEV, iters=10)
            results.append((flops / t / 1e12, name, t, err))
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    backends = torch.nn.attention.SDPBackend
    sdpas = (("SDPA cudnn, gqa", backends.CUDNN_ATTENTION, False),
             ("SDPA flash, K/V repeated", backends.FLASH_ATTENTION, True))  # fmt: skip
    for name, backend, repeat in sdpas:
        try:
            t = time_fn(functools.partial(sdpa, q, k, v, backend, repeat), DEV, iters=10)
            results.append((flops / t / 1e12, name, t, 0.0))
            SUMMARY.append(
                (f"8k attention {name}", f"{t * 1e3:.3f} ms, {flops / t / 1e12:.0f} TF/s")
            )
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    print("  8192-token prompt, descriptor kernel (BLOCK_M, BLOCK_N, warps, stages):")
    for tf, name, t, err in sorted(results, key=lambda r: -r[0]):
        print(f"  {name:34s} {t * 1e3:6.3f} ms {tf:5.0f} TFLOP/s (max diff {err:.2g})", flush=True)
    ours = [r for r in results if r[1].startswith("(") and "prefix" not in r[1]]
    best = max(ours, key=lambda r: r[0], default=None)
    committed = next((r for r in ours if r[1] == f"{CONFIGS[0]}"), None)
    for label, r in (("committed", committed), ("best", best)):
        if r is not None:
            SUMMARY.append((f"8k attention, {label} tiles {r[1]}",
                            f"{r[2] * 1e3:.3f} ms, {r[0]:.0f} TF/s"))  # fmt: skip

    base = chunk_runs[f"{CONFIGS[0]}"]().float()
    print("  2048-token chunk over 8192 cached (prefix gathered):")
    for name, fn in chunk_runs.items():
        err = (fn().float() - base).abs().max().item()
        t = time_fn(fn, DEV, iters=10)
        print(f"  {name:34s} {t * 1e6:6.0f} us {cflops / t / 1e12:5.0f} TFLOP/s (diff {err:.2g})",
              flush=True)  # fmt: skip
        SUMMARY.append((f"chunk attention {name}", f"{cflops / t / 1e12:.0f} TF/s"))
    if best is None:
        return None
    return tuple(int(x) for x in best[1].strip("()").split(","))


@section("3. a FRESH process: start-up, the default preset's first run, the long-prompt preset")
def fresh_presets() -> None:
    run_child([sys.executable, __file__, "--child-presets"], 400)


def child_presets() -> None:
    sys.argv = sys.argv[:1]
    from gpu_presets import run_preset

    from roofline import LLM

    ceil = measure(DEV, torch.bfloat16)
    t0 = time.perf_counter()
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **PRESET_KW)
    print(f"SUMMARY fresh process start-up :: {time.perf_counter() - t0:.1f} s", flush=True)
    for name in ("default", "long-prompt"):
        res = run_preset(llm, ceil, name, "run 1")
        print(f"SUMMARY preset {name} (run 1, fresh process) :: {res.roofline_pct:.1f}% of "
              f"roofline, {res.elapsed_s:.2f} s, {len(res.jit_compiles)} JIT compiles "
              f"{sorted(set(res.jit_compiles))}", flush=True)  # fmt: skip


@section("4. 8192-token prefill through Llama-3.1-8B: committed vs best tiles; 2048 over 8k")
def chunks_over_cached(llm, base: list[int], rows: int = 2048):  # noqa: ANN001, ANN201
    """``base`` cached once (the prefix cache reset first), then a prompts function for
    ``timed_generate``: ``base`` plus ``rows`` tokens not seen before, a new run each call."""
    llm.llm_engine.kv_manager.reset_prefix_cache()
    llm.generate([base], None, use_tqdm=False)  # the prefix, cached
    suffixes = iter(range(20000, 120000, rows + 52))

    def chunk(i: int) -> list[int]:
        start = next(suffixes)
        return base + list(range(start, start + rows))

    return chunk


def model_prefill(llm, ceil, best) -> tuple | None:  # noqa: ANN001
    from roofline.planner.roofline import step_cost

    cfg = llm.llm_engine.model_config
    rate = ceil.matmul_flops_per_s
    base = list(range(100, 100 + 8192))
    cost = step_cost(cfg, ceil.as_gpu_spec(), num_prefill_tokens=8192)

    def fresh(i: int) -> list[int]:
        llm.llm_engine.kv_manager.reset_prefix_cache()
        return [5 + i] + base[1:]

    tiles = {"committed": None}
    if best is not None and best != CONFIGS[0]:
        tiles[f"best {best}"] = best
    results = {}
    for label, t_cfg in tiles.items():
        pa.TMA_TILES = t_cfg
        timed_generate(llm, fresh, 1)
        t = timed_generate(llm, fresh, 5)
        pct = 100 * cost.flops / t / rate
        results[label] = (t, t_cfg)
        tf = cost.flops / t / 1e12
        print(f"  8192-token prefill, {label} tiles: {t * 1e3:.1f} ms, {tf:.0f} TFLOP/s = "
              f"{pct:.1f}% of matmul", flush=True)  # fmt: skip
        SUMMARY.append((f"8B prefill 8192 ({label} tiles)",
                        f"{t * 1e3:.1f} ms, {pct:.1f}% of matmul"))  # fmt: skip
    winner = min(results, key=lambda k: results[k][0])
    pa.TMA_TILES = results[winner][1]
    attention_floor(llm, fresh, cost.flops, rate)
    print_split(f"8192 fresh ({winner})", *kernel_split(llm, fresh(7)))
    try:
        device_gaps(llm, fresh(9))
    except Exception as e:  # noqa: BLE001 - a profiler without device timestamps
        print(f"  device gaps: {type(e).__name__}: {str(e)[:200]}", flush=True)
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    before = torch.cuda.memory_stats()
    timed_generate(llm, fresh, 1)
    after = torch.cuda.memory_stats()
    print("  allocator during one 8192 prefill: " + ", ".join(
        f"{k} +{after.get(k, 0) - before.get(k, 0)}" for k in keys), flush=True)  # fmt: skip
    step_timeline(llm, fresh(8), f"8192 fresh ({winner})")
    try:
        host_phases(llm, fresh(10))
    except Exception as e:  # noqa: BLE001 - an engine whose pieces moved
        print(f"  host pieces: {type(e).__name__}: {str(e)[:200]}", flush=True)

    chunk_cost = step_cost(cfg, ceil.as_gpu_spec(), prefill_chunks=[(2048, 8192)])
    chunk = chunks_over_cached(llm, base)

    for label, t_cfg in tiles.items():
        pa.TMA_TILES = t_cfg
        timed_generate(llm, chunk, 1)
        t = timed_generate(llm, chunk)
        pct = 100 * chunk_cost.flops / t / rate
        print(f"  2048-token chunk over 8192 cached, {label} tiles: {t * 1e3:.1f} ms = "
              f"{pct:.1f}% of matmul", flush=True)  # fmt: skip
        SUMMARY.append((f"8B chunk 2048 over 8k ({label} tiles)", f"{t * 1e3:.1f} ms, {pct:.1f}%"))
    pa.TMA_TILES = results[winner][1]
    print_split("2048 chunk over 8k", *kernel_split(llm, chunk(9)))
    return results[winner][1]


@section("5. the long-prompt preset with the best tiles; 8B batch-1 decode")
def long_prompt_and_decode(llm, ceil) -> None:  # noqa: ANN001
    from gpu_presets import run_preset

    from roofline.bench import latency

    tag = f"tiles {pa.TMA_TILES or 'committed'}"
    res = run_preset(llm, ceil, "long-prompt", tag)
    value = f"{res.roofline_pct:.1f}% of roofline, {len(res.jit_compiles)} JIT"
    SUMMARY.append((f"preset long-prompt ({tag})", value))
    rows = latency.run(llm.llm_engine, ceil, [1], 512, 128)
    print(latency.format_rows(rows), flush=True)
    SUMMARY.append(("8B batch-1 decode", f"{rows[0].output_tok_s:.1f} tok/s"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child-presets", action="store_true")
    args = ap.parse_args()
    if args.child_presets:
        child_presets()
        return
    t0 = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    print(f"ceilings: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
    parity()
    best = kernel_sweep(args.quick)
    torch.cuda.empty_cache()
    fresh_presets()  # the engine as committed, in a process of its own
    from roofline import LLM

    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **ENGINE_KW)
    model_prefill(llm, ceil, best)
    long_prompt_and_decode(llm, ceil)
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s)")
    width = max(len(n) for n, _ in SUMMARY)
    for name, value in SUMMARY:
        print(f"{name.rjust(width)}: {value}")
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_prefill.json"), "w") as f:
        json.dump(dict(SUMMARY), f, indent=1)


if __name__ == "__main__":
    main()
