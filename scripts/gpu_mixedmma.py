"""Wide weight tiles for the mixed-input GEMM at decode batches (M = 32..256) on one GPU (H100,
Llama-3.1-8B shapes, random weights), and where an offline step's time goes.

Why: at 128 rows the configs shipped so far (64 weight rows per program) re-read all of x once
per 64 weight rows: qkv at M = 128 moves 96 MiB of x from L2 for 24 MiB of int8 weight (gate_up 448
MiB of x for 112 MiB), so the kernel runs at the L2 bandwidth, not the tensor cores or HBM.
256-row weight tiles (8 or 16 warps) cut that 4x; uneven split-K fills the SMs again.

``sweep``: per M (128, 2048, 32, 256, 64), method (int8 per channel, int4 g128, fp8 weight-only,
W8A8) and shape (qkv / o / gate_up / down): every candidate tile x split-K, each checked against
x times the exactly dequantized weight ON THE GPU before it is timed (a wrong config is printed
and never picked), beside bf16 cuBLAS, the table's pick and the library GEMM; prints the winners
as a ``TUNED_CONFIGS`` literal (also ``$OUT/mixed_mma_tuned.txt``).

    python scripts/gpu_mixedmma.py --budget 70              # first check, ~90 s
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_mixedgemm as base  # noqa: E402  (shared helpers: rings, graphs, references)

from roofline.kernels import mixed_gemm as mg  # noqa: E402
from roofline.kernels.mixed_gemm import MixedGemmConfig  # noqa: E402

SHAPES = base.SHAPES
SMS = 132
SMEM_LIMIT = 227 << 10
BF16 = torch.bfloat16
SUMMARY: dict[str, object] = {}
TABLE: list[str] = []

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, mode) per M bucket; mode (MODE_* of
# mixed_gemm_configs): 0 the weight in registers as wgmma's A operand (shipped so far: racy),
# T the weight staged in shared memory as the B operand, W registers with each tile's MMAs
# awaited
T, W = mg.MODE_SMEM, mg.MODE_REG_WAIT
FAMILIES = {
    256: [
        (128, 64, 128, 4, 3, W), (128, 128, 64, 8, 3, W), (128, 128, 128, 8, 3, W),
        (256, 64, 64, 4, 3, W), (256, 128, 64, 8, 3, W), (128, 64, 256, 4, 2, W),
        (128, 128, 64, 4, 3, T), (256, 128, 64, 8, 3, T),
    ],
    128: [
        (128, 64, 128, 4, 3, W), (128, 128, 64, 8, 3, W), (128, 128, 128, 8, 3, W),
        (128, 64, 256, 4, 2, W), (64, 64, 128, 4, 3, W), (128, 128, 64, 4, 3, T),
    ],
    2048: [
        (128, 256, 64, 8, 3, T), (64, 256, 64, 8, 3, T), (256, 128, 64, 8, 3, T),
        (128, 128, 64, 4, 3, T), (128, 128, 64, 4, 4, T), (128, 256, 64, 8, 4, T),
        (128, 128, 128, 8, 3, W), (256, 128, 64, 8, 3, W),
    ],
    32: [
        (32, 64, 128, 4, 4, W), (32, 128, 128, 4, 4, W), (32, 256, 64, 4, 4, T),
        (32, 128, 64, 4, 4, T), (32, 128, 128, 4, 3, T),
    ],
    64: [
        (64, 64, 128, 4, 3, W), (64, 128, 128, 4, 3, W), (64, 256, 64, 8, 3, T),
        (64, 128, 128, 4, 3, T), (64, 128, 64, 4, 4, T),
    ],
}  # fmt: skip


def dry_run_setup() -> None:
    """CPU dry run of the sweep's logic (``--dry-run``, TRITON_INTERPRET=1): tiny shapes, two
    candidates per shape, wall-clock timing instead of CUDA graphs."""
    global SHAPES, SMS
    base.DEVICE = "cpu"
    SHAPES = {"qkv": (192, 256), "down": (128, 512)}
    SMS = 4

    def time_graph(calls: list, iters: int = 1) -> float:
        t0 = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - t0) / len(calls)

    base.time_graph = time_graph
    base.RING_BYTES = 1 << 20
    for m, fams in FAMILIES.items():
        FAMILIES[m] = [f for f in fams if f[0] * 2 <= m or f[0] == m][:2]


def splits(m: int, n: int, k: int, bm: int, bn: int, bk: int) -> list[int]:
    """Split-K counts that bring the programs to about one or two per SM."""
    tiles = math.ceil(m / bm) * math.ceil(n / bn)
    out = {1, round(SMS / tiles), round(2 * SMS / tiles)}
    return sorted(s for s in out if 1 <= s <= min(16, k // bk))


def candidates(kind: str, m: int, n: int, k: int) -> list[MixedGemmConfig]:
    out: list[MixedGemmConfig] = []
    w_bytes = {"int4": 0.5}.get(kind, 1)
    x_bytes = 1 if kind == "w8a8" else 2
    for bm, bn, bk, warps, stages, mode in FAMILIES[m]:
        if kind == "w8a8" and (bk < 64 or (mode == 1 and bm < 64)):
            continue  # (fp8 x with fewer than 64 rows as the A operand: no fp8 MMA)
        staged = bn * bk * 2 if mode == 1 and kind != "w8a8" else 0  # the widened weight tile
        if stages * bk * (bm * x_bytes + bn * w_bytes) + staged > SMEM_LIMIT:
            continue
        for sk in splits(m, n, k, bm, bn, bk):
            out.append(MixedGemmConfig(bm, bn, bk, 8, sk, warps, stages, mode))
    return out


def ref_for(kind: str, x, qw, s, o) -> torch.Tensor:
    return base.w8a8_exact(x, qw, s) if kind == "w8a8" else base.exact_ref(kind, x, qw, s, o)


@base.section("sweep")
def sweep(ms: list[int], kinds: list[str], budget_s: float) -> dict:
    t_end = time.perf_counter() + budget_s
    tuned: dict[tuple, tuple | None] = {}
    wrong: list[str] = []
    for m in ms:
        for kind in kinds:
            if time.perf_counter() > t_end:
                print(f"budget ({budget_s:.0f} s) reached before {kind} M={m}", flush=True)
                SUMMARY["wrong"] = wrong
                return tuned
            wkind = "fp8" if kind == "w8a8" else kind
            n0, k0 = SHAPES["qkv"]
            w0 = base.quantized(wkind, n0, k0)
            x0 = torch.randn(17, k0, device=base.DEVICE, dtype=torch.bfloat16)
            fams = {c._replace(split_k=1) for c in candidates(kind, m, n0, k0)}
            fams |= {c._replace(split_k=2) for c in fams}  # SPLIT / FIXUP constexprs
            base.precompile([partial(base.ours(kind, c, True), x0, *w0) for c in fams])
            for layer, (n, k) in SHAPES.items():
                heavy = m >= 2048
                ring = base.make_ring(wkind, n, k, heavy)
                qw, s, o = ring[0]
                xs = [torch.randn(m - 3, k, device=base.DEVICE, dtype=BF16) for _ in "abc"]
                refs = [ref_for(kind, x, qw, s, o) for x in xs]  # (m - 3: a partial row block)
                x = xs[0]
                res = []
                for c in candidates(kind, m, n, k):
                    try:
                        fn = base.ours(kind, c)
                        err = max(base.rel_err(fn(xx, qw, s, o), r) for xx, r in zip(xs, refs))
                        if not err < 2e-2:
                            wrong.append(f"{kind} {layer} M={m - 3} {tuple(c)}: {err:.2e}")
                            print(f"  WRONG {wrong[-1]}", flush=True)
                            continue
                        res.append((base.time_ring(partial(fn, x), ring, heavy), c))
                    except Exception as e:  # noqa: BLE001
                        print(f"  {kind} {layer} M={m} {tuple(c)}: {type(e).__name__}: {e}")
                t_lib = base.time_ring(partial(base.lib_gemm(kind), x), ring, heavy)
                w16 = [(torch.randn(n, k, device=base.DEVICE, dtype=BF16),) for _ in range(4)]
                t16 = base.time_ring(partial(F.linear, x), w16[: 2 if heavy else 4], heavy)
                picked = mg.pick_config(kind, m, n, k, x.device)
                t_pick = (
                    base.time_ring(partial(base.ours(kind, picked), x), ring, heavy)
                    if picked
                    else t_lib
                )
                if not res:
                    continue
                res.sort()
                t_best, best = res[0]
                safe = [(t, c) for t, c in res if kind == "w8a8" or c.mode != mg.MODE_REG]
                t_safe, best_safe = safe[0] if safe else (math.inf, None)
                winner = tuple(best_safe) if best_safe and t_safe <= t_lib else None
                tuned[(kind, n, k, m)] = winner
                print(
                    f"{kind:4} {layer:7} M={m:4}: bf16 {t16 * 1e6:6.1f} | table "
                    f"{t_pick * 1e6:6.1f} ({t16 / t_pick:4.2f}x) | lib {t_lib * 1e6:6.1f} | best "
                    f"{t_best * 1e6:6.1f} ({t16 / t_best:4.2f}x) {tuple(best)} | race-free "
                    f"{t_safe * 1e6:6.1f} ({t16 / t_safe:4.2f}x) {best_safe and tuple(best_safe)}"
                    "; next: " + "; ".join(f"{tuple(c)} {t * 1e6:.1f}" for t, c in safe[1:3]),
                    flush=True,
                )
                SUMMARY[f"sweep_{kind}_{layer}_{m}"] = {
                    "bf16_us": t16 * 1e6, "shipped_us": t_pick * 1e6, "lib_us": t_lib * 1e6,
                    "best_us": t_best * 1e6, "best": tuple(best), "safe_us": t_safe * 1e6,
                    "safe": best_safe and tuple(best_safe),
                    "top": [(tuple(c), t * 1e6) for t, c in res[:12]],
                }  # fmt: skip
                del ring, x, xs, refs, w16
            torch.cuda.empty_cache()
    SUMMARY["wrong"] = wrong
    return tuned


@base.section("race")
def race(repeats: int) -> None:
    """How often a config returns a wrong result over ``repeats`` calls (fresh x each): the
    table's picks at 125 and 253 rows, as shipped and in the last session's register mode, and
    the family the last session saw fail ((128, 128, 64, 8 warps), weight from registers)
    beside the same tile in the two race-free modes. A register-operand wgmma whose A registers
    ptxas 12.8 reuses before the MMA has read them gives wrong results only sometimes."""
    bad = MixedGemmConfig(128, 128, 64, 8, 1, 8, 3)
    for kind in ("int8", "int4", "fp8"):
        for layer, (n, k) in SHAPES.items():
            qw, s, o = base.quantized(kind, n, k, seed=5)
            line = []
            for m in (125, 253):
                picked = mg.pick_config(kind, m, n, k, qw.device)
                cfgs = {"bad-reg": bad, "bad-smem": bad._replace(mode=1),
                        "bad-wait": bad._replace(mode=2)}  # fmt: skip
                if picked is not None:  # the table's tile in the last session's (racy) mode
                    cfgs["table-reg"] = picked._replace(mode=mg.MODE_REG)
                    cfgs["table"] = picked
                for name, c in cfgs.items():
                    if c is None or (name.startswith("bad") and m != 253):
                        continue
                    fn = base.ours(kind, c)
                    wrong, worst = 0, 0.0
                    for _ in range(repeats):
                        x = torch.randn(m, k, device=base.DEVICE, dtype=torch.bfloat16)
                        err = base.rel_err(fn(x, qw, s, o), ref_for(kind, x, qw, s, o))
                        worst = max(worst, err)
                        wrong += not err < 2e-2
                    line.append(f"M={m} {name} {wrong}/{repeats} wrong (worst {worst:.1e})")
                    SUMMARY[f"race_{kind}_{layer}_{m}_{name}"] = (wrong, repeats, worst, c)
            print(f"{kind:4} {layer:7}: " + "; ".join(line), flush=True)


@base.section("fp8 norm")
def fp8_norm() -> None:
    """W8A8 with the RMSNorm quantizing its rows (``RMSNorm(..., fp8=True)`` -> ``Fp8Rows``)
    against norm, then the layer quantizing x: the same numbers (parity on the GPU), and the
    time of norm + quantization + GEMM each way (qkv and gate_up shapes)."""
    from roofline.layers.linear import MergedLinear
    from roofline.layers.norm import RMSNorm
    from roofline.quantization.fp8 import Fp8LinearMethod

    hidden = 4096
    norm = RMSNorm(hidden).to("cuda", BF16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    for layer_name in ("qkv", "gate_up"):
        n, k = SHAPES[layer_name]
        layer = MergedLinear(k, [n], method=Fp8LinearMethod(w8a8=True), params_dtype=BF16)
        layer = layer.to("cuda")
        layer.load(0, "weight", torch.randn(n, k, device="cuda", dtype=BF16) * 0.02)
        layer.process_weights_after_loading()
        for m in (128, 2048, 8192):
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            res = torch.randn(m, k, device="cuda", dtype=BF16)
            with torch.no_grad():
                rows, r1 = norm(x, res, fp8=True)
                fused = layer(rows)
                normed, r2 = norm(x, res)
                apart = layer(normed)
            err = base.rel_err(fused, apart)
            same_res = torch.equal(r1, r2)

            def run_fused(x=x, res=res, layer=layer):
                return layer(norm(x, res, fp8=True)[0])

            def run_apart(x=x, res=res, layer=layer):
                return layer(norm(x, res)[0])

            with torch.no_grad():
                t_f = base.time_graph([run_fused] * 4)
                t_a = base.time_graph([run_apart] * 4)
            line = (
                f"{layer_name:7} M={m:5}: fused norm+quant vs apart: rel err {err:.1e}, "
                f"residual equal {same_res}; {t_f * 1e6:7.1f} vs {t_a * 1e6:7.1f} us "
                f"(saves {100 * (1 - t_f / t_a):.1f}%)"
            )
            print(line, flush=True)
            SUMMARY[f"fp8norm_{layer_name}_{m}"] = (err, same_res, t_f * 1e6, t_a * 1e6)
            if not err < 2e-2 or not same_res:
                TABLE.append("FP8 NORM PARITY FAILED: " + line)


KERNEL_KINDS = (
    ("attention", ("attention", "attn", "flash", "cascade", "_decode_split", "_decode_merge",
                   "_prefill_", "_verify_")),
    ("gemm", ("gemm", "gemv", "matmul", "cutlass", "xmma", "nvjet", "sm90", "cublas", "dequant",
              "scaled_mm")),
)  # fmt: skip


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(key in low for key in keys):
            return kind
    return "other"


@base.section("engine")
def engine(
    methods: list[str],
    num_requests: int,
    profile_requests: int,
    step_batches: list[int],
    profile_methods: list[str] | None = None,
    profile_output: int = 0,
) -> None:
    """Per method: decode steps at ``step_batches``, the offline workload (input 100-1024, output
    512) with its steps split into prefill-bearing and decode-only, then a profiled run of
    ``profile_requests`` (``profile_output`` tokens each: the same concurrency, fewer decode
    steps): kernel time by kind (GEMM, attention, other); bf16 first (the denominator)."""
    import gc

    from gpu_profile_presets import phase_split
    from torch.profiler import ProfilerActivity, profile

    from roofline import LLM, SamplingParams
    from roofline.bench import latency, throughput, workloads
    from roofline.bench.ceilings import measure

    ceil = measure(torch.device("cuda"), torch.bfloat16)
    for method in methods:
        llm = None
        try:
            t0 = time.perf_counter()
            quant, _, kv = method.partition("+kv-")  # "fp8-w8a8+kv-fp8": an fp8 KV cache too
            llm = LLM(
                base.MODEL, load_format="dummy", device="cuda", max_model_len=4096,
                max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
                quantization=None if quant == "bf16" else quant, kv_cache_dtype=kv or "auto",
            )  # fmt: skip
            startup = time.perf_counter() - t0
            vocab = llm.llm_engine.model_config.vocab_size
            steps = {}
            if step_batches:
                rows = latency.run(llm.llm_engine, ceil, step_batches, 128, 32)
                steps = {r.batch_size: r.step_ms_p50 for r in rows}
            warm = [[7] * n for n in base.WARM_LENS]  # compile the prefill shapes first
            llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False)
            out_len = base.OUTPUT_LEN
            wl = workloads.synthetic(num_requests, (100, 1024), (out_len, out_len), vocab)
            res, phases = phase_split(llm, ceil, wl)
            parts = []
            for kind in ("prefill", "decode"):
                t = phases.get(kind, [])
                if t:
                    rows = phases[kind + "_rows"]
                    toks = phases[kind + "_tokens"]
                    parts.append(
                        f"{kind} steps {len(t)} {sum(t):.2f} s (median "
                        f"{1e3 * sorted(t)[len(t) // 2]:.1f} ms, rows {sum(rows) / len(rows):.0f}"
                        f", tokens {sum(toks) / len(toks):.0f})"
                    )
            line = (
                f"{method:9} start-up {startup:4.1f} s; decode step ms "
                + " ".join(f"b{b} {t:.2f}" for b, t in steps.items())
                + f"; offline {num_requests} req: "
                f"{res.output_tok_s:6.0f} out tok/s ({res.elapsed_s:.2f} s, "
                f"{res.roofline_pct:.0f}% of roofline, max running {res.max_running}, "
                f"preemptions {res.num_preemptions}); " + "; ".join(parts)
            )
            print(line, flush=True)
            TABLE.append(line)
            SUMMARY[f"engine_{method}"] = {
                "out_tok_s": res.output_tok_s, "elapsed_s": res.elapsed_s, "step_ms": steps,
                "phases": {kd: sum(v) for kd, v in phases.items() if kd in ("prefill", "decode")},
            }  # fmt: skip
            if profile_requests and (profile_methods is None or method in profile_methods):
                p_out = profile_output or out_len
                wl = workloads.synthetic(profile_requests, (100, 1024), (p_out, p_out), vocab)
                llm.llm_engine.kv_manager.reset_prefix_cache()  # (the same prompts ran before)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    t1 = time.perf_counter()
                    throughput.run(llm, ceil, wl, use_tqdm=False)
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - t1
                per_kind: dict[str, float] = {}
                per_name: dict[str, float] = {}
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        kd = kernel_kind(e.name)
                        per_kind[kd] = per_kind.get(kd, 0.0) + e.device_time / 1e6
                        per_name[e.name] = per_name.get(e.name, 0.0) + e.device_time / 1e6
                busy = sum(per_kind.values())
                line = (
                    f"  profiled {profile_requests} req x {p_out} out: wall {wall:.2f} s, "
                    f"kernels {busy:.2f} s "
                    + ", ".join(f"{kd} {t:.2f} s ({100 * t / wall:.0f}%)" for kd, t in
                                sorted(per_kind.items(), key=lambda kv: -kv[1]))
                )  # fmt: skip
                print(line, flush=True)
                TABLE.append(line)
                for name, t in sorted(per_name.items(), key=lambda kv: -kv[1])[:12]:
                    print(f"    {t * 1e3:8.1f} ms [{kernel_kind(name)}] {name[:90]}")
                SUMMARY[f"profile_{method}"] = {"wall_s": wall, **per_kind}
        except Exception as e:  # noqa: BLE001
            print(f"engine {method} FAILED: {type(e).__name__}: {e}", flush=True)
        finally:
            llm = None
            gc.collect()
            torch.cuda.empty_cache()


def summarize(tuned: dict, out_dir: str) -> None:
    TABLE.append(
        "bf16 time / ours: best | best race-free (table; library), per shape qkv/o/gate_up/down:"
    )
    for m in sorted({key[3] for key in tuned}, reverse=True):
        cells = []
        for kind in ("int8", "int4", "fp8", "w8a8"):
            got = [SUMMARY.get(f"sweep_{kind}_{layer}_{m}") for layer in SHAPES]
            if not all(got):
                continue
            best = "/".join(f"{g['bf16_us'] / g['best_us']:.2f}" for g in got)
            safe = "/".join(f"{g['bf16_us'] / g['safe_us']:.2f}" for g in got)
            shipped = "/".join(f"{g['bf16_us'] / g['shipped_us']:.2f}" for g in got)
            lib = "/".join(f"{g['bf16_us'] / g['lib_us']:.2f}" for g in got)
            cells.append(f"{kind} {best} | {safe} ({shipped}; lib {lib})")
        TABLE.append(f"  M={m:4}: " + "; ".join(cells))
    TABLE.append(f"configs WRONG on the GPU: {len(SUMMARY.get('wrong', []))}")
    lines = "".join(f"    {k!r}: {v!r},\n" for k, v in tuned.items())
    print("\nTUNED_CONFIGS = {\n" + lines + "}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "mixed_mma_tuned.txt"), "w") as f:
        f.write(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="128,2048,32,256,64", help="M buckets to sweep, in order")
    ap.add_argument("--kinds", default="int8,int4,w8a8,fp8")
    ap.add_argument("--budget", type=float, default=70.0, help="seconds for the sweep")
    ap.add_argument("--race", type=int, default=20, help="repeats per config (0: skip)")
    ap.add_argument("--fp8-norm", action="store_true", help="RMSNorm+fp8 quant parity, timing")
    ap.add_argument("--engine", default="", help="methods for the engine section: bf16,int8,...")
    ap.add_argument("--requests", type=int, default=256, help="offline workload requests")
    ap.add_argument("--steps", default="8,32,128", help="decode step batches (empty: none)")
    ap.add_argument("--profile-methods", default="", help="methods to profile (empty: all)")
    ap.add_argument("--profile-output", type=int, default=128, help="profiled run's output len")
    ap.add_argument("--profile-requests", type=int, default=64, help="profiled run (0: none)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dry-run", action="store_true", help="CPU: the sweep's logic only")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.dry_run:
        dry_run_setup()
    else:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if args.race:
        race(args.race)
    if args.fp8_norm:
        fp8_norm()
    ms = [int(v) for v in args.m.split(",") if v]
    tuned = (sweep(ms, args.kinds.split(","), args.budget) or {}) if ms else {}
    summarize(tuned, args.out)
    mg.TUNED_CONFIGS.update(tuned)  # the engine runs below use this run's winners
    if args.engine:
        steps = [int(v) for v in args.steps.split(",") if v]
        profiled = args.profile_methods.split(",") if args.profile_methods else None
        engine(
            args.engine.split(","), args.requests, args.profile_requests, steps, profiled,
            args.profile_output,
        )  # fmt: skip
        base_run = SUMMARY.get("engine_bf16")
        for method in args.engine.split(",")[1:]:
            got = SUMMARY.get(f"engine_{method}")
            if base_run and got:
                ratios = " ".join(
                    f"b{b} {base_run['step_ms'][b] / t:.2f}x"
                    for b, t in got["step_ms"].items()
                    if b in base_run["step_ms"]
                )
                TABLE.append(
                    f"{method} / bf16: offline {got['out_tok_s'] / base_run['out_tok_s']:.2f}x, "
                    f"decode steps {ratios}"
                )
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s)")
    print("\n".join(TABLE))
    with open(os.path.join(args.out, "gpu_mixedmma.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
