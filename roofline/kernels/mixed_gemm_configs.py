"""Configs of the mixed-input GEMM (``kernels.mixed_gemm``): the tile shape of one launch, the
table measured on an H100 per method, shape and M bucket (``scripts/gpu_mixedgemm.py --sweep``
prints it), the heuristic for shapes it lacks, and the validation that fits a config to a
weight's K and group size. A table entry of ``None`` means the library GEMM measured faster
there (dequantize + cuBLAS; ``torch._scaled_mm`` for kind ``w8a8``); a bucket without an entry
takes the nearest measured bucket of the same shape, so a shape needs few compiled variants.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from roofline.kernels import num_sms

M_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class MixedGemmConfig(NamedTuple):
    block_m: int  # rows of x per program (the MMA's N side): 16..256, a power of two
    block_n: int  # weight rows per program (the MMA's M side): 64, 128 or 256
    block_k: int  # reduction elements per pipeline step: 64 or 128 (256 for small tiles)
    group_m: int  # row blocks of x that walk the same weight columns together (L2 reuse)
    split_k: int  # K slices (any count), each its own program, reduced in fp32
    num_warps: int
    num_stages: int
    mode: int = 0  # how the widened weight meets the MMA: MODE_* below


MODE_REG = 0
"""The weight tile widened in registers is wgmma's A operand, the MMAs of one K tile in flight
while the next is widened. ptxas before 13.3 may reuse an A register for the next tile before
the MMA reading it has run (triton-lang/triton#9433): wrong results, sometimes."""
MODE_SMEM = 1
"""The widened tile is stored to shared memory and is the MMA's B operand (x is A): no register
operand; Triton waits for the MMAs before the buffer is rewritten. Fewer than 64 rows of x:
``mma.sync`` (synchronous)."""
MODE_REG_WAIT = 2
"""As MODE_REG, but the accumulator goes through an opaque identity after each K tile, so every
MMA of a tile completes before the loop widens the next tile (no register reuse race)."""

MIXED_MAX_ROWS = 256
"""Above this many rows the library GEMM takes over unless the table has the bucket itself:
dequantize + cuBLAS for weight-only kinds (H100, 8B shapes, M = 2048 / 8192: 0.83-0.88x /
0.91-0.97x of bf16 cuBLAS, the mixed kernel 0.32-0.73x: its in-register widening does not
overlap the MMAs at prefill tile sizes), ``torch._scaled_mm`` for W8A8 (1.28-1.57x of bf16, the
Triton fp8 kernel 1.05-1.38x)."""

# (kind, N, K, m_bucket) -> config tuple, or None where the library GEMM measured faster
# (kind int8/int4/fp8: dequantize + cuBLAS; kind "w8a8": torch._scaled_mm).
# scripts/gpu_mixedmma.py on an H100 80GB HBM3 (2026-11-24, Llama-3.1-8B qkv / o / gate_up /
# down): the fastest race-free config (16-bit x: MODE_REG_WAIT or MODE_SMEM; every candidate
# checked against the reference on the GPU three times before it was timed) unless the library
# GEMM was faster. Weight-only kinds above MIXED_MAX_ROWS stay on the library GEMM (M = 2048:
# dequantize + cuBLAS 0.83-0.87x of bf16, the best mixed config 0.39-0.68x).
TUNED_CONFIGS: dict[tuple[str, int, int, int], tuple[int, ...] | None] = {
    ("int8", 28672, 4096, 32): (32, 128, 128, 8, 1, 4, 3, 1),
    ("int8", 6144, 4096, 32): (32, 64, 128, 8, 1, 4, 4, 2),
    ("int8", 4096, 4096, 32): (32, 64, 128, 8, 4, 4, 4, 2),
    ("int8", 4096, 14336, 32): (32, 128, 128, 8, 8, 4, 3, 1),
    ("int4", 28672, 4096, 32): (32, 64, 128, 8, 1, 4, 4, 2),
    ("int4", 6144, 4096, 32): (32, 64, 128, 8, 3, 4, 4, 2),
    ("int4", 4096, 4096, 32): (32, 64, 128, 8, 4, 4, 4, 2),
    ("int4", 4096, 14336, 32): (32, 64, 128, 8, 4, 4, 4, 2),
    ("fp8", 28672, 4096, 32): (32, 128, 128, 8, 1, 4, 3, 1),
    ("fp8", 6144, 4096, 32): (32, 64, 128, 8, 1, 4, 4, 2),
    ("fp8", 4096, 4096, 32): (32, 64, 128, 8, 4, 4, 4, 2),
    ("fp8", 4096, 14336, 32): (32, 128, 128, 8, 8, 4, 3, 1),
    ("w8a8", 28672, 4096, 32): (32, 64, 128, 8, 1, 4, 4, 0),
    ("w8a8", 6144, 4096, 32): (32, 64, 128, 8, 1, 4, 4, 0),
    ("w8a8", 4096, 4096, 32): (32, 64, 128, 8, 4, 4, 4, 2),
    ("w8a8", 4096, 14336, 32): (32, 64, 128, 8, 4, 4, 4, 2),
    ("int8", 28672, 4096, 64): (64, 128, 128, 8, 1, 4, 3, 1),
    ("int8", 6144, 4096, 64): (64, 64, 128, 8, 3, 4, 3, 2),
    ("int8", 4096, 4096, 64): (64, 64, 128, 8, 4, 4, 3, 2),
    ("int8", 4096, 14336, 64): (64, 64, 128, 8, 4, 4, 3, 2),
    ("int4", 28672, 4096, 64): (64, 128, 128, 8, 1, 4, 3, 1),
    ("int4", 6144, 4096, 64): (64, 64, 128, 8, 3, 4, 3, 2),
    ("int4", 4096, 4096, 64): (64, 64, 128, 8, 4, 4, 3, 2),
    ("int4", 4096, 14336, 64): (64, 64, 128, 8, 4, 4, 3, 2),
    ("fp8", 28672, 4096, 64): (64, 128, 128, 8, 1, 4, 3, 1),
    ("fp8", 6144, 4096, 64): (64, 64, 128, 8, 1, 4, 3, 2),
    ("fp8", 4096, 4096, 64): (64, 64, 128, 8, 4, 4, 3, 2),
    ("fp8", 4096, 14336, 64): (64, 64, 128, 8, 4, 4, 3, 2),
    ("w8a8", 28672, 4096, 64): (64, 64, 128, 8, 1, 4, 3, 0),
    ("w8a8", 6144, 4096, 64): None,
    ("w8a8", 4096, 4096, 64): (64, 64, 128, 8, 4, 4, 3, 0),
    ("w8a8", 4096, 14336, 64): (64, 64, 128, 8, 4, 4, 3, 0),
    ("int8", 28672, 4096, 128): (128, 128, 64, 8, 1, 4, 3, 1),
    ("int8", 6144, 4096, 128): (128, 64, 128, 8, 1, 4, 3, 2),
    ("int8", 4096, 4096, 128): (128, 64, 128, 8, 4, 4, 3, 2),
    ("int8", 4096, 14336, 128): (128, 64, 128, 8, 4, 4, 3, 2),
    ("int4", 28672, 4096, 128): (128, 64, 128, 8, 1, 4, 3, 2),
    ("int4", 6144, 4096, 128): (128, 64, 128, 8, 3, 4, 3, 2),
    ("int4", 4096, 4096, 128): (128, 64, 128, 8, 4, 4, 3, 2),
    ("int4", 4096, 14336, 128): (128, 64, 128, 8, 4, 4, 3, 2),
    ("fp8", 28672, 4096, 128): (128, 128, 64, 8, 1, 4, 3, 1),
    ("fp8", 6144, 4096, 128): (128, 64, 128, 8, 1, 4, 3, 2),
    ("fp8", 4096, 4096, 128): (128, 64, 128, 8, 4, 4, 3, 2),
    ("fp8", 4096, 14336, 128): (128, 64, 128, 8, 4, 4, 3, 2),
    ("w8a8", 28672, 4096, 128): None,
    ("w8a8", 6144, 4096, 128): None,
    ("w8a8", 4096, 4096, 128): None,
    ("w8a8", 4096, 14336, 128): (128, 64, 128, 8, 4, 4, 3, 0),
    ("int8", 28672, 4096, 256): (256, 64, 64, 8, 1, 4, 3, 2),
    ("int8", 6144, 4096, 256): (128, 64, 128, 8, 1, 4, 3, 2),
    ("int8", 4096, 4096, 256): (128, 64, 128, 8, 2, 4, 3, 2),
    ("int8", 4096, 14336, 256): (256, 64, 64, 8, 4, 4, 3, 2),
    ("int4", 28672, 4096, 256): (256, 64, 64, 8, 1, 4, 3, 2),
    ("int4", 6144, 4096, 256): None,
    ("int4", 4096, 4096, 256): (128, 64, 128, 8, 2, 4, 3, 2),
    ("int4", 4096, 14336, 256): (128, 64, 128, 8, 2, 4, 3, 2),
    ("fp8", 28672, 4096, 256): (128, 128, 64, 8, 1, 4, 3, 1),
    ("fp8", 6144, 4096, 256): (128, 64, 128, 8, 1, 4, 3, 2),
    ("fp8", 4096, 4096, 256): (128, 64, 128, 8, 2, 4, 3, 2),
    ("fp8", 4096, 14336, 256): (256, 64, 64, 8, 4, 4, 3, 2),
    ("w8a8", 28672, 4096, 256): (128, 128, 128, 8, 1, 8, 3, 1),
    ("w8a8", 6144, 4096, 256): None,
    ("w8a8", 4096, 4096, 256): None,
    ("w8a8", 4096, 14336, 256): None,
    ("w8a8", 4096, 4096, 2048): (128, 256, 64, 8, 1, 8, 4, 1),
    ("w8a8", 4096, 14336, 2048): (128, 256, 64, 8, 1, 8, 4, 1),
}


def m_bucket(m: int) -> int:
    """The TUNED_CONFIGS row bucket of M rows: the smallest bucket >= M (8192 beyond)."""
    for bucket in M_BUCKETS:
        if m <= bucket:
            return bucket
    return M_BUCKETS[-1]


def heuristic_config(kind: str, m: int, n: int, k: int, sms: int) -> MixedGemmConfig:
    """A config for shapes the sweep has not measured. BLOCK_M: M's power of two up to 128
    (16 at least: the MMA's N side); BLOCK_N 128, or 64 where that is what fills the SMs;
    split-K (powers of two, slices of at least 512) until the tiles cover about one wave."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    tiles_m = triton.cdiv(m, block_m)
    block_n = 128 if tiles_m * triton.cdiv(n, 128) >= sms else 64
    block_k = 128  # (64 with 8 warps gave wrong results on the H100: see TUNED_CONFIGS)
    tiles = tiles_m * triton.cdiv(n, block_n)
    split_k = 1
    while tiles * split_k < sms and k % (2 * split_k * block_k) == 0 and k // (2 * split_k) >= 512:
        split_k *= 2
    num_warps = 8 if max(block_m, block_k) * block_n >= 128 * 128 else 4  # (4 spill there)
    num_stages = 4 if block_n * block_k <= 64 * 128 else 3
    mode = MODE_REG if kind == "w8a8" else MODE_REG_WAIT  # (fp8 x: both operands in smem)
    return MixedGemmConfig(block_m, block_n, block_k, 8, split_k, num_warps, num_stages, mode)


def pick_config(kind: str, m: int, n: int, k: int, device: torch.device) -> MixedGemmConfig | None:
    """The tuned config of (kind, N, K, M's bucket), else above MIXED_MAX_ROWS the library GEMM,
    else the nearest bucket measured for that shape, else the heuristic; None: the library GEMM
    (cuBLAS on a dequantized copy; ``torch._scaled_mm`` for ``w8a8``) is faster there."""
    bucket = m_bucket(m)
    if (kind, n, k, bucket) in TUNED_CONFIGS:
        cfg = TUNED_CONFIGS[(kind, n, k, bucket)]
        return None if cfg is None else MixedGemmConfig(*cfg)
    if m > MIXED_MAX_ROWS:
        return None  # prefill: the library GEMM unless the bucket itself was measured faster
    measured = [b for b in M_BUCKETS if b <= MIXED_MAX_ROWS and (kind, n, k, b) in TUNED_CONFIGS]
    if measured:  # the nearest measured bucket (by ratio of rows)
        nearest = min(measured, key=lambda b: (abs(math.log2(b / bucket)), b))
        cfg = TUNED_CONFIGS[(kind, n, k, nearest)]
        return None if cfg is None else MixedGemmConfig(*cfg)
    return heuristic_config(kind, m, n, k, num_sms(device))


def check_config(k: int, group: int, cfg: MixedGemmConfig) -> MixedGemmConfig:
    """The config made valid for this weight: BLOCK_K halved (down to 32) until it divides K
    and a tile sits in one group or holds whole groups, SPLIT_K at most the number of K tiles
    (slices are whole tiles and differ by at most one)."""
    block_k, split_k = cfg.block_k, cfg.split_k
    while block_k > 32 and ((group % block_k and block_k % group) or k % block_k):
        block_k //= 2
    if (group % block_k and block_k % group) or k % block_k:
        raise ValueError(f"mixed_gemm: no K tile fits K = {k} with groups of {group}")
    split_k = max(1, min(split_k, k // block_k))  # slices of whole tiles, none empty
    return cfg._replace(block_k=block_k, split_k=split_k)
