"""Shared pieces of ``scripts/gpu_gemv8.py`` and ``scripts/gemv8_sweeps.py``: the sections'
error handling and summary, the 8B shapes and weight formats (repacked int4 / int8 nibble planes,
per-channel int8 read as it is "i8", fp8, the canonical int4 / group-128 int8 bytes "c4" / "c8";
int4 symmetric with its scales alone, "int4p" asymmetric with (scale, offset) pairs),
random weights per format, rings of copies that keep
every call out of L2, and the timed config sweep that drops wrong results."""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

import gpu_quant as gq  # scripts/ is on sys.path when run as a script
import quant_decode_bench as qdb
import torch

from roofline.kernels import int4_gemv as ig
from roofline.quantization import formats

SHAPES = qdb.SHAPES
FORMATS = ("int4", "int8", "i8", "fp8")
DEVICE = "cuda"
SUMMARY = gq.SUMMARY  # gpu_quant's section runner reports failures into its SUMMARY: share both
TABLE = gq.TABLE
C = ig.Int4GemvConfig


section = gq.section  # print, time, report a failure into SUMMARY and go on


def print_configs(title: str, configs: Iterable[tuple[object, object]]) -> None:
    """Print the ``(key, config)`` pairs as the dict literal ``title = {...}`` (to paste)."""
    print(f"\n{title} = {{")
    for key, cfg in configs:
        print(f"    {key!r}: {cfg!r},")
    print("}")


def fmt_key(fmt: str) -> int | str:
    keys = {"int4": 4, "int4p": 4, "int8": 8, "i8": "i8", "fp8": "fp8", "c4": "c4", "c8": "c8"}
    return keys[fmt]


def bits_of(fmt: str) -> int:
    return 4 if fmt in ("int4", "int4p", "c4") else 8


def kind_of(fmt: str) -> str:
    """The quantization kind (canonical layout) of a format: int4, int8 or fp8."""
    return {"c4": "int4", "int4p": "int4", "i8": "int8", "c8": "int8"}.get(fmt, fmt)


def make_weight(fmt: str, n: int, k: int, seed: int = 0, dtype=torch.bfloat16):
    """(words, pairs, canonical (qweight, scales, offsets), fp32 dequantized [N, K])."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.randn(n, k, device=DEVICE, generator=gen) * 0.02
    if fmt in ("int4", "c4", "int4p"):  # symmetric (the method's default): the scales alone;
        # int4p: asymmetric, (scale, offset) pairs; c4: the canonical bytes, read as they are
        q = formats.quantize_int4(w, 128, fmt != "int4p", dtype)
        deq = formats.dequantize_int4(q.qweight, q.scales, q.offsets, torch.float32)
        words = q.qweight if fmt == "c4" else ig.repack_int4(q.qweight)
        scales = ig.pack_scales(q.scales, q.offsets) if fmt == "int4p" else q.scales
        return words, scales, tuple(q), deq
    if fmt == "c8":  # group-wise (128): the nibble planes over the canonical bytes
        q = formats.quantize_int8(w, 128, dtype)
        deq = formats.dequantize_int8(q.qweight, q.scales, torch.float32)
        return q.qweight, ig.pack_scales(q.scales, None), (q.qweight, q.scales, None), deq
    if fmt == "i8":  # per channel, read as it is: the [N] scales themselves
        q = formats.quantize_int8(w, k, dtype)
        deq = formats.dequantize_int8(q.qweight, q.scales, torch.float32)
        return q.qweight, q.scales.reshape(-1), (q.qweight, q.scales, None), deq
    if fmt == "int8":
        q = formats.quantize_int8(w, k, dtype)
        deq = formats.dequantize_int8(q.qweight, q.scales, torch.float32)
        canon = (q.qweight, q.scales, None)
        return ig.repack_int8(q.qweight), ig.pack_scales(q.scales, None), canon, deq
    q, s = formats.quantize_fp8(w)
    return q, s.float().contiguous(), (q, s, None), q.float() * s.float()[:, None]


def group_of(fmt: str, k: int) -> int:
    return 128 if fmt in ("int4", "int4p", "c4", "c8") else k


def sweep_configs(fmt, x, ring, ref, cfgs, **kw) -> list[tuple[float, ig.Int4GemvConfig]]:
    """(seconds, config) of each config that runs, fastest first; wrong results dropped."""
    w0, p0 = ring[0]
    k = ig.weight_k(w0, bits_of(fmt))
    cfgs = [c for c in dict.fromkeys(cfgs) if ig._resolve(c, k, group_of(fmt, k)) is not None]
    run = partial(ig.int4_gemv, x, bits=bits_of(fmt), **kw)
    qdb.precompile([partial(run, w0, p0, config=c, warmup=True) for c in cfgs])
    results = []
    for cfg in cfgs:
        try:
            results.append((qdb.time_ring(lambda w, p, c=cfg: run(w, p, config=c), ring), cfg))
        except Exception as e:  # noqa: BLE001
            print(f"    {fmt} {tuple(cfg)}: {type(e).__name__}: {str(e)[:100]}")
    good = []
    for t, cfg in sorted(results):
        err = qdb.rel_err(run(w0, p0, config=cfg), ref)
        if err < 1e-2:
            good.append((t, cfg))
        else:
            print(f"    {fmt} {tuple(cfg)} {t * 1e6:.1f} us is WRONG: max rel error {err:.2e}")
        if len(good) >= 4:
            break
    return good


def ring_of(fmt: str, n: int, k: int):
    words, pairs, canon, deq = make_weight(fmt, n, k)
    copies = max(2, math.ceil(qdb.RING_BYTES / qdb.nbytes(words, pairs)))
    ring = [(words.clone(), pairs.clone()) for _ in range(copies)]
    canon_ring = [tuple(None if t is None else t.clone() for t in canon) for _ in range(copies)]
    return ring, canon_ring, deq
