"""The full sweeps of ``scripts/gpu_gemv8.py --full-sweep`` (H100, Llama-3.1-8B shapes): per
shape at one row, ``kernels.int4_gemv``'s configs for int4 g128, int8 and fp8 (with ``preload``)
beside ``quant_gemv`` and the bf16 skinny GEMM (its RMSNorm statistic unrolled and as a loop),
the norm / SiLU prologue configs, fp8 at 4 and 16 rows; and int4_gemv's row tiles at 32-256 rows
against ``mixed_gemm`` (or dequantize + cuBLAS) and against dequantizing the repacked copy. The
winners are installed into the tables and printed for committing."""

from __future__ import annotations

import math
from functools import partial

import quant_decode_bench as qdb  # scripts/ is on sys.path when run as a script
import torch
from gemv8_common import (
    DEVICE,
    FORMATS,
    SHAPES,
    SUMMARY,
    TABLE,
    C,
    bits_of,
    fmt_key,
    group_of,
    kind_of,
    print_configs,
    ring_of,
    section,
    sweep_configs,
)  # fmt: skip

from roofline.kernels import int4_gemv as ig
from roofline.kernels import quant_gemv
from roofline.kernels.activation import silu_and_mul
from roofline.kernels.gemv import skinny_gemm
from roofline.kernels.rmsnorm import rms_norm
from roofline.quantization import common


def m1_candidates(fmt: str, layer: str) -> list[ig.Int4GemvConfig]:
    """One row: the families that won before (tiles 1-4, two to four stages, K over the grid),
    each tiles-1 config also with ``preload``."""
    base = [
        (128, 8, 1, 4, 2, 2), (128, 8, 1, 4, 3, 2), (128, 8, 2, 4, 2), (128, 8, 4, 4, 3),
        (128, 8, 1, 4, 3), (128, 4, 1, 4, 3, 4), (128, 4, 1, 4, 3, 2), (64, 16, 1, 4, 3),
        (64, 16, 1, 4, 4), (64, 8, 1, 4, 3), (64, 8, 2, 4, 3), (128, 16, 1, 4, 3),
        (128, 8, 1, 4, 4, 2), (64, 8, 1, 4, 3, 2), (128, 4, 2, 4, 2, 2), (128, 8, 1, 4, 2),
    ]  # fmt: skip
    cfgs = [C(*c) for c in base]
    cfgs += [c._replace(preload=1) for c in cfgs if c.tiles == 1]
    return cfgs


