"""The 256-row qkv GEMM (Llama-3.1-8B, N 6144, K 4096; ``--n`` / ``--k`` another) for Nsight
Compute: bf16 cuBLAS, then the weight-only kernel of each ``--kinds`` in each ``--configs`` form
(by default int8, dealt warp-specialized and stream-K), each run once
between ``cudaProfilerStart`` / ``Stop`` after warm-up, so that

    ncu --clock-control none --profile-from-start off --set full python scripts/gpu_ncu_wo.py

profiles exactly those launches (stall reasons, pipe use, L2 / DRAM traffic). Without ncu it
prints each launch's time (CUDA events, median of 50).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_mixedgemm as base  # noqa: E402

from roofline.kernels import wo_gemm as wg  # noqa: E402
from roofline.quantization import formats  # noqa: E402


def timed(fn, reps: int = 50) -> float:
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(1e3 * a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--n", type=int, default=6144)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument(
        "--configs", default="128,128,128,1,4,8,1;128,128,128,1,4,8,2;256,128,64,1,4,8,2"
    )
    ap.add_argument("--kinds", default="int8", help="int8, int4 (asymmetric), int4s, fp8")
    args = ap.parse_args()
    m, n, k = args.m, args.n, args.k
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    runs = [("cublas bf16", lambda: F.linear(x, w16), None)]
    for kind in args.kinds.split(","):
        if kind == "int4s":  # symmetric int4 g128: offsets -8 s, passed as none
            qw, s, _ = formats.quantize_int4(w16.float(), 128, True, torch.bfloat16)
            o = None
        else:
            qw, s, o = base.quantized(kind, n, k)
        ref = base.exact_ref("int4" if kind == "int4s" else kind, x, qw, s,
                             o if o is not None else -8.0 * s.float())  # fmt: skip
        for c in args.configs.split(";"):
            cfg = wg.WoConfig(*(int(v) for v in c.split(",")))
            fn = (
                lambda cfg=cfg, kind=kind, qw=qw, s=s, o=o: wg.wo_gemm(  # noqa: E731
                    kind[:4], x, qw, s, o, None, cfg
                )
            )
            runs.append((f"{kind} {tuple(cfg)}", fn, ref))
    for name, fn, ref in runs[1:]:
        err = base.rel_err(fn(), ref)
        print(f"{name}: max rel err {err:.1e}", flush=True)
    for name, fn, _ in runs:
        print(f"{name}: {timed(fn):.1f} us (warm, weights in L2 where they fit)", flush=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _, fn, _ in runs:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
