"""Issue 13's kernel work on one GPU: parity of the new kernels, the prefill attention sweep beside
torch SDPA, the whole-model 8192-token prefill against the matmul rate, and batch-1 decode of
Qwen3-0.6B and Llama-3.1-8B with the fused decode layer and PDL launches on and off (tok/s and
kernels per step). Every section runs in try/except and the summary table comes last.

    python scripts/gpu_kernels.py --quick   # ~2 min: 8k sweep, Qwen3-0.6B and 8B decode, 8B prefill
    python scripts/gpu_kernels.py           # < 4 min: 1k-16k sweep, chunked prefill, fp32 HF parity
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import time
import traceback

import torch
import torch.nn.functional as F
from gpu_common import profiled_steps
from gpu_kernels_prefill import (
    CONFIGS,
    DEV,
    MODEL_CONFIGS,
    QUICK,
    SUMMARY,
    chunked_prefill,
    model_prefill,
    parity_prefill,
    prefill_profile,
    section,
    sweep_prefill,
)  # fmt: skip

from roofline.bench.ceilings import measure, time_fn
from roofline.kernels import pdl
from roofline.layers import fused_decode


# ---------------------------------------------------------------- parity
@section("parity: skinny GEMM norm prologue / residual epilogue / PDL")
def parity_gemv(shapes: list[tuple[int, int]], pdl_modes: tuple[bool, ...]) -> None:
    from roofline.kernels.gemv import skinny_gemm
    from roofline.kernels.rmsnorm import rms_norm

    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        for n, k in shapes:
            gen = torch.Generator(device="cuda").manual_seed(n + k)
            x = 3 * torch.randn(1, k, device=DEV, generator=gen).to(dtype)
            w = (torch.randn(n, k, device=DEV, generator=gen) / k**0.5).to(dtype)
            nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=gen)).to(dtype)
            res = torch.randn(1, n, device=DEV, generator=gen).to(dtype)
            unfused = skinny_gemm(rms_norm(x, nw, 1e-6), w)
            for pdl_on in pdl_modes:
                pdl.set_pdl(pdl_on)
                fused = skinny_gemm(x, w, norm=(nw, 1e-6))
                added = skinny_gemm(x, w, residual=res)
                plain = skinny_gemm(x, w)
                diff = (fused.float() - unfused.float()).abs().max().item()
                scale = unfused.float().abs().max().item()
                exact = torch.equal(fused, unfused)
                add_exact = torch.equal(added, plain + res)
                good = diff <= 2e-2 * scale and add_exact
                ok &= good
                print(f"  {str(dtype)[6:]:>8} N={n:>5} K={k:>5} pdl={int(pdl_on)}: norm-fused vs "
                      f"rms_norm+gemm max|d| {diff:.3g} (bit-exact {exact}), residual add "
                      f"bit-exact {add_exact}")  # fmt: skip
    pdl.set_pdl(False)
    SUMMARY.append((f"skinny GEMM fused parity, pdl {pdl_modes}", "ok" if ok else "MISMATCH"))


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of ``fn`` replayed ``reps`` times back to back in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return time_fn(g.replay, DEV, iters=10) / reps * 1e6


def _shape_us(n: int, k: int, kind: str) -> tuple[float, float, float]:
    """(plain, unfused, fused) us per call; 8 weights in rotation, so each call reads HBM."""
    from roofline.kernels.gemv import skinny_gemm
    from roofline.kernels.rmsnorm import fused_add_rms_norm

    dt = torch.bfloat16
    ws = [torch.randn(n, k, device=DEV, dtype=dt) / k**0.5 for _ in range(8)]
    x = torch.randn(1, k, device=DEV, dtype=dt)
    nw = torch.ones(k, device=DEV, dtype=dt)
    res = torch.randn(1, n, device=DEV, dtype=dt)
    it = itertools.cycle(ws)  # advanced at capture: the graph's calls rotate over the weights
    if kind == "norm":
        unfused = graph_us(lambda: skinny_gemm(fused_add_rms_norm(x, x, nw, 1e-6)[0], next(it)))
        fused = graph_us(lambda: skinny_gemm(x, next(it), norm=(nw, 1e-6)))
    else:
        unfused = graph_us(lambda: skinny_gemm(x, next(it)) + res)
        fused = graph_us(lambda: skinny_gemm(x, next(it), residual=res))
    return graph_us(lambda: skinny_gemm(x, next(it))), unfused, fused


@section("skinny GEMM micro-timings in CUDA graphs (us per call, bf16, M = 1)")
def gemv_timings(pdl_modes: tuple[bool, ...]) -> None:
    from roofline.kernels.gemv import TUNED_CONFIGS, skinny_gemm

    dt = torch.bfloat16
    # (N, K, kind): qkv / gate_up read a normed input, o / down produce a residual add
    shapes = [(4096, 1024, "norm"), (6144, 1024, "norm"), (1024, 2048, "add"),
              (1024, 3072, "add"), (6144, 4096, "norm"), (28672, 4096, "norm"),
              (4096, 4096, "add"), (4096, 14336, "add")]  # fmt: skip
    for pdl_on in pdl_modes:
        pdl.set_pdl(pdl_on)
        for n, k, kind in shapes:
            plain, unfused, fused = _shape_us(n, k, kind)
            tuned = (n, k, 1) in TUNED_CONFIGS
            other = "rmsnorm" if kind == "norm" else "add"
            print(f"  pdl={int(pdl_on)} N={n:>5} K={k:>5} {kind:>4}: plain {plain:6.2f}, unfused "
                  f"(+{other}) {unfused:6.2f}, fused {fused:6.2f} us "
                  f"({n * k * 2 / plain / 1e3:.0f} GB/s plain; tuned {tuned})")  # fmt: skip
    pdl.set_pdl(False)
    if True in pdl_modes:
        return
    # Qwen3-0.6B's LM head (no tuned config: cuBLAS today) against the skinny GEMM
    n, k = 151936, 1024
    w = torch.randn(n, k, device=DEV, dtype=dt) / k**0.5
    x = torch.randn(1, k, device=DEV, dtype=dt)
    row = [f"cuBLAS {graph_us(lambda: F.linear(x, w), reps=5):.1f}"]
    for bn, bk, nw_, st, dot in [(32, 512, 4, 5, False), (64, 256, 4, 4, True),
                                 (32, 256, 4, 4, True), (16, 512, 4, 4, False)]:  # fmt: skip
        t = graph_us(lambda c=(bn, bk, nw_, st, dot): skinny_gemm(
            x, w, block_n=c[0], block_k=c[1], num_warps=c[2], num_stages=c[3], use_dot=c[4]),
            reps=5)  # fmt: skip
        row.append(f"{bn}/{bk}/{nw_}/{st}/{'dot' if dot else 'fma'} {t:.1f}")
    print(f"  LM head 151936 x 1024, us ({n * k * 2 / 1e6:.0f} MB): " + " | ".join(row))


# ---------------------------------------------------------------- engine measurements
def load(model: str, **kw):
    from roofline import LLM

    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", device="cuda", **kw)
    torch.cuda.synchronize()
    return llm, time.perf_counter() - t0


def kernels_per_step(engine, steps: int = 10, top_n: int = 8) -> tuple[float, float, list[str]]:
    """(kernels per step, kernel-busy ms per step, top kernels) of decode steps, torch.profiler."""
    prof = profiled_steps(engine, 3, steps)
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name].append(e.device_time)
    count = sum(len(v) for v in per_name.values()) / steps
    busy = sum(sum(v) for v in per_name.values()) / steps / 1e3
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top_n]
    lines = [f"{sum(t) / steps:8.1f} us/step {len(t) / steps:5.0f}x {sum(t) / len(t):6.1f} us  "
             f"{n[:90]}" for n, t in top]  # fmt: skip
    return count, busy, lines


def _step_logprobs(lp: dict) -> list[tuple[int, float]]:
    """A step's {token: Logprob} as sorted (token, logprob) pairs."""
    return sorted((int(t), float(getattr(v, "logprob", v))) for t, v in lp.items())