@section("decode GEMV sweep")
def gemv_sweep(copy_bw: float) -> None:
    tuned: dict = {}
    tuned_pro: dict = {}
    for layer, (n, k) in SHAPES.items():
        w16 = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
        ring16 = [(w16.clone(),) for _ in range(max(2, math.ceil(qdb.RING_BYTES / (2 * n * k))))]
        x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        t16 = qdb.time_ring(partial(skinny_gemm, x), ring16)
        parts = [f"bf16 {t16 * 1e6:5.1f} us {100 * 2 * n * k / t16 / copy_bw:3.0f}%"]
        if layer in ("qkv", "gate_up"):  # bf16 norm prologue: statistic unrolled vs a loop
            from roofline.kernels import gemv

            nw = torch.rand(k, device=DEVICE, dtype=torch.bfloat16) + 0.5
            norm_gemm = partial(skinny_gemm, x, norm=(nw, 1e-5))
            times = {}
            for unroll in (True, False):
                gemv.NORM_UNROLL = unroll
                times[unroll] = qdb.time_ring(norm_gemm, ring16)
            gemv.NORM_UNROLL = True
            parts.append(
                f"bf16 norm unrolled {times[True] * 1e6:.1f} / loop {times[False] * 1e6:.1f} us"
            )
        del ring16
        for fmt in FORMATS:
            ring, canon_ring, deq = ring_of(fmt, n, k)
            qbytes = qdb.nbytes(*ring[0])
            key = (fmt_key(fmt), n, k, group_of(fmt, k), 1)
            old_cfg = ig.pick_config(n, k, group_of(fmt, k), 1, x.device, fmt_key(fmt))
            ref = (x.float() @ deq.T).to(x.dtype)
            good = sweep_configs(fmt, x, ring, ref, m1_candidates(fmt, layer) + [old_cfg])
            qg = partial(quant_gemv.quant_gemv, kind_of(fmt), x)
            t_old_kernel = qdb.time_ring(qg, canon_ring)
            if good:
                t, cfg = good[0]
                tuned[key] = tuple(cfg)
                ig.TUNED_CONFIGS[key] = tuple(cfg)
                top = "; ".join(f"{tuple(c)} {s * 1e6:.1f}" for s, c in good)
                print(f"  {fmt} {layer} M=1: {top} | before {tuple(old_cfg)}", flush=True)
                parts.append(
                    f"{fmt} {t * 1e6:5.1f} us {100 * qbytes / t / copy_bw:3.0f}% "
                    f"(quant_gemv {100 * qbytes / t_old_kernel / copy_bw:3.0f}%)"
                )
                SUMMARY[f"gemv_{fmt}_{layer}_1"] = (t * 1e6, tuple(cfg), t_old_kernel * 1e6)
            prologue_sweep(fmt, layer, n, k, ring, copy_bw, tuned_pro, parts)
            if fmt == "fp8":  # 4 and 16 rows: int4_gemv's heuristic vs quant_gemv
                for m in (4, 16):
                    xm = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
                    t_new = qdb.time_ring(partial(ig.int4_gemv, xm, bits=8), ring)
                    t_q = qdb.time_ring(partial(quant_gemv.quant_gemv, "fp8", xm), canon_ring)
                    parts.append(f"fp8 M={m} {t_new * 1e6:.1f} vs quant_gemv {t_q * 1e6:.1f} us")
                    if t_q < t_new:
                        tuned[("fp8", n, k, k, m)] = None
                        ig.TUNED_CONFIGS[("fp8", n, k, k, m)] = None
            del ring, canon_ring
            torch.cuda.empty_cache()
        line = f"{layer:7} M=1: " + " | ".join(parts)
        print(line, flush=True)
        TABLE.append(line)
    print_configs(
        "int4_gemv.TUNED_CONFIGS (measured here)", list(tuned.items()) + list(tuned_pro.items())
    )
    print("common.GEMV_FUSE_SILU =", common.GEMV_FUSE_SILU)
    SUMMARY["tuned"] = {repr(k): v for k, v in tuned.items()}
    SUMMARY["tuned_prologue"] = {repr(k): v for k, v in tuned_pro.items()}


def prologue_sweep(fmt, layer, n, k, ring, copy_bw, tuned_pro, parts) -> None:
    """The norm (qkv, gate_up) or SiLU (down) prologue at one row: a few configs, fused vs the
    prologue's own kernel + the GEMV; the SiLU choice is installed per format."""
    if layer == "o":
        return
    b = bits_of(fmt)
    w0, p0 = ring[0]
    if layer == "down":
        x = torch.randn(1, 2 * k, device=DEVICE, dtype=torch.bfloat16)
        kw: dict = {"silu_mul": True}
        plain = silu_and_mul(x)
        prologue = "silu"
    else:
        x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        nw = torch.rand(k, device=DEVICE, dtype=torch.bfloat16) + 0.5
        kw = {"norm": (nw, 1e-5)}
        plain = rms_norm(x, nw, 1e-5)
        prologue = "norm"
    ref = ig.int4_gemv(plain, w0, p0, bits=b)
    cfgs = [
        C(*c)
        for c in [
            (128, 4, 1, 4, 3), (128, 8, 1, 4, 3), (64, 8, 1, 4, 3), (128, 4, 1, 4, 3, 2),
            (128, 8, 1, 4, 3, 1, 1), (128, 4, 1, 4, 3, 2, 1), (64, 8, 1, 4, 3, 1, 1),
        ]
    ]  # fmt: skip
    good = sweep_configs(fmt, x, ring, ref, cfgs, **kw)
    if not good:
        return
    t, cfg = good[0]
    key = (prologue, fmt_key(fmt), n, k, group_of(fmt, k), 1)
    tuned_pro[key] = tuple(cfg)
    ig.PROLOGUE_TUNED_CONFIGS[key] = tuple(cfg)
    first = silu_and_mul if prologue == "silu" else partial(rms_norm, weight=nw, eps=1e-5)
    t_apart = qdb.time_ring(lambda w, p: ig.int4_gemv(first(x), w, p, bits=b), ring)
    fuse_key = fmt if fmt in ("fp8", "i8") else b
    if prologue == "silu":
        common.GEMV_FUSE_SILU[fuse_key] = t < t_apart
    parts.append(f"{fmt} {prologue} fused {t * 1e6:.1f} / apart {t_apart * 1e6:.1f} us")
    print(f"  {fmt} {layer} {prologue}: " + "; ".join(f"{tuple(c)} {s * 1e6:.1f}" for s, c in good))


