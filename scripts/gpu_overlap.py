"""Can the large-M quantized path's weight dequantization hide under the GEMMs? The 8,192-row
prefill runs each quantized linear as dequantize (memory-bound) then cuBLAS (compute-bound);
here four layers' qkv / o / gate_up / down (Llama-3.1-8B, int8 per channel) run

* serial: dequantize, then the GEMM, as the engine does today;
* pipelined: the next linear's dequantization on a side stream into the other of two buffers
  while the current GEMM runs (events order the buffer reuse);
* pipelined with an SM carve-out for cuBLAS (``torch._C._set_sm_carveout_experimental``), so
  the side stream's dequantization has multiprocessors of its own;

and prints the chain's time (CUDA events, median of 7) beside the GEMMs alone and the
dequantizations alone.

    python scripts/gpu_overlap.py [--rows 8192] [--layers 4]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from roofline.kernels.dequant_gemm import dequantize_weight
from roofline.quantization import formats

BF16 = torch.bfloat16
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def timed(fn, reps: int = 7) -> float:
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--carveouts", default="0,8,16,24,32")
    args = ap.parse_args()
    m = args.rows
    xs = {k: torch.randn(m, k, device="cuda", dtype=BF16) for k in (4096, 14336)}
    items = []
    for _ in range(args.layers):
        for n, k in SHAPES:
            q = formats.quantize_int8(torch.randn(n, k, device="cuda") * 0.02, k, BF16)
            items.append((q.qweight, q.scales, n, k))
    w16 = [torch.randn(n, k, device="cuda", dtype=BF16) * 0.02 for _, _, n, k in items]
    biggest = max(n * k for _, _, n, k in items)
    bufs = [torch.empty(biggest, device="cuda", dtype=BF16) for _ in range(2)]
    side = torch.cuda.Stream()

    def deq(i, buf=None):
        qw, s, n, k = items[i]
        out = None if buf is None else buf[: n * k].view(n, k)
        return dequantize_weight("int8", qw, s, None, BF16, out=out)

    def gemms():
        for w in w16:
            F.linear(xs[w.shape[1]], w)

    def deqs():
        for i in range(len(items)):
            deq(i, bufs[i % 2])

    def serial():
        for i, (_, _, _, k) in enumerate(items):
            F.linear(xs[k], deq(i, bufs[0]))

    def pipelined():
        main = torch.cuda.current_stream()
        ready = [torch.cuda.Event() for _ in items]
        done = [torch.cuda.Event() for _ in items]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            deq(0, bufs[0])
            ready[0].record()
        for i, (_, _, n, k) in enumerate(items):
            if i + 1 < len(items):
                with torch.cuda.stream(side):
                    if i >= 1:
                        side.wait_event(done[i - 1])  # buffer (i + 1) % 2 was GEMM i - 1's
                    deq(i + 1, bufs[(i + 1) % 2])
                    ready[i + 1].record()
            main.wait_event(ready[i])
            F.linear(xs[k], bufs[i % 2][: n * k].view(n, k))
            done[i].record()
        main.wait_stream(side)

    ref = None
    for name, fn in [("gemms alone (bf16 weights)", gemms), ("dequantizations alone", deqs),
                     ("serial: dequantize then GEMM", serial)]:  # fmt: skip
        fn()
        print(f"{name:48} {timed(fn):8.3f} ms", flush=True)
    for co in (int(c) for c in args.carveouts.split(",")):
        try:
            torch._C._set_sm_carveout_experimental(co if co else None)
        except Exception as e:  # noqa: BLE001
            print(f"carve-out {co}: not available ({type(e).__name__}: {e})")
            if co:
                continue
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            pipelined()
            t = timed(pipelined)
            ts = timed(serial)
            tg = timed(gemms)
            print(
                f"carve-out {co:2d} {lib:8}: pipelined {t:8.3f} ms, serial {ts:8.3f}, gemms "
                f"alone {tg:8.3f}",
                flush=True,
            )
        torch.backends.cuda.preferred_blas_library("cublas")
    torch._C._set_sm_carveout_experimental(None)
    # correctness of the pipelined chain's last output against the serial one
    qw, s, n, k = items[-1]
    want = F.linear(xs[k], deq(len(items) - 1))
    got = F.linear(xs[k], bufs[(len(items) - 1) % 2][: n * k].view(n, k))
    ref = (got.float() - want.float()).abs().max().item()
    print(f"pipelined last output vs serial: max|diff| {ref:.1e}")


def silu_pair(rows: list[int]) -> None:
    """gate_up then silu_and_mul (cuBLAS) against the GEMM with the SiLU-and-mul in its
    epilogue (``kernels/dense_gemm_silu.py``), per row count, CUDA-graph timed (gpu_short's)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_short as gs

    from roofline.kernels.activation import silu_and_mul
    from roofline.kernels.dense_gemm_silu import dense_gemm_silu

    ws = gs.weights("gate_up")
    for m in rows:
        x = torch.randn(m, 4096, device="cuda", dtype=BF16)
        pair = gs.graph_us(lambda w: silu_and_mul(F.linear(x, w)), ws)  # noqa: B023
        gemm = gs.graph_us(lambda w: F.linear(x, w), ws)  # noqa: B023
        fused = {}
        for cfg in gs.SILU_CONFIGS:
            try:
                fused[tuple(cfg)] = gs.graph_us(lambda w, c=cfg: dense_gemm_silu(x, w, c), ws)  # noqa: B023
            except Exception as e:  # noqa: BLE001
                print(f"  silu {m} {tuple(cfg)}: {type(e).__name__}: {str(e)[:100]}")
        best = min(fused, key=fused.get) if fused else None
        print(
            f"gate_up M={m:5d}: cuBLAS {gemm:8.1f} us, + silu_and_mul {pair:8.1f}, fused best "
            f"{fused.get(best, float('nan')):8.1f} {best}",
            flush=True,
        )


if __name__ == "__main__":
    main()
    silu_pair([256, 512, 2048, 8192])