MODES = {  # name -> (fused decode layer, PDL launches)
    "baseline": (False, False),
    "fused": (True, False),
    "fused+pdl": (True, True),
}


def set_mode(engine, mode: str) -> None:
    fused, pdl_on = MODES[mode]
    fused_decode.set_enabled(fused)
    pdl.set_pdl(pdl_on)
    engine.runner.capture_cuda_graphs()  # the graphs hold the kernels of the mode


def load_8b():
    return load("llama-3.1-8b", max_model_len=8448, max_num_seqs=8, max_num_batched_tokens=8192,
                gpu_memory_utilization=0.6)  # fmt: skip


@section("batch-1 decode: fused decode layer and PDL on/off")
def decode(model: str, ceil, out_len: int, modes: list[str], loaded=None):
    from roofline import SamplingParams
    from roofline.bench import latency

    if loaded is None:
        loaded = load(model, max_model_len=2048, max_num_seqs=8, gpu_memory_utilization=0.6)
    llm, t_load = loaded
    engine = llm.llm_engine
    print(f"  {model}: start-up {t_load:.1f} s (dummy weights, graphs captured)")
    for mode in modes:
        try:
            set_mode(engine, mode)
            rows = latency.run(engine, ceil, [1], 128, out_len)
            r = rows[0]
            engine.add_request(f"prof-{mode}", list(range(10, 138)),
                               SamplingParams(max_tokens=40, temperature=0.0,
                                              ignore_eos=True))  # fmt: skip
            engine.step()  # prefill
            count, busy, top = kernels_per_step(engine, top_n=30 if "qwen3" in model else 10)
            while engine.has_unfinished_requests():
                engine.step()
            print(f"  {model} {mode:>10}: {r.step_ms_p50:.3f} ms/step p50, "
                  f"{r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}% of roofline "
                  f"({r.roofline_step_ms:.3f} ms), {count:.0f} kernels/step, "
                  f"{busy:.3f} ms kernel-busy/step")  # fmt: skip
            for line in top:
                print("      " + line)
            SUMMARY.append((f"{model} bs1 {mode}", f"{r.output_tok_s:.1f} tok/s, "
                            f"{count:.0f} kernels/step"))  # fmt: skip
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            SUMMARY.append((f"{model} bs1 {mode}", "FAILED"))
    # greedy tokens (and their logprobs, bit for bit) of the modes against each other, each
    # from an empty prefix cache so every mode runs the same prefill
    try:
        outs = {}
        params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=1, ignore_eos=True)
        for mode in dict.fromkeys(["baseline", "fused", *modes]):
            set_mode(engine, mode)
            engine.kv_manager.reset_prefix_cache()
            res = llm.generate([list(range(20, 84))], params, use_tqdm=False)[0].outputs[0]
            outs[mode] = (res.token_ids, [_step_logprobs(lp) for lp in res.logprobs or []])
        for mode in outs:
            ref = "fused" if mode == "fused+pdl" else "baseline"
            same_tokens = outs[mode][0] == outs[ref][0]
            same_lps = outs[mode][1] == outs[ref][1]
            print(f"  {model} {mode} vs {ref}: greedy 32 tokens equal {same_tokens}, "
                  f"logprobs bit-equal {same_lps}")  # fmt: skip
            if mode == "fused+pdl":
                SUMMARY.append((f"{model} PDL vs no PDL logprobs", "bit-equal" if same_lps else
                                "DIFFERENT"))  # fmt: skip
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    fused_decode.set_enabled(True)
    pdl.set_pdl(False)
    engine.runner.capture_cuda_graphs()


