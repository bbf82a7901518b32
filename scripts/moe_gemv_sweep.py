"""Config sweep of the fused MoE decode GEMV (``kernels/fused_moe._moe_gemv_kernel``) at 1 and 2
tokens: the gate/up launch and the down launch timed separately inside CUDA graphs, each call on
fresh random expert ids over a weight stack larger than L2. Prints, per model shape and launch,
the best configs with their time and weight-read bandwidth. CUDA only.

    python scripts/moe_gemv_sweep.py [--models qwen3-30b-a3b mixtral-8x7b]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics

import torch
import triton

from roofline.kernels import fused_moe as fm

SHAPES = {  # name: (experts, hidden, intermediate, top_k)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
CONFIGS = [
    dict(BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=st, num_warps=w)
    for bn, bk, st, w in itertools.product((4, 8, 16), (128, 256, 512), (2, 3, 4), (2, 4))
]


def time_graph(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(8):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / 8)
    return statistics.median(times)


def launch(a, w, dst, ids, weights, rows, n, k, pairs_per_program, a_per_pair, silu, cfg):
    """One 16-bit expert GEMV launch (no scales, no residual, no PDL: the launch alone)."""
    fm._moe_gemv_kernel[(rows, triton.cdiv(n, cfg["BLOCK_N"]))](
        a, w, w, w, dst, ids, weights, dst, n, k, w.shape[0], a.stride(0), w.stride(0),
        w.stride(1), 0, 1, dst.stride(0), dst.stride(0),
        PAIRS_PER_PROGRAM=pairs_per_program, A_PER_PAIR=a_per_pair, SILU_MUL=silu,
        MUL_WEIGHT=not silu, QUANT=0, GROUP=0, WIDEN=0, RESIDUAL=False, PDL=False,
        PREFETCH_LINES=1, LINE_BYTES=128, FAST_FP8=True, LATE_TRIGGER=False, **cfg,
    )  # fmt: skip


def sweep(name: str, t: int, gen: torch.Generator) -> None:
    e, h, i, k = SHAPES[name]
    dev = torch.device("cuda")
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen)
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)]).contiguous()
    weights = torch.full((t, k), 1.0 / k, device=dev, dtype=torch.bfloat16)
    act = torch.empty(t * k, i, dtype=x.dtype, device=dev)
    out = torch.empty_like(x)
    cases = {
        "gate/up": ((x, w13, act, ids, weights, t * k, i, h, 1, k, True), t * k * 2 * i * h * 2),
        "down": ((act, w2, out, ids, weights, t, h, i, k, 1, False), t * k * h * i * 2),
    }
    for label, (fixed, nbytes) in cases.items():
        got = []
        for cfg in CONFIGS:
            try:
                us = time_graph(functools.partial(launch, *fixed, cfg))
            except Exception as err:  # noqa: BLE001 - a config that fails is skipped
                print(f"  {name} T={t} {label} {cfg}: {type(err).__name__}")
                continue
            got.append((us, nbytes / us / 1e3, cfg))
        got.sort(key=lambda r: r[0])
        base = next((r for r in got if r[2] == fm.GEMV_CONFIG), None)
        shipped = f"{base[0]:.1f} us ({base[1]:.0f} GB/s)" if base else "failed"
        print(f"{name} T={t} {label}: shipped {shipped}")
        for us, gbs, cfg in got[:4]:
            print(f"    {us:7.1f} us {gbs:6.0f} GB/s  {cfg}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=list(SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 2])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.models:
        for t in args.tokens:
            sweep(name, t, gen)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
