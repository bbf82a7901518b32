"""The one-copy layouts of ``kernels.int4_gemv`` beyond one row, on the H100 (Llama-3.1-8B
shapes): per-channel int8 read as it is ("i8") and the canonical int4 bytes with x permuted
("c4"), each swept at 4 / 8 / 16 rows against the two-copy layouts they replace (the int8 nibble
planes, the repacked int4) at those layouts' picked configs; and c4 at one row in the call the
fused decode layer makes (norm prologue, SiLU epilogue, residual). Winners are installed for the
decode runs that follow (``scripts/gpu_gemv8.py``) and printed for committing. ``canon_sweep``
(not ``--quick``): c4 at one row against the repacked copy and the halves-moving path of
before."""

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
    print_configs,
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
    print_configs("int4_gemv one-copy configs (measured here)", tuned.items())
    SUMMARY["tuned_one_copy"] = {repr(key): v for key, v in tuned.items()}


@section("canonical vs repacked")
def canon_sweep(copy_bw: float) -> None:
    """int4 g128 read from its canonical bytes (no repacked copy: the words widened as repacked
    ones are, x permuted per tile) vs the repacked copy, per 8B shape: one row (the repacked
    table's config and a few around it; the fused decode layer's call, norm prologue / SiLU
    epilogue / residual, at the picked configs, and the halves-interleaving canonical path of
    before) and 4 / 8 / 16 rows. Canonical winners go to the "c4" table for the decode runs."""
    tuned: dict = {}
    for fmt, rep in (("c4", "int4"),):
        for layer, (n, k) in SHAPES.items():
            ring, _, deq = ring_of(fmt, n, k)
            ring_rep, _, _ = ring_of(rep, n, k)
            qbytes = qdb.nbytes(*ring[0])
            group = group_of(fmt, k)
            x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
            base = ig.pick_config(n, k, group, 1, x.device, fmt_key(rep))
            around = [base, base._replace(preload=0), base._replace(num_stages=3),
                      base._replace(num_warps=8), C(64, 8, 1, 4, 3, 1, 1), C(128, 8, 1, 4, 2, 2, 1),
                      C(64, 8, 2, 4, 3), C(128, 4, 1, 4, 3, 4, 1), C(128, 8, 2, 4, 2),
                      C(128, 8, 1, 4, 2, 1, 1)]  # fmt: skip
            ref = (x.float() @ deq.T).to(x.dtype)
            good = sweep_configs(fmt, x, ring, ref, around)
            if good:
                ig.TUNED_CONFIGS[(fmt_key(fmt), n, k, group, 1)] = tuple(good[0][1])
            label, kw, xin, _ = decode_call(layer, k, n)
            xms = {m: torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) for m in (4, 8, 16)}
            warm = [partial(ig.int4_gemv, xin, *r[0], bits=4, **kw) for r in (ring, ring_rep)]
            warm += [partial(ig.int4_gemv, xm, *r[0], bits=4) for xm in xms.values()
                     for r in (ring, ring_rep)]  # fmt: skip
            qdb.precompile([partial(fn, warmup=True) for fn in warm])
            t_rep = qdb.time_ring(
                partial(ig.int4_gemv, x, bits=bits_of(fmt), config=base), ring_rep
            )
            parts = [f"repacked {t_rep * 1e6:.1f} us {100 * qbytes / t_rep / copy_bw:.0f}%"]
            if good:
                t, cfg = good[0]
                tuned[(fmt_key(fmt), n, k, group, 1)] = tuple(cfg)
                ig.TUNED_CONFIGS[(fmt_key(fmt), n, k, group, 1)] = tuple(cfg)
                parts.append(f"canonical {t * 1e6:.1f} us {100 * qbytes / t / copy_bw:.0f}% "
                             f"{tuple(cfg)}")  # fmt: skip
                ig.CANON4_XPERM = False
                try:
                    t_old = qdb.time_ring(partial(ig.int4_gemv, x, bits=4, config=cfg), ring)
                    parts.append(f"halves moved {t_old * 1e6:.1f}")
                finally:
                    ig.CANON4_XPERM = True
            t_c = qdb.time_ring(partial(ig.int4_gemv, xin, bits=4, **kw), ring)
            t_r = qdb.time_ring(partial(ig.int4_gemv, xin, bits=4, **kw), ring_rep)
            parts.append(f"{label} canonical {t_c * 1e6:.1f} / repacked {t_r * 1e6:.1f}")
            SUMMARY[f"c4_{layer}"] = {"m1": (t_rep, good[0][0] if good else None),
                                      label: (t_c, t_r)}  # fmt: skip
            for m, xm in xms.items():
                t_c = qdb.time_ring(partial(ig.int4_gemv, xm, bits=bits_of(fmt)), ring)
                t_r = qdb.time_ring(partial(ig.int4_gemv, xm, bits=bits_of(fmt)), ring_rep)
                parts.append(f"M={m} canonical {t_c * 1e6:.1f} / repacked {t_r * 1e6:.1f}")
            line = f"{fmt} {layer:7} M=1: " + " | ".join(parts)
            print(line, flush=True)
            TABLE.append(line)
            del ring, ring_rep
            torch.cuda.empty_cache()
    print_configs("int4_gemv.TUNED_CONFIGS canonical (measured here)", tuned.items())
    SUMMARY["tuned_canonical"] = {repr(k): v for k, v in tuned.items()}
