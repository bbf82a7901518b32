"""Launch configurations of ``kernels.int4_gemv``: the measured tables (H100, Llama-3.1-8B
shapes, ``scripts/gpu_quant.py --quick --sweep``), the heuristics for other shapes, and the
checks of whether a config (or the kernel at all) can take a weight."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from roofline.kernels import num_sms
from roofline.kernels.gemv import m_bucket
from roofline.kernels.int4_layout import TILE_K, can_repack, weight_k

MAX_ROWS = 16
TILED_MAX_ROWS = 256
"""Above MAX_ROWS rows the kernel runs in row tiles of ``block_m`` (a GEMM) given a config (the
sweeps) or a table entry of M's bucket (32 ... 256). The layers do not route such batches to it:
on the H100 ``mixed_gemm`` measured faster at most 8B shapes and buckets
(``scripts/gemv8_sweeps.py``), and it reads the canonical tensors the larger batches keep."""


class Int4GemvConfig(NamedTuple):
    block_n: int  # MMA rows per program (weight rows x ksplit), 16 per warp or more
    ksplit: int  # K-slices inside one program (the MMA's idle N columns); 1 = none
    tiles: int  # 128-element tiles per loop step
    num_warps: int
    num_stages: int
    kgrid: int = 1  # K parts over a second grid axis; the last program of a row block sums them
    preload: int = 0  # 1 / 2: the first tile(s) into registers before the PDL wait (tiles == 1)
    block_m: int = 0  # x rows a program (above MAX_ROWS rows: 16 to 64); 0: M's bucket


# (table_format, N, K, group, row_bucket(M)) -> Int4GemvConfig fields (fp8: group = K); None:
# kernels.quant_gemv measured faster there (not taken). Llama-3.1-8B qkv / o / gate_up / down,
# H100.
# One row (scripts/gpu_gemv8.py, 2026-11-24 08:20; the first tile preloaded before the PDL wait
# where a 7th field is 1), us and % of copy: int4 8.1 / 6.0 / 24.9 / 16.0 (57 / 51 / 87 / 67%),
# int8 10.3 / 8.3 / 42.4 / 24.8 (84 / 70 / 96 / 82%; was 71 / 60 / 89 / 75%), fp8 10.7 / 8.0 /
# 40.1 / 23.6 (81 / 72 / 101 / 86%; quant_gemv 76 / 69 / 98 / 90%). 4 and 16 rows
# (scripts/gpu_quant.py --quick --sweep, earlier): int4 45 / 42 / 71 / 54% and 35 / 20 / 67 / 30%;
# fp8 at 4 / 16 rows 13.1 / 19.7, 12.8 / 18.3, 45.0 / 56.9, 31.1 / 56.4 us (quant_gemv 20.0 /
# 23.0, 24.9 / 25.6, 49.7 / 55.6, 79.0 / 80.3).
TUNED_CONFIGS: dict[tuple[int | str, int, int, int, int], tuple[int, ...] | None] = {
    (4, 6144, 4096, 128, 1): (128, 8, 1, 4, 2, 1, 1),
    (4, 6144, 4096, 128, 4): (64, 4, 2, 4, 3),
    (4, 6144, 4096, 128, 16): (64, 2, 2, 4, 3),
    (4, 4096, 4096, 128, 1): (128, 8, 4, 4, 3),
    (4, 4096, 4096, 128, 4): (64, 8, 1, 4, 3),
    (4, 4096, 4096, 128, 16): (64, 2, 2, 4, 3),
    (4, 28672, 4096, 128, 1): (128, 8, 2, 4, 2),
    (4, 28672, 4096, 128, 4): (64, 4, 1, 4, 3),
    (4, 28672, 4096, 128, 16): (64, 1, 2, 4, 3),
    (4, 4096, 14336, 128, 1): (128, 8, 1, 4, 2, 2, 1),
    (4, 4096, 14336, 128, 4): (64, 8, 1, 4, 3),
    (4, 4096, 14336, 128, 16): (64, 2, 1, 4, 3),
    (8, 6144, 4096, 4096, 1): (64, 8, 1, 4, 3, 1, 1),
    (8, 4096, 4096, 4096, 1): (128, 8, 1, 4, 2, 2, 1),
    (8, 28672, 4096, 4096, 1): (64, 8, 1, 4, 3),
    (8, 4096, 14336, 14336, 1): (64, 8, 2, 4, 3),
    ("fp8", 6144, 4096, 4096, 1): (64, 8, 1, 4, 3, 1, 1),
    ("fp8", 4096, 4096, 4096, 1): (64, 8, 2, 4, 3),
    ("fp8", 28672, 4096, 4096, 1): (64, 8, 2, 4, 3),
    ("fp8", 28672, 4096, 4096, 16): None,
    ("fp8", 4096, 14336, 14336, 1): (128, 8, 1, 4, 4, 2),
    # per-channel int8 read as it is (common: the int8 default), one row (scripts/gpu_gemv8.py
    # --quick, 2026-11-24 11:19): 9.7 / 7.6 / 39.6 / 22.9 us (88 / 75 / 101 / 88% of copy; the
    # nibble planes 10.2 / 8.4 / 42.3 / 24.9, fp8 10.9 / 8.2 / 40.2 / 23.6); 4 / 8 / 16 rows
    # 12.5 / 13.7 / 14.1, 10.4 / 10.4 / 12.8, 43.6 / 47.7 / 51.6, 26.4 / 26.8 / 30.0 (planes 15.0
    # / 22.7 / 26.0, 18.7 / 15.3 / 13.2, 46.5 / 50.2 / 54.0, 46.4 / 43.9 / 41.5)
    ("i8", 6144, 4096, 4096, 1): (64, 8, 1, 4, 3, 1, 2),
    ("i8", 6144, 4096, 4096, 4): (64, 4, 2, 4, 3),
    ("i8", 6144, 4096, 4096, 8): (32, 1, 1, 2, 3, 4),
    ("i8", 6144, 4096, 4096, 16): (64, 4, 1, 4, 3),
    ("i8", 4096, 4096, 4096, 1): (64, 8, 2, 4, 3),
    ("i8", 4096, 4096, 4096, 4): (64, 1, 1, 4, 3, 4),
    ("i8", 4096, 4096, 4096, 8): (64, 1, 1, 4, 3, 4),
    ("i8", 4096, 4096, 4096, 16): (32, 1, 1, 2, 3, 2),
    ("i8", 28672, 4096, 4096, 1): (64, 8, 2, 4, 3),
    ("i8", 28672, 4096, 4096, 4): (64, 2, 2, 4, 3),
    ("i8", 28672, 4096, 4096, 8): (64, 1, 1, 4, 3, 4),
    ("i8", 28672, 4096, 4096, 16): (32, 1, 1, 2, 3, 4),
    ("i8", 4096, 14336, 14336, 1): (128, 8, 1, 4, 2, 2, 2),
    ("i8", 4096, 14336, 14336, 4): (32, 1, 1, 2, 3, 4),
    ("i8", 4096, 14336, 14336, 8): (64, 1, 1, 4, 3, 4),
    ("i8", 4096, 14336, 14336, 16): (32, 1, 1, 2, 3, 4),
    # the canonical int4 bytes, x permuted (common: the int4 default), same run: one row in the
    # fused decode layer's call qkv + norm / o + residual / gate_up + norm + SiLU / down +
    # residual 8.0 / 6.2 / 26.3 / 15.9 us (repacked 8.5 / 6.2 / 26.6 / 16.1); 4 / 8 / 16 rows
    # 9.3 / 13.4 / 13.4, 8.4 / 9.1 / 12.7, 32.9 / 33.1 / 37.1, 22.8 / 26.0 / 31.6 (repacked at
    # its picked configs 8.9 / 13.2 / 12.7, 7.4 / 7.9 / 12.2, 31.3 / 35.3 / 37.2, 19.8 / 21.7 /
    # 37.9); absent entries take the repacked int4's. Where a config makes Triton pick wgmma
    # (4-16 rows, >= 16 x columns), x is the MMA's shared-memory operand: the permuted tile is
    # written back (stmatrix, a fence and barriers each step; sm_90 SASS), hence o / down there
    ("c4", 4096, 4096, 128, 1): (128, 8, 1, 4, 2, 2, 1),
    ("c4", 4096, 14336, 128, 1): (128, 8, 1, 4, 2, 2, 1),
    ("c4", 6144, 4096, 128, 4): (64, 4, 2, 4, 3),
    ("c4", 6144, 4096, 128, 8): (64, 2, 1, 4, 3, 2),
    ("c4", 6144, 4096, 128, 16): (64, 1, 1, 4, 3, 4),
    ("c4", 4096, 4096, 128, 4): (64, 8, 1, 4, 3),
    ("c4", 4096, 4096, 128, 8): (64, 4, 2, 4, 3),
    ("c4", 4096, 4096, 128, 16): (64, 1, 1, 4, 3, 4),
    ("c4", 28672, 4096, 128, 4): (64, 2, 1, 4, 3, 2),
    ("c4", 28672, 4096, 128, 8): (64, 1, 2, 4, 3),
    ("c4", 28672, 4096, 128, 16): (64, 1, 1, 4, 3, 4),
    ("c4", 4096, 14336, 128, 4): (64, 8, 1, 4, 3),
    ("c4", 4096, 14336, 128, 8): (64, 4, 2, 4, 3),
    ("c4", 4096, 14336, 128, 16): (32, 1, 1, 2, 3, 4),
}
# With a prologue ("silu": x = gate_up [M, 2K]; "norm": x = rms_norm(h)), keyed (prologue, bits,
# N, K, group, m_bucket(M)); else prologue_heuristic (the x a program reads costs more there).
# One row, same run: qkv / gate_up with the norm int4 9.1 / 26.5 us (rms_norm + GEMV 10.1 /
# 28.1), int8 12.6 / 43.8 (14.4 / 45.1), fp8 11.2 / 41.9 (13.0 / 43.9); down with the SiLU int4
# 24.0 (apart 18.9), int8 29.0 (28.6), fp8 25.9 (28.9): common.GEMV_FUSE_SILU.
PROLOGUE_TUNED_CONFIGS: dict[tuple[str, int | str, int, int, int, int], tuple[int, ...]] = {
    ("norm", 4, 6144, 4096, 128, 1): (128, 8, 1, 4, 3, 1, 1),
    ("norm", 4, 28672, 4096, 128, 1): (128, 8, 1, 4, 3),
    ("norm", 8, 6144, 4096, 4096, 1): (64, 8, 1, 4, 3),
    ("norm", 8, 28672, 4096, 4096, 1): (128, 8, 1, 4, 3),
    ("norm", "fp8", 6144, 4096, 4096, 1): (64, 8, 1, 4, 3, 1, 1),
    ("norm", "fp8", 28672, 4096, 4096, 1): (64, 8, 1, 4, 3),
    # i8 and c4, same run as their tables above: qkv with the norm i8 10.3 us (planes 12.8, fp8
    # 11.1), gate_up with the norm and the SiLU epilogue 41.5 (planes 43.8, fp8 42.5)
    ("norm", "i8", 6144, 4096, 4096, 1): (64, 8, 1, 4, 3, 1, 2),
    ("norm", "i8", 28672, 4096, 4096, 1): (64, 8, 2, 4, 3),
    ("norm", "c4", 6144, 4096, 128, 1): (128, 8, 2, 4, 2),
    ("norm", "c4", 28672, 4096, 128, 1): (128, 8, 1, 4, 3),
    ("silu", 4, 4096, 14336, 128, 1): (128, 4, 1, 4, 3, 2, 1),
    ("silu", 8, 4096, 14336, 14336, 1): (128, 4, 1, 4, 3, 2),
    ("silu", "fp8", 4096, 14336, 14336, 1): (128, 4, 1, 4, 3, 2, 1),
}


def heuristic_config(n: int, k: int, group: int, m: int, sms: int) -> Int4GemvConfig:
    """Two tiles a step where K allows; the MMA's columns filled with K-slices. One row: 128 MMA
    rows in 8 slices of 16 weight rows, two stages (on the H100 sweep's four 8B shapes 5-25%
    faster than the 64-row, three-stage start the other buckets keep). Then more slices (up to
    32 columns, one tile a step if need be) until there are two programs per SM."""
    bm = m_bucket(m)
    cfg = (
        Int4GemvConfig(128, 8, 2, 4, 2) if bm == 1 else Int4GemvConfig(64, max(1, 8 // bm), 2, 4, 3)
    )
    for tiles in (2, 1):
        cfg = cfg._replace(tiles=tiles)
        while cfg.ksplit > 1 and _resolve(cfg, k, group) is None:
            cfg = cfg._replace(ksplit=cfg.ksplit // 2)
        if _resolve(cfg, k, group) is not None:
            break

    def programs(c: Int4GemvConfig) -> int:
        return triton.cdiv(n, c.block_n // c.ksplit)

    while programs(cfg) < 2 * sms:
        wider = cfg._replace(ksplit=cfg.ksplit * 2)
        if _resolve(wider, k, group) is None:
            wider = wider._replace(tiles=1)
        if wider.ksplit * bm > 32 or _resolve(wider, k, group) is None:
            break  # (fewer rows a program measured slower than fewer programs)
        cfg = wider
    return cfg


def prologue_heuristic(k: int, group: int) -> Int4GemvConfig:
    """With a prologue (one row): 32 weight rows a program in 4 K-slices, so each program's x
    (all of K, through registers) is 1/16 of its weight elements."""
    cfg = Int4GemvConfig(128, 4, 1, 4, 3)
    while cfg.ksplit > 1 and _resolve(cfg, k, group) is None:
        cfg = cfg._replace(ksplit=cfg.ksplit // 2)
    return cfg


def pick_config(
    n: int,
    k: int,
    group: int,
    m: int,
    device: torch.device,
    bits: int | str = 4,  # table_format's key
    prologue: str | None = None,
) -> Int4GemvConfig | None:
    """The measured config of M's bucket (and prologue), else the heuristic's; None where the
    table says the other decode kernel is faster (no prologue)."""
    key = (bits, n, k, group, row_bucket(m))  # bits: table_format's key
    keys = [key]
    if bits in ("c4", "c8"):
        keys.append((int(bits[1:]), *key[1:]))
    elif bits == "i8":  # per-channel int8 bytes: absent entries take fp8's (the same loop)
        keys.append(("fp8", *key[1:]))
    if prologue is not None:
        for kk in keys:
            tuned = PROLOGUE_TUNED_CONFIGS.get((prologue, *kk))
            if tuned:
                return Int4GemvConfig(*tuned)
        return prologue_heuristic(k, group)
    for kk in keys:
        if kk in TUNED_CONFIGS:
            tuned = TUNED_CONFIGS[kk]
            return None if tuned is None else Int4GemvConfig(*tuned)
    if m > MAX_ROWS:  # row tiles only where measured
        return None
    return heuristic_config(n, k, group, m, num_sms(device))


def table_format(words: torch.Tensor, bits: int, group: int) -> int | str:
    """The tables' format key of a weight: 4 / 8 (repacked int4 / int8 planes), "fp8", "i8" (the
    per-channel int8 bytes, read as fp8's; absent entries fall back to fp8's), or "c4" / "c8"
    (the canonical int4 / group-wise int8 bytes read as they are; absent entries fall back to
    4 / 8)."""
    if words.dtype == torch.float8_e4m3fn:
        return "fp8"
    if words.dtype == torch.int8 and group == words.shape[1]:
        return "i8"
    if words.dtype in (torch.uint8, torch.int8):
        return f"c{bits}"
    return bits


def row_bucket(m: int) -> int:
    """The table key of M rows: ``m_bucket`` up to 16, then the next power of two."""
    return m_bucket(m) if m <= MAX_ROWS else triton.next_power_of_2(m)


def _resolve(cfg: Int4GemvConfig, k: int, group: int) -> int | None:
    """The K-slice length for this config (K / (kgrid * ksplit)), or None if it cannot run:
    each slice a whole number of loop steps (so of 128-element tiles, which never straddle a
    group)."""
    if cfg.block_n % cfg.ksplit or cfg.block_n // cfg.ksplit < 1 or k % (cfg.ksplit * cfg.kgrid):
        return None
    if cfg.preload and cfg.tiles != 1 or cfg.preload not in (0, 1, 2):
        return None
    if cfg.block_m and (cfg.block_m & (cfg.block_m - 1) or not 16 <= cfg.block_m <= 64):
        return None
    k_slice = k // (cfg.ksplit * cfg.kgrid)
    if k_slice % (TILE_K * cfg.tiles) or k_slice < TILE_K * cfg.preload:
        return None
    return k_slice


def takes(
    m: int,
    dtype: torch.dtype,
    device: torch.device,
    words: torch.Tensor,
    group: int,
    bits: int = 4,
    prologue: str | None = None,
) -> bool:
    """``supports`` by shapes only (the fused decode layer asks before its inputs exist); the
    norm prologue takes one row."""
    k = weight_k(words, bits)
    if words.dtype in (torch.uint8, torch.int8) and group % TILE_K:
        return False  # the canonical layouts: whole tiles per group
    if not 1 <= m <= TILED_MAX_ROWS or dtype not in (torch.bfloat16, torch.float16):
        return False
    if prologue == "norm" and m != 1:
        return False
    fmt = table_format(words, bits, group)
    cfg = pick_config(words.shape[0], k, group, m, device, fmt, prologue)
    return cfg is not None and can_repack(k, group) and _resolve(cfg, k, group) is not None