@section("parity tests on the GPU (pytest)")
def gpu_tests(files: list[str]) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *files], capture_output=True, text=True, timeout=150)  # fmt: skip
    print("\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:]))
    SUMMARY.append(("pytest " + " ".join(f.rsplit("/", 1)[-1] for f in files),
                    "passed" if proc.returncode == 0 else f"rc {proc.returncode}"))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    t_start = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    bw, mm = ceil.bandwidth_bytes_per_s / 1e12, ceil.matmul_flops_per_s / 1e12
    print(f"{torch.cuda.get_device_name()}: copy {bw:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s, "
          f"torch {torch.__version__}")  # fmt: skip
    SUMMARY.append(("matmul ceiling", f"{ceil.matmul_flops_per_s / 1e12:.0f} TF/s"))
    quick = args.quick
    shapes = [(4096, 1024), (6144, 4096)]
    shapes = shapes if quick else [*shapes, (1000, 4100)]
    parity_gemv(shapes, (False,))
    gemv_timings((False,))
    parity_prefill([] if quick else QUICK)
    sweep_prefill([8192] if quick else [1024, 4096, 8192, 16384], QUICK if quick else CONFIGS)
    if not quick:
        chunked_prefill(QUICK)
    out_len = 128 if quick else 256
    decode("qwen3-0.6b", ceil, out_len, ["baseline", "fused"])
    gc.collect()
    torch.cuda.empty_cache()
    loaded = None
    try:
        loaded = load_8b()
        print(f"llama-3.1-8b start-up {loaded[1]:.1f} s (dummy weights, graphs captured)")
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if loaded is not None:
        decode("llama-3.1-8b", ceil, out_len, ["baseline", "fused"], loaded)
        model_prefill(ceil, MODEL_CONFIGS, loaded[0])
        prefill_profile(loaded[0])
        # PDL last: a launch problem there cannot cost the figures above
        parity_gemv(shapes, (True,))
        decode("llama-3.1-8b", ceil, out_len, ["fused+pdl"], loaded)
        del loaded
    gc.collect()
    torch.cuda.empty_cache()
    decode("qwen3-0.6b", ceil, out_len, ["fused+pdl"])
    gc.collect()
    torch.cuda.empty_cache()
    if not quick:
        gpu_tests(["tests/e2e/test_gpu_parity.py"])  # fp32 greedy = HF, the default variants
    print(f"\n=== summary ({time.perf_counter() - t_start:.0f} s)")
    for name, value in SUMMARY:
        print(f"  {name:<48} {value}")


if __name__ == "__main__":
    main()
