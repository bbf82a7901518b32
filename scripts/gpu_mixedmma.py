"""Wide weight tiles for the mixed-input GEMM at decode batches (M = 32..256) on one GPU (H100,
Llama-3.1-8B shapes, random weights), and where an offline step's time goes.

Why: at 128 rows the shipped configs (64 weight rows per program) re-read all of x once per 64
weight rows: qkv at M = 128 moves 96 MiB of x from L2 for 24 MiB of int8 weight (gate_up 448
MiB of x for 112 MiB), so the kernel runs at the L2 bandwidth, not the tensor cores or HBM.
256-row weight tiles (8 or 16 warps) cut that 4x; uneven split-K fills the SMs again.

``sweep``: per M (128, 256, 64, 32), method (int8 per channel, int4 g128, fp8 weight-only,
W8A8) and shape (qkv / o / gate_up / down): every candidate tile x split-K, each checked against
x times the exactly dequantized weight ON THE GPU before it is timed (a wrong config is printed
and never picked), beside bf16 cuBLAS, the shipped pick and the library GEMM; prints the winners
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
SUMMARY: dict[str, object] = {}
TABLE: list[str] = []

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) families per M bucket
FAMILIES = {
    256: [
        (128, 256, 64, 8, 3), (64, 256, 64, 8, 4), (128, 256, 64, 16, 3), (64, 256, 64, 16, 4),
        (64, 256, 128, 8, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 128, 4, 3),
        (128, 64, 128, 4, 3), (256, 256, 64, 16, 3),
    ],
    128: [
        (128, 256, 64, 8, 3), (64, 256, 64, 8, 4), (128, 256, 64, 16, 3), (64, 256, 64, 16, 4),
        (64, 256, 128, 8, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 128, 4, 3),
        (128, 64, 128, 4, 3),
    ],
    64: [
        (64, 256, 64, 8, 4), (64, 256, 64, 16, 4), (64, 256, 128, 8, 3), (64, 128, 128, 4, 3),
        (64, 128, 64, 4, 4), (64, 64, 128, 4, 3),
    ],
    32: [
        (32, 256, 64, 8, 4), (32, 256, 128, 8, 3), (32, 128, 128, 4, 4), (32, 128, 64, 4, 4),
        (32, 64, 128, 4, 4),
    ],
}  # fmt: skip


def splits(m: int, n: int, k: int, bm: int, bn: int, bk: int) -> list[int]:
    """Split-K counts that bring the programs to about one or two per SM."""
    tiles = math.ceil(m / bm) * math.ceil(n / bn)
    out = {1, round(SMS / tiles), round(2 * SMS / tiles)}
    return sorted(s for s in out if 1 <= s <= min(16, k // bk))


def candidates(kind: str, m: int, n: int, k: int) -> list[MixedGemmConfig]:
    out = []
    w_bytes = {"int4": 0.5}.get(kind, 1)
    x_bytes = 1 if kind == "w8a8" else 2
    for bm, bn, bk, warps, stages in FAMILIES[m]:
        if kind == "w8a8" and bk < 64:
            continue
        if stages * bk * (bm * x_bytes + bn * w_bytes) > SMEM_LIMIT:
            continue
        for sk in splits(m, n, k, bm, bn, bk):
            out.append(MixedGemmConfig(bm, bn, bk, 8, sk, warps, stages))
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
            x0 = torch.randn(17, k0, device="cuda", dtype=torch.bfloat16)
            fams = {c._replace(split_k=1) for c in candidates(kind, m, n0, k0)}
            fams |= {c._replace(split_k=2) for c in fams}  # SPLIT / FIXUP constexprs
            base.precompile([partial(base.ours(kind, c, True), x0, *w0) for c in fams])
            for layer, (n, k) in SHAPES.items():
                ring = base.make_ring(wkind, n, k, False)
                x = torch.randn(m - 3, k, device="cuda", dtype=torch.bfloat16)  # partial block
                qw, s, o = ring[0]
                ref = ref_for(kind, x, qw, s, o)
                res = []
                for c in candidates(kind, m, n, k):
                    try:
                        err = base.rel_err(base.ours(kind, c)(x, qw, s, o), ref)
                        if not err < 2e-2:
                            wrong.append(f"{kind} {layer} M={m - 3} {tuple(c)}: {err:.2e}")
                            print(f"  WRONG {wrong[-1]}", flush=True)
                            continue
                        res.append((base.time_ring(partial(base.ours(kind, c), x), ring, False), c))
                    except Exception as e:  # noqa: BLE001
                        print(f"  {kind} {layer} M={m} {tuple(c)}: {type(e).__name__}: {e}")
                t_lib = base.time_ring(partial(base.lib_gemm(kind), x), ring, False)
                w16 = [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16),) for _ in range(4)]
                t16 = base.time_ring(partial(F.linear, x), w16, False)
                picked = mg.pick_config(kind, m, n, k, x.device)
                t_pick = (
                    base.time_ring(partial(base.ours(kind, picked), x), ring, False)
                    if picked
                    else t_lib
                )
                if not res:
                    continue
                res.sort()
                t_best, best = res[0]
                winner = tuple(best) if t_best <= t_lib else None
                tuned[(kind, n, k, m)] = winner
                print(
                    f"{kind:4} {layer:7} M={m:4}: bf16 {t16 * 1e6:6.1f} | shipped "
                    f"{t_pick * 1e6:6.1f} ({t16 / t_pick:4.2f}x) | lib {t_lib * 1e6:6.1f} | best "
                    f"{t_best * 1e6:6.1f} ({t16 / t_best:4.2f}x) {tuple(best)}; next: "
                    + "; ".join(f"{tuple(c)} {t * 1e6:.1f}" for t, c in res[1:4]),
                    flush=True,
                )
                SUMMARY[f"sweep_{kind}_{layer}_{m}"] = {
                    "bf16_us": t16 * 1e6, "shipped_us": t_pick * 1e6, "lib_us": t_lib * 1e6,
                    "best_us": t_best * 1e6, "best": tuple(best),
                    "top": [(tuple(c), t * 1e6) for t, c in res[:8]],
                }  # fmt: skip
                del ring, x, ref, w16
            torch.cuda.empty_cache()
    SUMMARY["wrong"] = wrong
    return tuned


def summarize(tuned: dict, out_dir: str) -> None:
    TABLE.append("best / bf16 (shipped / bf16) per shape qkv/o/gate_up/down:")
    for m in sorted({key[3] for key in tuned}, reverse=True):
        cells = []
        for kind in ("int8", "int4", "fp8", "w8a8"):
            got = [SUMMARY.get(f"sweep_{kind}_{layer}_{m}") for layer in SHAPES]
            if not all(got):
                continue
            best = "/".join(f"{g['bf16_us'] / g['best_us']:.2f}" for g in got)
            shipped = "/".join(f"{g['bf16_us'] / g['shipped_us']:.2f}" for g in got)
            cells.append(f"{kind} {best} ({shipped})")
        TABLE.append(f"  M={m:4}: " + "; ".join(cells))
    TABLE.append(f"configs WRONG on the GPU: {len(SUMMARY.get('wrong', []))}")
    lines = "".join(f"    {k!r}: {v!r},\n" for k, v in tuned.items())
    print("\nTUNED_CONFIGS = {\n" + lines + "}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "mixed_mma_tuned.txt"), "w") as f:
        f.write(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="128,256,64,32", help="M buckets to sweep, in order")
    ap.add_argument("--kinds", default="int8,int4,fp8,w8a8")
    ap.add_argument("--budget", type=float, default=70.0, help="seconds for the sweep")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    ms = [int(v) for v in args.m.split(",")]
    tuned = sweep(ms, args.kinds.split(","), args.budget) or {}
    summarize(tuned, args.out)
    print(f"\n=== summary ({time.perf_counter() - t0:.0f} s)")
    print("\n".join(TABLE))
    with open(os.path.join(args.out, "gpu_mixedmma.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
