"""The one-copy layouts of ``kernels.int4_gemv`` beyond one row, on the H100 (Llama-3.1-8B
shapes): per-channel int8 read as it is ("i8") and the canonical int4 bytes with x permuted
("c4"), each swept at 4 / 8 / 16 rows against the two-copy layouts they replace (the int8 nibble
planes, the repacked int4) at those layouts' picked configs; and c4 at one row in the call the
fused decode layer makes (norm prologue, SiLU epilogue, residual). Winners are installed for the
decode runs that follow (``scripts/gpu_gemv8.py``) and printed for committing."""

from __future__ import annotations

from functools import partial

import quant_decode_bench as qdb  # scripts/ is on sys.path when run as a script
import torch
from gemv8_common import (
    DEVICE,
    SHAPES,
    SUMMARY,
    TABLE,
    C,
    bits_of,
    fmt_key,
    group_of,
    ring_of,
    section,
    sweep_configs,
)  # fmt: skip
from gemv8_int8 import decode_call

from roofline.kernels import int4_gemv as ig

ROW_CANDIDATES = [  # 4-16 rows: few K-slices (x's tile is ksplit x M columns), K over the grid
    C(*c)
    for c in [
        (64, 1, 1, 4, 3), (64, 1, 2, 4, 3), (64, 1, 1, 4, 3, 2), (64, 1, 1, 4, 3, 4),
        (32, 1, 1, 2, 3, 2), (32, 1, 1, 2, 3, 4), (64, 2, 1, 4, 3), (64, 2, 1, 4, 3, 2),
        (128, 2, 1, 8, 3), (64, 4, 1, 4, 3),
    ]
]  # fmt: skip
C4_DECODE_CANDIDATES = [  # one row, the fused decode layer's call
    C(*c)
    for c in [
        (128, 8, 1, 4, 3, 1, 1), (128, 8, 1, 4, 2, 1, 1), (128, 8, 1, 4, 3), (128, 8, 2, 4, 2),
        (128, 8, 1, 4, 2, 2, 1), (128, 8, 1, 4, 3, 2, 1), (64, 8, 1, 4, 3, 1, 1),
        (128, 4, 1, 4, 3, 2), (128, 8, 1, 4, 3, 1, 2), (128, 8, 4, 4, 3), (128, 16, 1, 8, 3),
        (128, 4, 1, 4, 3, 4, 1),
    ]
]  # fmt: skip
PAIRS = (("i8", "int8"), ("c4", "int4"))  # (one copy, the two-copy layout it replaces)


def _top(good) -> str:
    return "; ".join(f"{tuple(c)} {t * 1e6:.1f}" for t, c in good)


@section("one-copy layouts at 1-16 rows")
def sweep(copy_bw: float) -> None:
    tuned: dict = {}
    for layer, (n, k) in SHAPES.items():
        made = {f: ring_of(f, n, k) for f in ("i8", "int8", "c4", "int4")}
        rings = {f: r[0] for f, r in made.items()}
        parts = []
        # c4, one row, the decode layer's call; the reference is the repacked int4's output
        label, kw, xin, _ = decode_call(layer, k, n)
        ref = ig.int4_gemv(xin, *rings["int4"][0], bits=4, **kw)
        good = sweep_configs("c4", xin, rings["c4"], ref, C4_DECODE_CANDIDATES, **kw)
        t_rep = qdb.time_ring(partial(ig.int4_gemv, xin, bits=4, **kw), rings["int4"])
        if good:
            t, cfg = good[0]
            key = ("c4", n, k, 128, 1)
            if "norm" in kw:
                ig.PROLOGUE_TUNED_CONFIGS[("norm", *key)] = tuple(cfg)
                tuned[("norm", *key)] = tuple(cfg)
            else:
                ig.TUNED_CONFIGS[key] = tuple(cfg)
                tuned[key] = tuple(cfg)
            print(f"  c4 {layer} {label}: {_top(good)}", flush=True)
            parts.append(f"c4 {label} {t * 1e6:.1f} vs repacked {t_rep * 1e6:.1f} us")
            SUMMARY[f"c4_{layer}_{label}"] = (t * 1e6, t_rep * 1e6)
        for m in (4, 8, 16):
            xm = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            for fmt, base in PAIRS:
                deq = made[fmt][2]
                ref = (xm.float() @ deq.T).to(xm.dtype)
                group = group_of(fmt, k)
                cands = list(ROW_CANDIDATES)
                for f in (fmt, base):  # the picked configs: never worse than today
                    picked = ig.pick_config(n, k, group_of(f, k), m, xm.device, fmt_key(f))
                    if picked is not None and picked.block_m == 0:
                        cands.append(picked)
                good = sweep_configs(fmt, xm, rings[fmt], ref, cands)
                picked = ig.pick_config(n, k, group_of(base, k), m, xm.device, fmt_key(base))
                t_base = (
                    qdb.time_ring(partial(ig.int4_gemv, xm, bits=bits_of(base)), rings[base])
                    if picked is not None
                    else float("nan")
                )
                if good:
                    t, cfg = good[0]
                    key = (fmt_key(fmt), n, k, group, m)
                    ig.TUNED_CONFIGS[key] = tuple(cfg)
                    tuned[key] = tuple(cfg)
                    print(f"  {fmt} {layer} M={m}: {_top(good)}", flush=True)
                    parts.append(f"M={m} {fmt} {t * 1e6:.1f} vs {base} {t_base * 1e6:.1f}")
                    SUMMARY[f"{fmt}_{layer}_{m}"] = (t * 1e6, t_base * 1e6, tuple(cfg))
        line = f"{layer:7} " + " | ".join(parts)
        print(line, flush=True)
        TABLE.append(line)
        del made, rings
        torch.cuda.empty_cache()
    print("\nint4_gemv one-copy configs (measured here) = {")
    for key, cfg in tuned.items():
        print(f"    {key!r}: {cfg!r},")
    print("}")
    SUMMARY["tuned_one_copy"] = {repr(key): v for key, v in tuned.items()}
