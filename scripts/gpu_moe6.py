"""Qwen3-30B-A3B batch 1 as shipped, for the final run on merged main: ``scripts/gpu_moe5.py``'s
sections (parity of the fused attention and of the routing in the gate/up GEMV; the 48-layer
model at batch 1, profiled by kernel kind, batch 8 / 32, each batch-1 change turned off again;
Qwen3-0.6B and Llama-3.1-8B floors) plus the parity of the down kernel (random weights; each
section in try/except; a table and the decision last).

The first call of this script (H100, branch moe5 @ 0770639) measured the two changes it then
held default off against the shipped path of the time (3.041 ms a step, 48 layers): the
gate/up GEMV's routing with one copy of the logits a warp (``moe_topk.pick_rank``; one copy a
program had taken the gate/up GEMV from 18.98 to 21.90 us a launch) -40 us a step; the down
projection with all k experts' rows in one program's tile (``kernels.moe_down``) -113 us at
8 x 128 tiles (-91 at 4 x 256) against the split down; both 2.898 ms (345.1 tok/s, 71.0% of
the roofline at a copy rate of 2.96 TB/s); batch 8 / 32 held (11.48 / 20.39 ms). Both are on.

    python scripts/gpu_moe6.py              # ~170 s on one H100
    TRITON_INTERPRET=1 python scripts/gpu_moe6.py --dry-run   # CPU: every section, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_moe2 as m2  # noqa: E402 - the section runner, check / rel_err, the table
import gpu_moe5 as m5  # noqa: E402 - parity cases, batch-1 rows, recapture, dense rows

from roofline.kernels import fused_moe as fm  # noqa: E402
from roofline.kernels import moe_down as md  # noqa: E402

TABLE = m2.TABLE
TILES = {"8x128 (shipped)": {}, "4x256": dict(BLOCK_N=4, BLOCK_K=256)}


def down_parity(gen: torch.Generator) -> int:
    """The down kernel (each tile) against the down GEMV's bits to an ulp and the fp32 sum, at
    Qwen3-30B-A3B's shapes, eager and in a CUDA graph."""
    w13, w2, _, _, k = m5.moe_block(gen)
    E, H, INTER = w2.shape
    x = torch.randn(1, H, device=m5.DEVICE, generator=gen).bfloat16()
    h = torch.randn(1, H, device=m5.DEVICE, generator=gen).bfloat16()
    ids = torch.randperm(E, device=m5.DEVICE, generator=gen)[:k].view(1, k)
    weights = torch.rand(1, k, device=m5.DEVICE, generator=gen).bfloat16()
    fm.WIDE_DOWN[0] = False
    try:
        gemv = fm.fused_moe(x, w13, w2, weights, ids, residual=h)
    finally:
        fm.WIDE_DOWN[0] = True
    ref = h.float() + fm.fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    bad = 0
    for label, tiles in TILES.items():
        md.WIDE_CONFIG.update(dict(BLOCK_N=8, BLOCK_K=128), **tiles)
        try:
            run = lambda: fm.fused_moe(x, w13, w2, weights, ids, residual=h)  # noqa: E731
            out = run()
            graph_ok = m5.graph_equals_eager(run, out)
        finally:
            md.WIDE_CONFIG.update(BLOCK_N=8, BLOCK_K=128)
        err_gemv, err_ref = m2.rel_err(out, gemv.float()), m2.rel_err(out, ref)
        bad += m2.check(f"down, all experts in one tile, {label}",
                        err_gemv < 1e-2 and err_ref < 2e-2 and graph_ok,
                        f"rel err vs the down GEMV {err_gemv:.1e}, vs fp32 {err_ref:.1e}, "
                        f"graph = eager {graph_ok}")  # fmt: skip
    return bad


@m2.section("parity: the down with all experts in one tile (Qwen3-30B-A3B shapes)")
def parity() -> None:
    bad = down_parity(torch.Generator(device=m5.DEVICE).manual_seed(1))
    TABLE.append(("parity (down)", "ok" if not bad else f"{bad} BAD (listed)"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-dense", action="store_true", help="skip Qwen3-0.6B / Llama-3.1-8B")
    ap.add_argument("--budget", type=float, default=m5.BUDGET_S, help="seconds for the run")
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny shapes")
    args = ap.parse_args()
    m5.BUDGET_S = args.budget
    m5.T0 = time.perf_counter()
    ceil = m5.setup(args.dry_run)
    m5.parity()
    parity()
    m5.full_model(ceil)
    if not args.no_dense:
        m5.dense(ceil)
    m5.print_table()
    m5.decision()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "gpu_moe6.json", "w") as f:
        json.dump(m5.SUMMARY, f, indent=1, default=str)


if __name__ == "__main__":
    main()
