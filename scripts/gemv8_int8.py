"""Per-channel int8 read as it is ("i8": the canonical ``[N, K]`` bytes widened as fp8's e4m3
bytes are, one scale per row at the end) against the repacked nibble planes ("int8") and fp8 at
the same bytes, per Llama-3.1-8B shape on the H100, in the variants the fused decode layer runs
at one row (qkv and gate_up behind the RMSNorm prologue, gate_up with the SiLU epilogue, o and
down with the residual epilogue; more rows: ``gemv8_batch``). A few configs around fp8's winners are
swept for i8 and the winners installed (printed for committing); ``scripts/gpu_gemv8.py`` runs
it before the decode runs."""

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
    print_configs,
    ring_of,
    section,
    sweep_configs,
)  # fmt: skip

from roofline.kernels import int4_gemv as ig
from roofline.kernels.activation import silu_and_mul
from roofline.kernels.rmsnorm import rms_norm
from roofline.quantization import common

PLAIN_CANDIDATES = [  # the first check's winners and runners-up; two tiles preloaded
    C(*c)
    for c in [
        (64, 8, 1, 4, 4, 1, 1), (64, 8, 1, 4, 3, 1, 1), (64, 8, 2, 4, 3), (128, 8, 1, 4, 4, 2),
        (128, 8, 1, 4, 2, 2, 1), (64, 8, 1, 4, 3, 1, 2), (64, 8, 1, 4, 4, 1, 2),
        (128, 8, 1, 4, 2, 2, 2), (128, 8, 1, 4, 4, 2, 2),
    ]
]  # fmt: skip
NORM_CANDIDATES = [
    C(*c)
    for c in [
        (64, 8, 1, 4, 3, 1, 1), (64, 8, 2, 4, 3), (128, 8, 1, 4, 3), (64, 8, 1, 4, 4, 1, 1),
        (64, 8, 1, 4, 3, 1, 2), (128, 8, 1, 4, 3, 1, 2), (128, 4, 1, 4, 3, 2, 2),
        (64, 8, 1, 4, 4, 1, 2),
    ]
]  # fmt: skip


def decode_call(layer: str, k: int, n: int):
    """(label, kwargs, the input x, the reference's input and kwargs) of the call the fused
    decode layer makes for this shape at one row."""
    if layer in ("qkv", "gate_up"):
        h = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        nw = torch.rand(k, device=DEVICE, dtype=torch.bfloat16) + 0.5
        kw = {"norm": (nw, 1e-5)}
        if layer == "gate_up":
            kw["silu_out"] = True
        return "norm+silu_out" if layer == "gate_up" else "norm", kw, h, rms_norm(h, nw, 1e-5)
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    res = torch.randn(1, n, device=DEVICE, dtype=torch.bfloat16)
    return "residual", {"residual": res}, x, x


def _silu_apart(gu: torch.Tensor, words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return ig.int4_gemv(silu_and_mul(gu), words, scales, bits=8)


def _pct(qbytes: int, t: float, copy_bw: float) -> str:
    return f"{t * 1e6:5.1f} us {100 * qbytes / t / copy_bw:3.0f}%"


@section("int8 rows vs planes vs fp8")
def compare(copy_bw: float) -> None:
    tuned: dict = {}
    for layer, (n, k) in SHAPES.items():
        rings = {fmt: ring_of(fmt, n, k) for fmt in ("i8", "int8", "fp8")}
        qbytes = qdb.nbytes(*rings["i8"][0][0])
        x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        label, kw, xin, plain_in = decode_call(layer, k, n)
        parts = []
        # plain one row: i8 swept, the planes and fp8 at their tables' configs
        ring, _, deq = rings["i8"]
        ref = (x.float() @ deq.T).to(x.dtype)
        good = sweep_configs("i8", x, ring, ref, PLAIN_CANDIDATES)
        if good:
            t, cfg = good[0]
            if layer in ("o", "down"):  # the decode layer runs these with the residual add
                res_ref = ig.int4_gemv(xin, *ring[0], residual=kw.get("residual"), bits=8)
                good_r = sweep_configs("i8", xin, ring, res_ref, [c for _, c in good], **kw)
                if good_r:
                    t, cfg = good_r[0]
            key = ("i8", n, k, k, 1)
            tuned[key] = tuple(cfg)
            ig.TUNED_CONFIGS[key] = tuple(cfg)
            print(f"  i8 {layer} M=1: " + "; ".join(f"{tuple(c)} {s * 1e6:.1f}" for s, c in good))
        # the decode layer's call per format (i8 with its norm configs swept)
        if "norm" in kw:
            ring_i8 = rings["i8"][0]
            base = ig.int4_gemv(plain_in, *ring_i8[0], bits=8)
            ref_n = silu_and_mul(base) if kw.get("silu_out") else base
            good_n = sweep_configs("i8", xin, ring_i8, ref_n, NORM_CANDIDATES, **kw)
            if good_n:
                key = ("norm", "i8", n, k, k, 1)
                tuned[key] = tuple(good_n[0][1])
                ig.PROLOGUE_TUNED_CONFIGS[key] = tuple(good_n[0][1])
                print(f"  i8 {layer} {label}: "
                      + "; ".join(f"{tuple(c)} {s * 1e6:.1f}" for s, c in good_n))  # fmt: skip
        gu = torch.randn(1, 2 * k, device=DEVICE, dtype=torch.bfloat16)
        warm = []  # every call timed below, compiled in parallel first
        for fmt in ("i8", "int8", "fp8"):
            w, p = rings[fmt][0][0]
            b = bits_of(fmt)
            warm += [
                partial(ig.int4_gemv, x, w, p, bits=b),
                partial(ig.int4_gemv, xin, w, p, bits=b, **kw),
            ]
        if layer == "down":
            warm.append(partial(ig.int4_gemv, gu, *rings["i8"][0][0], bits=8, silu_mul=True))
        qdb.precompile([partial(fn, warmup=True) for fn in warm])
        for fmt in ("i8", "int8", "fp8"):
            ring_f = rings[fmt][0]
            t_plain = qdb.time_ring(partial(ig.int4_gemv, x, bits=bits_of(fmt)), ring_f)
            t_var = qdb.time_ring(partial(ig.int4_gemv, xin, bits=bits_of(fmt), **kw), ring_f)
            parts.append(f"{fmt} {_pct(qbytes, t_plain, copy_bw)} / {label} {t_var * 1e6:5.1f}")
            SUMMARY[f"rows_{fmt}_{layer}_1"] = (t_plain * 1e6, t_var * 1e6)
        if layer == "down":  # the SiLU prologue (layers not fused) vs its own launch
            ring_i8 = rings["i8"][0]
            t_f = qdb.time_ring(partial(ig.int4_gemv, gu, bits=8, silu_mul=True), ring_i8)
            apart = partial(_silu_apart, gu)
            t_a = qdb.time_ring(apart, ring_i8)
            common.GEMV_FUSE_SILU["i8"] = t_f < t_a
            parts.append(f"i8 silu fused {t_f * 1e6:.1f} / apart {t_a * 1e6:.1f}")
        line = f"{layer:7} M=1: " + " | ".join(parts)
        print(line, flush=True)
        TABLE.append(line)
        del rings
        torch.cuda.empty_cache()
    print_configs("int4_gemv i8 configs (measured here)", tuned.items())
    print("common.GEMV_FUSE_SILU =", common.GEMV_FUSE_SILU)
    SUMMARY["tuned_i8"] = {repr(k): v for k, v in tuned.items()}