ROW_TILE_CANDIDATES = [  # no or few register spills on sm_90 (ptxas, int4 and int8)
    C(*c)
    for c in [
        (64, 1, 1, 4, 3, 1, 0, 32), (64, 1, 1, 4, 4, 1, 0, 32), (64, 1, 1, 4, 2, 1, 0, 32),
        (64, 2, 1, 4, 3, 1, 0, 16), (128, 2, 1, 4, 3, 1, 0, 16), (64, 1, 1, 4, 3, 2, 0, 32),
        (128, 1, 2, 8, 3, 1, 0, 32), (128, 1, 1, 8, 3, 1, 0, 32), (64, 1, 1, 8, 3, 1, 0, 64),
        (64, 1, 1, 8, 2, 1, 0, 64), (128, 1, 1, 8, 3, 1, 0, 64), (128, 1, 1, 4, 3, 1, 0, 32),
    ]
]  # fmt: skip


@section("row tiles above 16 rows")
def row_tiles(copy_bw: float) -> None:
    """int4 / int8 at 32-256 rows: ``int4_gemv`` in row tiles over the repacked copy against what
    those batches run (``mixed_gemm``'s table config, or dequantize + cuBLAS where it chose
    that): whether the repacked copy alone could serve them, letting a layer drop its canonical
    tensors. Informational: nothing is installed."""
    from roofline.kernels import mixed_gemm
    from roofline.kernels.dequant_gemm import dequant_cublas_gemm

    tuned: dict = {}
    for fmt in ("int4", "int8"):
        for layer, (n, k) in SHAPES.items():
            ring, canon_ring, deq = ring_of(fmt, n, k)
            qbytes = qdb.nbytes(*ring[0])
            parts = []
            for m in (32, 64, 128, 256):
                x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
                cfg = mixed_gemm.pick_config(fmt, m, n, k, x.device)
                if cfg is None:
                    now = partial(dequant_cublas_gemm, fmt, x)
                else:
                    now = partial(mixed_gemm.mixed_gemm, fmt, x, config=cfg)
                t_now = qdb.time_ring(lambda q, s, o, f=now: f(q, s, o), canon_ring)
                ref = (x.float() @ deq.T).to(x.dtype)
                good = sweep_configs(fmt, x, ring, ref, ROW_TILE_CANDIDATES)
                t_new, best = good[0] if good else (math.nan, None)
                if best is not None:
                    tuned[(fmt_key(fmt), n, k, group_of(fmt, k), m)] = tuple(best)
                parts.append(
                    f"M={m} {'mixed' if cfg else 'dq+cuBLAS'} {t_now * 1e6:.1f} | row tiles "
                    f"{t_new * 1e6:.1f} us ({100 * qbytes / t_new / copy_bw:.0f}%)"
                )
                print(f"  {fmt} {layer} M={m}: " + "; ".join(
                    f"{tuple(c)} {t * 1e6:.1f}" for t, c in good), flush=True)  # fmt: skip
            line = f"{fmt} {layer:7} " + " || ".join(parts)
            print(line, flush=True)
            TABLE.append(line)
            del ring, canon_ring
            torch.cuda.empty_cache()
    print_configs(
        "int4_gemv row tiles, the fastest config per bucket (not installed)", tuned.items()
    )
    SUMMARY["tuned_row_tiles"] = {repr(k): v for k, v in tuned.items()}
