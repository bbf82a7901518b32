"""Why the weight-only GEMM is slower at row counts just past a tile multiple (int4 o_proj,
pipelined (128, 64, 128, 1, 4, 8, 3): 129 rows 38 us, 192 rows 26 us): the same entries timed
at M rows, at M rows read from a buffer padded to the tile multiple (no TMA box reaches past the
tensor's last row), and with the padding copy inside the timed call.

On the H100 (sixteenth session) padding made these GEMMs 1.35-1.85x faster alone, but a padding
copy in the kernels' wrappers moved the engine's decode steps by -7% to +4% (int8 / int4,
136-200 rows, CUDA graphs): not shipped; see BENCHMARKS.md.

    python scripts/gpu_wo_oob.py
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_mixedgemm as base  # noqa: E402
import gpu_wonly as wo  # noqa: E402

from roofline.kernels import wo_gemm as wg  # noqa: E402

CASES = [  # kind, n, k, config, row counts
    ("int4", 4096, 4096, (128, 64, 128, 1, 4, 8, 3), (129, 137, 160, 192)),
    ("int4", 4096, 4096, (256, 64, 128, 1, 3, 8, 3), (129, 385, 512)),
    ("int4", 6144, 4096, (128, 128, 128, 1, 4, 8, 2), (129, 137, 192)),
    ("int8", 4096, 14336, (128, 64, 128, 1, 4, 8, 3), (193, 200, 256)),
    ("int4", 28672, 4096, (256, 128, 64, 1, 4, 8, 1), (137, 192, 256)),
]


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    for kind, n, k, c, rows in CASES:
        cfg = wg.WoConfig(*c)
        fn = wo.wo_fn(kind, cfg)
        ring = wo.make_ring(kind, n, k, 128 << 20)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            pad = -(-m // cfg.block_m) * cfg.block_m
            xp = torch.zeros(pad, k, device="cuda", dtype=torch.bfloat16)
            xp[:m] = x
            same = torch.equal(fn(x, *ring[0]), fn(xp, *ring[0])[:m])
            t = base.time_ring(partial(fn, x), ring, False)
            tp = base.time_ring(partial(fn, xp), ring, False)

            def copied(*w, x=x, xp=xp, m=m, fn=fn):  # the padding copy inside the timed call
                xp[:m].copy_(x)
                return fn(xp, *w)

            tc = base.time_ring(copied, ring, False)
            print(f"{kind} {n}x{k} {c} M={m}: {t * 1e6:6.1f} us; padded to {pad} rows "
                  f"{tp * 1e6:6.1f} us ({'same rows' if same else 'ROWS DIFFER'}); copy + "
                  f"padded {tc * 1e6:6.1f} us", flush=True)  # fmt: skip
        del ring


if __name__ == "__main__":
    main()
