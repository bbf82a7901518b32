"""Skinny GEMM (roofline/kernels/gemv.py) vs cuBLAS (``torch.nn.functional.linear``) on the decode
linears of Llama-3.1-8B and Qwen3-0.6B at M = 1, 2, 4, 8, bf16, with a small config sweep.

Every figure is the time of one call inside a CUDA graph of back-to-back calls (launch gaps are
the graph's, as in CUDA-graph decode). The calls cycle through a ring of distinct weight copies
of at least 256 MiB in all, so no call finds its weight in the 50 MB L2 (the small Qwen weights
would otherwise be timed from cache). Prints, per shape and M: cuBLAS and best skinny time, the
achieved weight-read bandwidth of both (and as a share of a measured read ceiling), the best
config and the max-abs difference from cuBLAS; then the tuned table for gemv.TUNED_CONFIGS
(per M) and, last, the best single config per (N, K) over all M. A config that fails to compile
or launch is skipped with a note. CUDA only.

    python3 scripts/gemv_bench.py [--shapes qwen] [--m 1 8] [--full]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
import torch.nn.functional as F
import triton

from roofline.kernels import gemv
from roofline.kernels.gemv import SkinnyConfig, heuristic_config, skinny_gemm, skinny_gemm_ref

SHAPES: dict[str, tuple[int, int]] = {  # name: (N, K) of weight [N, K]
    "llama8b.qkv": (6144, 4096),
    "llama8b.o": (4096, 4096),
    "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336),
    "llama8b.lm_head": (128256, 4096),
    "qwen3-0.6b.qkv": (4096, 1024),
    "qwen3-0.6b.o": (1024, 2048),
    "qwen3-0.6b.gate_up": (6144, 1024),
    "qwen3-0.6b.down": (1024, 3072),
    "qwen3-0.6b.lm_head": (151936, 1024),
    "qwen3-30b-a3b.qkv": (5120, 2048),
    "qwen3-30b-a3b.o": (2048, 4096),
    "qwen3-30b-a3b.router": (128, 2048),
    "qwen3-30b-a3b.lm_head": (151936, 2048),
}
DTYPE = torch.bfloat16


def time_graph(calls: list[Callable[[], object]], iters: int) -> float:
    """Median seconds per call over ``iters`` replays of one CUDA graph of ``calls``."""
    for call in calls:  # eager first: compiles, cuBLAS handles, and launch errors outside capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    del graph
    return ms / 1e3 / len(calls)


def read_ceiling_bytes_per_s() -> float:
    """HBM read rate of a 1 GiB row-sum (a pure streaming read, like a GEMV's weight read)."""
    x = torch.empty(2**29, dtype=DTYPE, device="cuda").normal_()
    rows = x.view(2**13, -1)
    partial_sums = torch.empty(2**13, dtype=torch.float32, device="cuda")
    row_sums = partial(torch.sum, rows, dim=1, dtype=torch.float32, out=partial_sums)
    sec = time_graph([row_sums] * 4, 10)
    return x.numel() * x.element_size() / sec


def candidates(n: int, k: int, m: int, sms: int, full: bool) -> list[SkinnyConfig]:
    """The heuristic's config plus block_n at half, same and double, two block_k, two pipeline
    depths; CUDA-core FMAs only at M = 1 (all M with --full) and only where the unreduced fp32
    tile fits in registers; no tile past 64 KiB, no pipeline past 200 KiB of shared memory."""
    base = heuristic_config(n, k, sms)
    block_ns = {max(1, base.block_n // 2), base.block_n, min(128, base.block_n * 2)}
    block_ks = (128, 256, 512) if full else (256, 512)
    stages = (2, 3, 4, 5, 6) if full else (3, 5)
    modes = (True, False) if (m == 1 or full) else (True,)
    block_m = gemv.m_bucket(m)
    out = {base}
    for bn in sorted(block_ns):
        for bk in block_ks:
            if bk > max(64, triton.next_power_of_2(k)) or bn * bk * 2 > 64 << 10:
                continue
            warps = (2, 4, 8) if full else ((4, 8) if bn * bk >= 16384 else (4,))
            for s in stages:
                if (s - 1) * (bn + block_m) * bk * 2 > 200 << 10:
                    continue
                for w in warps:
                    for dot in modes:
                        if dot or bn * bk <= 64 * 32 * w:  # FMA: <= 64 fp32 partials a thread
                            out.add(SkinnyConfig(bn, bk, w, s, dot))
    return sorted(out)


def precompile(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfgs: list[SkinnyConfig]):
    """Compile every config on a thread pool (ptxas runs in parallel); errors surface later."""
    if not hasattr(triton, "AsyncCompileMode"):  # Triton < 3.4: compiled serially when timed
        return
    with (
        ThreadPoolExecutor(os.cpu_count() or 4) as pool,
        triton.AsyncCompileMode(pool, ignore_errors=True),
    ):
        for cfg in cfgs:
            launch = gemv._prepare(x, w, None, out, cfg._asdict())
            try:
                gemv._skinny_gemm_kernel.warmup(*launch.args, grid=launch.grid, **launch.meta)
            except Exception:  # reported when the config is timed
                pass


def fmt_cfg(cfg: SkinnyConfig) -> str:
    return f"({cfg.block_n}, {cfg.block_k}, {cfg.num_warps}, {cfg.num_stages}, {cfg.use_dot})"


def sweep_m(
    name: str, ring: list[torch.Tensor], m: int, num_calls: int, args, sms: int, ceiling: float
) -> dict[SkinnyConfig, float]:
    """Times cuBLAS and every candidate at one M; prints the row; returns seconds per config."""
    n, k = ring[0].shape
    x = torch.randn(m, k, device=ring[0].device, dtype=DTYPE)
    out = torch.empty(m, n, device=x.device, dtype=DTYPE)
    weights = [ring[i % len(ring)] for i in range(num_calls)]
    cfgs = candidates(n, k, m, sms, args.full)
    precompile(x, ring[0], out, cfgs)
    t_cublas = time_graph([partial(F.linear, x, w) for w in weights], args.iters)
    times: dict[SkinnyConfig, float] = {}
    for cfg in cfgs:
        calls = [partial(skinny_gemm, x, w, None, out, **cfg._asdict()) for w in weights]
        try:
            times[cfg] = time_graph(calls, args.iters)
        except Exception as e:  # noqa: BLE001 - any compile/launch failure skips the config
            msg = str(e).strip().splitlines()[0][:100] if str(e).strip() else ""
            print(f"  skip {name} M={m} {fmt_cfg(cfg)}: {type(e).__name__} {msg}")
            torch.cuda.synchronize()
    if not times:
        print(f"{name:<19} M={m}: no config ran")
        return times
    ranked = sorted(times.items(), key=lambda kv: kv[1])
    best, t_best = ranked[0]
    t_heur = times.get(heuristic_config(n, k, sms), float("nan"))
    got = skinny_gemm(x, ring[0], None, **best._asdict())
    d_cublas = (got.float() - F.linear(x, ring[0]).float()).abs().max().item()
    d_ref = (got.float() - skinny_gemm_ref(x, ring[0]).float()).abs().max().item()
    nbytes = (n * k + m * k + m * n) * DTYPE.itemsize
    print(
        f"{name:<19} {f'{n}x{k}':>12} {m:>2} | {t_cublas * 1e6:9.2f} "
        f"{nbytes / t_cublas / 1e12:5.2f} | {t_best * 1e6:9.2f} "
        f"{nbytes / t_best / 1e12:5.2f} {100 * nbytes / t_best / ceiling:5.1f} "
        f"{t_cublas / t_best:6.2f}x | {t_heur * 1e6:7.2f} | {fmt_cfg(best)} | "
        f"{d_cublas:.2e}, {d_ref:.2e}",
        flush=True,
    )
    if args.top > 1:
        runners = ", ".join(f"{fmt_cfg(c)} {t * 1e6:.2f}" for c, t in ranked[1 : args.top])
        print(f"{'':<19} {'':>12}    next: {runners}")
    return times


def one_config_for_all_m(times: dict[int, dict[SkinnyConfig, float]]) -> SkinnyConfig | None:
    """The tensor-core config timed at every M with the least summed time relative to each
    M's best."""
    measured = [t for t in times.values() if t]
    if not measured:
        return None
    common = {c for c in set.intersection(*(set(t) for t in measured)) if c.use_dot}
    if not common:
        return None
    return min(common, key=lambda c: sum(t[c] / min(t.values()) for t in measured))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=None, help="substrings of shape names")
    ap.add_argument("--m", nargs="*", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA graph (at least)")
    ap.add_argument("--iters", type=int, default=10, help="timed graph replays (median)")
    ap.add_argument("--ring-mib", type=int, default=256, help="weight copies, MiB in all")
    ap.add_argument("--full", action="store_true", help="a wider sweep (several minutes)")
    ap.add_argument("--top", type=int, default=3, help="runner-up configs printed per row")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "the skinny GEMM benchmark needs a CUDA GPU"
    t_start = time.perf_counter()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ceiling = read_ceiling_bytes_per_s()
    print(
        f"{torch.cuda.get_device_name(dev)}, {sms} SMs, triton {triton.__version__}, torch "
        f"{torch.__version__}; HBM read ceiling (1 GiB row sums) {ceiling / 1e12:.2f} TB/s",
        flush=True,
    )
    print(
        f"{'shape':<19} {'N x K':>12} {'M':>2} | {'cuBLAS us':>9} {'TB/s':>5} | {'skinny us':>9} "
        f"{'TB/s':>5} {'%ceil':>5} {'speedup':>7} | {'heur us':>7} | best (bn, bk, warps, stages, "
        f"dot) | max|d| vs cuBLAS, vs fp32 ref"
    )
    tuned: dict[tuple[int, int, int], SkinnyConfig] = {}
    per_nk: dict[tuple[int, int], tuple[int, int, int, int]] = {}
    for name, (n, k) in SHAPES.items():
        if args.shapes and not any(s in name for s in args.shapes):
            continue
        copies = max(1, math.ceil((args.ring_mib << 20) / (n * k * DTYPE.itemsize)))
        ring = [torch.randn(n, k, device=dev, dtype=DTYPE) / k**0.5 for _ in range(copies)]
        num_calls = max(args.calls, copies)  # every copy once per replay
        times = {m: sweep_m(name, ring, m, num_calls, args, sms, ceiling) for m in args.m}
        for m, t in times.items():
            if t:
                tuned[(n, k, gemv.m_bucket(m))] = min(t, key=t.__getitem__)
        pick = one_config_for_all_m(times)
        if pick is not None:
            per_nk[(n, k)] = (pick.block_n, pick.block_k, pick.num_warps, pick.num_stages)
        del ring
        torch.cuda.empty_cache()

    print("\n# gemv.TUNED_CONFIGS, (N, K, m_bucket): (block_n, block_k, num_warps, num_stages, "
          "use_dot)")  # fmt: skip
    print("TUNED_CONFIGS = {" + ", ".join(f"{key}: {fmt_cfg(c)}" for key, c in tuned.items()) + "}")
    print(f"# done in {time.perf_counter() - t_start:.0f} s; best single config per (N, K) over "
          "all M, tensor cores: (block_n, block_k, num_warps, num_stages)")  # fmt: skip
    print(repr(per_nk))


if __name__ == "__main__":
    main()
