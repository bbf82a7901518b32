"""Configs of the Hopper weight-only GEMM (``kernels.wo_gemm``, ``kernels.wo_gemm_ws``): the tile
shape of one launch and the table measured on an H100 per method, shape and M bucket
(``scripts/gpu_wonly.py`` prints it); a shape or bucket without an entry keeps
``kernels.mixed_gemm``.
"""

from __future__ import annotations

from typing import NamedTuple


class WoConfig(NamedTuple):
    block_m: int  # rows of x per program (wgmma N): 64, 128 or 256
    block_n: int  # weight rows per program: 64 per warpgroup (num_warps = block_n // 16; at 16
    # warps, 128 registers a thread: split-K's epilogue spills there)
    block_k: int  # K elements per pipeline stage: 64 or 128
    split_k: int  # K slices
    stages: int  # TMA ring depth
    group_m: int = 8  # row blocks of x that walk the same weight columns together
    ws: int = 0  # 1: the warp-specialized form (kernels.wo_gemm_ws: split_k 1, block_n 128);
    # 2: its persistent stream-K form (kernels.wo_gemm_sk: one program per SM, block_n 128);
    # 3 (PIPELINED): this kernel with two K tiles' MMAs in flight (K tiles a slice even)


PIPELINED = 3


WO_CONFIGS: dict[tuple[str, int, int, int], tuple[int, ...]] = {
    # scripts/gpu_wonly.py on an H100 80GB HBM3 (2026-11-24, first check; this kernel's SASS is
    # unchanged since: tests/kernels/test_wo_gemm.py compiles every entry): the fastest of its
    # candidates (each checked against the exact reference on the GPU first) wherever it beat
    # what the layer ran before (mixed_gemm's pick). bf16 cuBLAS / this, qkv / o / gate_up / down:
    # M = 256 int8 0.59/0.89/0.90/0.90 (mixed_gemm 0.53/0.69/0.76/0.80), int4 0.59/0.75/0.88/0.70
    # (0.48/0.61/0.60/0.62); M = 128 int8 0.97/0.86/1.30/1.21, int4 0.84/0.85/1.13/1.12; M = 64
    # int8 1.05/1.07/-/1.42 (gate_up stays on mixed_gemm, 1.55), int4 1.05/1.05/1.53/1.36.
    # Second check (2026-11-24, tenth session, `--wo 256,128 --kinds int8,int4`): the
    # warp-specialized form (ws = 1) timed for the first time; it took the qkv and gate_up entries
    # below (us, the previous entry -> ws): M = 256 int8 qkv 40.0 -> 32.0, gate_up 115.4 -> 97.8
    # (bf16 cuBLAS 101.7), int4 qkv 40.9 -> 35.1, gate_up 112.3 -> 107.7; M = 128 int8 gate_up
    # 68.3 -> 66.0, int4 gate_up 77.6 -> 68.8. bf16 / this at M = 256 now int8 0.73/0.84/1.04/0.89,
    # int4 0.68/0.73/0.95/0.67.
    # Third check (2026-11-24, eleventh session, `--wo 256,128,2048,8192 --kinds int8,int4s`):
    # the stream-K form (ws = 2) and symmetric int4 ("int4s", the layout on-the-fly int4 makes)
    # timed for the first time, and 2,048 / 8,192 rows against dequantize + cuBLAS. Stream-K took
    # the down projections and int4s qkv (us, what the layer ran before -> this; bf16 cuBLAS in
    # brackets): M = 256 int8 down 66.1 -> 61.9 (57.6), int4s down 83.4 -> 57.6 (57.6), int4s
    # qkv 35.5 -> 30.5 (24.1); M = 128 int8 down 43.0 -> 38.8 (52.1), int4s down 45.8 -> 35.4,
    # int4s qkv 26.0 -> 21.3 (21.5). bf16 / this at M = 256 int8 0.75/0.83/1.04/0.93, int4s
    # 0.79/0.82/1.03/1.00 (qkv/o/gate_up/down); M = 128 int8 0.97/0.84/1.35/1.34, int4s
    # 1.01/0.91/1.44/1.48. M = 2048 int8, the warp-specialized form: 0.89/0.85/0.82/0.92 against
    # dequantize + cuBLAS's 0.85/0.84/0.74/0.83 (int4s no faster there); at 8,192 rows dequantize
    # + cuBLAS stays (int8 0.79/0.87/0.95/1.00 against this kernel's 0.79/0.74/0.92/0.89).
    # Fourth check (same session, `--wo 256,512 --kinds int8,int4s`): stream-K tiles of 256 rows
    # as two 128-row halves (one weight read and one widening for both) took the int8 down
    # projection at 256 rows (62.2 -> 59.3 us, bf16 cuBLAS 60.7) and most of M = 512, where
    # mixed_gemm had run (bf16 / this, qkv/o/gate_up/down: int8 0.56/0.60/0.54/0.55 ->
    # 0.76/0.75/0.86/0.79, int4s 0.60/0.65/0.55/0.58 -> 0.74/0.67/0.82/0.75); qkv and o at 256
    # rows kept their entries (two halves: no faster).
    ("int8", 6144, 4096, 256): (256, 64, 128, 1, 3, 8, 3),
    ("int8", 28672, 4096, 256): (256, 128, 64, 1, 4, 8, 1),
    ("int4s", 6144, 4096, 256): (256, 64, 128, 1, 3, 8, 3),
    ("int4s", 28672, 4096, 256): (256, 128, 64, 1, 4, 8, 1),
    ("int4s", 4096, 14336, 256): (128, 128, 128, 1, 4, 8, 2),
    ("int4s", 28672, 4096, 128): (128, 128, 128, 1, 4, 8, 2),
    ("int4s", 4096, 14336, 128): (128, 128, 128, 1, 4, 8, 2),
    ("int8", 6144, 4096, 512): (256, 128, 64, 1, 4, 8, 1),
    ("int8", 4096, 4096, 512): (256, 64, 128, 1, 3, 8, 3),
    ("int8", 28672, 4096, 512): (256, 128, 64, 1, 4, 8, 2),
    ("int8", 4096, 14336, 512): (256, 64, 128, 1, 3, 8, 3),
    ("int4s", 6144, 4096, 512): (256, 128, 64, 1, 4, 8, 1),
    ("int4s", 4096, 4096, 512): (256, 64, 128, 1, 3, 8, 3),
    ("int4s", 28672, 4096, 512): (256, 128, 64, 1, 4, 8, 2),
    ("int4s", 4096, 14336, 512): (256, 64, 128, 1, 3, 8, 3),
    ("int8", 6144, 4096, 2048): (256, 128, 64, 1, 4, 8, 1),
    ("int8", 4096, 4096, 2048): (256, 128, 64, 1, 4, 8, 1),
    ("int8", 28672, 4096, 2048): (256, 128, 64, 1, 4, 8, 3),
    ("int8", 4096, 14336, 2048): (256, 128, 64, 1, 4, 8, 1),
    ("int4", 6144, 4096, 256): (256, 64, 128, 1, 3, 8, 3),
    ("int4", 4096, 4096, 256): (128, 64, 128, 1, 4, 8, 3),
    ("int4", 28672, 4096, 256): (256, 128, 64, 1, 4, 8, 1),
    ("int4", 4096, 14336, 256): (256, 128, 64, 1, 4, 8, 2),  # (bf16x2 widening: 67.8 -> 65.2 us)
    ("int8", 28672, 4096, 128): (128, 128, 128, 1, 4, 8, 1),
    ("int8", 4096, 14336, 128): (128, 128, 64, 1, 6, 8, 2),
    ("int4", 6144, 4096, 128): (128, 64, 128, 1, 4, 8, 3),
    ("int4", 4096, 4096, 128): (128, 64, 128, 2, 4, 8, 3),
    ("int4", 28672, 4096, 128): (128, 128, 128, 1, 4, 8, 2),
    ("int4", 4096, 14336, 128): (128, 64, 128, 2, 4, 8, 3),
    ("int8", 6144, 4096, 64): (64, 64, 128, 1, 4, 8, 3),
    ("int8", 4096, 4096, 64): (64, 64, 128, 4, 4, 8, 3),
    ("int8", 4096, 14336, 64): (64, 64, 128, 4, 4, 8, 3),
    ("int4", 6144, 4096, 64): (64, 128, 128, 1, 4, 8, 2),
    ("int4", 4096, 4096, 64): (64, 64, 128, 4, 4, 8, 0),
    ("int4", 28672, 4096, 64): (64, 128, 128, 1, 4, 8, 2),
    ("int4", 4096, 14336, 64): (64, 128, 128, 1, 4, 8, 2),
    # Fifth check (same session, `--wo 256,128,512,64,2048 --kinds fp8`): fp8 (e4m3, per row)
    # weight-only layers, timed for the first time (they had run mixed_gemm or dequantize +
    # cuBLAS). bf16 / before -> bf16 / this (qkv/o/gate_up/down): M = 64 0.85/0.94/1.49/1.24 ->
    # 1.20/1.10/1.69/1.46; M = 128 0.67/0.72/1.16/1.08 -> 1.01/0.90/1.44/1.38; M = 256
    # 0.50/0.59/0.75/0.76 -> 0.77/0.87/1.06/0.99; M = 512 0.57/0.61/0.56/0.56 ->
    # 0.79/0.70/0.91/0.82; M = 2048 0.84/0.85/0.81/0.69 -> 0.93/0.90/0.90/0.76.
    # Sixth check (same session, `--wo 256,128,512,2048 --kinds int4`): asymmetric int4 (zero
    # points: GPTQ / AWQ checkpoints, `int4-asym`), the stream-K form timed for it. bf16 / before
    # -> bf16 / this (qkv/o/gate_up/down): M = 128 0.83/0.84/1.29/1.13 -> 0.98/0.84/1.35/1.27;
    # M = 256 0.66/0.73/0.95/0.72 -> 0.72/0.74/0.95/0.90; M = 512 0.61/0.66/0.58/0.59 ->
    # 0.67/0.63/0.79/0.65 (o keeps mixed_gemm); at 2,048 rows dequantize + cuBLAS stays.
    ("fp8", 6144, 4096, 256): (256, 64, 128, 1, 3, 8, 3),
    ("fp8", 28672, 4096, 256): (256, 128, 64, 1, 4, 8, 1),
    ("fp8", 28672, 4096, 128): (128, 128, 64, 1, 4, 8, 0),
    ("fp8", 4096, 14336, 128): (128, 128, 64, 1, 6, 8, 2),
    ("fp8", 6144, 4096, 512): (256, 128, 64, 1, 4, 8, 1),
    ("fp8", 4096, 4096, 512): (256, 64, 128, 1, 3, 8, 3),
    ("fp8", 28672, 4096, 512): (256, 128, 64, 1, 4, 8, 2),
    ("fp8", 4096, 14336, 512): (256, 64, 128, 1, 3, 8, 3),
    ("fp8", 6144, 4096, 64): (64, 64, 128, 1, 4, 8, 3),
    ("fp8", 4096, 4096, 64): (64, 64, 128, 4, 4, 8, 3),
    ("fp8", 28672, 4096, 64): (64, 256, 128, 1, 4, 8, 3),
    ("fp8", 4096, 14336, 64): (64, 64, 128, 4, 4, 8, 3),
    ("fp8", 6144, 4096, 2048): (256, 128, 64, 1, 4, 8, 1),
    ("fp8", 4096, 4096, 2048): (256, 128, 64, 1, 4, 8, 1),
    ("fp8", 28672, 4096, 2048): (256, 128, 64, 1, 4, 8, 3),
    ("fp8", 4096, 14336, 2048): (256, 128, 64, 1, 4, 8, 1),
    ("int4", 6144, 4096, 512): (256, 128, 64, 1, 4, 8, 2),
    ("int4", 28672, 4096, 512): (256, 128, 64, 1, 4, 8, 2),
    ("int4", 4096, 14336, 512): (256, 64, 128, 1, 3, 8, 3),
    # Seventh check (2026-11-24, twelfth session, `--wo 1024,4096 --kinds int8,int4s,fp8`): the
    # first entries at 1,024 and 4,096 rows, where mixed_gemm or dequantize + cuBLAS ran. bf16 /
    # what ran -> bf16 / this (qkv/o/gate_up/down), M = 1024: int8 0.74/0.72/0.69/0.71 ->
    # 0.79/0.90/0.88/0.93, int4s 0.78/0.77/0.67/0.74 -> -/0.90/0.84/0.90 (its qkv stays), fp8
    # 0.74/0.74/0.71/0.71 -> 0.82/0.94/0.92/0.96; M = 4096 only the down projections gained
    # (int8 757 -> 726 us, int4s 779 -> 757, fp8 723 -> 689; the rest keep dequantize + cuBLAS).
    ("int8", 6144, 4096, 1024): (256, 64, 64, 1, 5, 8, 3),
    ("int8", 4096, 4096, 1024): (256, 128, 64, 1, 4, 8, 1),
    ("int8", 28672, 4096, 1024): (256, 128, 64, 1, 4, 8, 3),
    ("int8", 4096, 14336, 1024): (256, 128, 64, 1, 4, 8, 1),
    ("int4s", 4096, 4096, 1024): (256, 128, 64, 1, 4, 8, 1),
    ("int4s", 28672, 4096, 1024): (256, 128, 64, 1, 4, 8, 3),
    ("int4s", 4096, 14336, 1024): (256, 128, 64, 1, 4, 8, 1),
    ("fp8", 6144, 4096, 1024): (256, 128, 64, 1, 4, 8, 2),
    ("fp8", 4096, 4096, 1024): (256, 128, 64, 1, 4, 8, 1),
    ("fp8", 28672, 4096, 1024): (256, 128, 64, 1, 4, 8, 2),
    ("fp8", 4096, 14336, 1024): (256, 128, 64, 1, 4, 8, 1),
    ("int8", 4096, 14336, 4096): (256, 128, 64, 1, 4, 8, 1),
    ("int4s", 4096, 14336, 4096): (256, 128, 64, 1, 4, 8, 1),
    ("fp8", 4096, 14336, 4096): (256, 128, 64, 1, 4, 8, 3),
    # Fifth check (2026-11-24, thirteenth session, `--forms pipe` at 64-2048 rows, then every
    # form at the new buckets 192 / 384 / 768 and for asymmetric int4): the pipelined form (ws =
    # 3, two K tiles' MMAs in flight) took most entries from 64 to 512 rows (us, the previous
    # entry -> this; bf16 cuBLAS in brackets): M = 256 qkv int8 32.1 -> 28.6 (23.6), int4s 31.2
    # -> 27.3, fp8 30.9 -> 27.8; o int8 22.2 -> 19.1 (19.6), fp8 21.2 -> 17.7; down int8 58.8 ->
    # 56.7 (59.5), fp8 58.1 -> 54.6; M = 128 qkv int8 21.9 -> 19.1 (21.5); M = 512 o int8 32.9
    # -> 29.8 (24.5), down 100.4 -> 96.7 (78.8). bf16 / this at M = 256 int8 0.82/1.02/1.05/1.02,
    # int4s 0.88/0.99/1.02/0.99, fp8 0.86/1.04/1.07/1.06 (qkv/o/gate_up/down); at M = 64 int8
    # 1.23/1.28/1.65/1.47. Rows between powers of two had taken the next bucket's entry (the
    # short preset's ~140-row decode steps ran 256-row tiles); 192 / 384 / 768 are measured now.
    # At 4,096 / 8,192 rows dequantize + cuBLAS stays (pipelined int8 at 8,192: 0.82/0.77/0.89/
    # 0.93 against 0.91/0.86/0.97/0.95); asymmetric int4 took entries at 64, 1,024 and 2,048.
    ("int8", 4096, 4096, 256): (128, 64, 128, 1, 4, 8, 3),
    ("int8", 4096, 14336, 256): (128, 64, 128, 1, 4, 8, 3),
    ("int4s", 4096, 4096, 256): (128, 64, 128, 1, 4, 8, 3),
    ("fp8", 4096, 4096, 256): (128, 64, 128, 1, 4, 8, 3),
    ("fp8", 4096, 14336, 256): (128, 64, 128, 1, 4, 8, 3),
    ("int8", 6144, 4096, 128): (128, 64, 128, 1, 4, 8, 3),
    ("int8", 4096, 4096, 128): (128, 64, 128, 2, 4, 8, 3),
    ("int4s", 6144, 4096, 128): (128, 64, 128, 1, 4, 8, 3),
    ("int4s", 4096, 4096, 128): (128, 64, 128, 2, 4, 8, 3),
    ("fp8", 6144, 4096, 128): (128, 64, 128, 1, 4, 8, 3),
    ("fp8", 4096, 4096, 128): (128, 64, 128, 2, 4, 8, 3),
    ("int4s", 28672, 4096, 2048): (256, 128, 64, 1, 4, 8, 3),
    ("int8", 28672, 4096, 64): (64, 256, 128, 1, 4, 8, 3),
    ("int4s", 6144, 4096, 64): (64, 64, 128, 2, 4, 8, 3),
    ("int4s", 4096, 4096, 64): (64, 64, 128, 2, 4, 8, 3),
    ("int4s", 28672, 4096, 64): (64, 128, 128, 1, 4, 8, 3),
    ("int4s", 4096, 14336, 64): (64, 64, 128, 4, 4, 8, 3),
    ("int4", 4096, 4096, 512): (256, 64, 128, 1, 3, 8, 3),
    ("int8", 6144, 4096, 192): (128, 128, 128, 1, 4, 8, 1),
    ("int8", 4096, 4096, 192): (64, 64, 128, 1, 4, 8, 3),
    ("int8", 28672, 4096, 192): (256, 128, 64, 1, 4, 8, 3),
    ("int8", 4096, 14336, 192): (128, 128, 128, 1, 4, 8, 2),
    ("int4s", 6144, 4096, 192): (128, 128, 128, 1, 4, 8, 1),
    ("int4s", 4096, 4096, 192): (64, 64, 128, 1, 4, 8, 3),
    ("int4s", 28672, 4096, 192): (256, 128, 64, 1, 4, 8, 3),
    ("int4s", 4096, 14336, 192): (128, 128, 128, 1, 4, 8, 2),
    ("fp8", 6144, 4096, 192): (64, 128, 128, 1, 4, 8, 2),
    ("fp8", 4096, 4096, 192): (64, 64, 128, 1, 4, 8, 3),
    ("fp8", 28672, 4096, 192): (256, 128, 64, 1, 4, 8, 3),
    ("fp8", 4096, 14336, 192): (128, 128, 128, 1, 4, 8, 2),
    ("int4", 6144, 4096, 192): (128, 128, 128, 1, 4, 8, 2),
    ("int4", 4096, 4096, 192): (64, 128, 128, 1, 4, 8, 2),
    ("int4", 28672, 4096, 192): (256, 128, 64, 1, 4, 8, 3),
    ("int4", 4096, 14336, 192): (128, 128, 128, 1, 4, 8, 2),
    ("int8", 6144, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int8", 4096, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int8", 28672, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int8", 4096, 14336, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int4s", 6144, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int4s", 4096, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int4s", 28672, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int4s", 4096, 14336, 384): (128, 128, 128, 1, 4, 8, 2),
    ("fp8", 6144, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("fp8", 4096, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("fp8", 28672, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("fp8", 4096, 14336, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int4", 6144, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int4", 4096, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int4", 28672, 4096, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int4", 4096, 14336, 384): (128, 128, 128, 1, 4, 8, 2),
    ("int8", 6144, 4096, 768): (256, 128, 64, 1, 4, 8, 2),
    ("int8", 4096, 4096, 768): (256, 128, 64, 1, 4, 8, 1),
    ("int8", 28672, 4096, 768): (256, 128, 64, 1, 4, 8, 2),
    ("int8", 4096, 14336, 768): (256, 128, 64, 1, 4, 8, 3),
    ("int4s", 6144, 4096, 768): (256, 128, 64, 1, 4, 8, 2),
    ("int4s", 4096, 4096, 768): (256, 128, 64, 1, 4, 8, 1),
    ("int4s", 28672, 4096, 768): (256, 128, 64, 1, 4, 8, 2),
    ("int4s", 4096, 14336, 768): (256, 128, 64, 1, 4, 8, 2),
    ("fp8", 6144, 4096, 768): (256, 128, 64, 1, 4, 8, 2),
    ("fp8", 4096, 4096, 768): (256, 128, 64, 1, 4, 8, 1),
    ("fp8", 28672, 4096, 768): (256, 128, 64, 1, 4, 8, 2),
    ("fp8", 4096, 14336, 768): (256, 128, 64, 1, 4, 8, 1),
    ("int4", 6144, 4096, 768): (256, 128, 64, 1, 4, 8, 2),
    ("int4", 28672, 4096, 768): (256, 128, 64, 1, 4, 8, 2),
    ("int4s", 4096, 4096, 4096): (256, 128, 128, 1, 3, 8, 3),
    ("int4", 4096, 4096, 1024): (256, 128, 64, 1, 4, 8, 3),
    ("int4", 28672, 4096, 1024): (256, 128, 64, 1, 4, 8, 2),
    ("int4", 4096, 14336, 1024): (256, 128, 128, 1, 3, 8, 3),
    ("int4", 28672, 4096, 2048): (256, 128, 64, 1, 4, 8, 3),
}
"""(kind, N, K, M bucket) -> ``WoConfig`` fields, measured on an H100 by ``scripts/gpu_wonly.py``;
other shapes and buckets keep ``kernels.mixed_gemm``; kind ``int4s``: symmetric int4 (offsets
``-8 s``, bf16 scales) widened in bf16x2 arithmetic, tried before ``int4`` for such layers."""
WO_SILU_CONFIGS: dict[tuple[str, int, int, int], tuple[int, ...]] = {
    # scripts/gpu_wonly.py --silu-sweep 512,1024,2048,4096,8192 on an H100 80GB HBM3
    # (2026-11-24, twelfth session): us, today's path + silu_and_mul -> this. int8 1024
    # 460.5 -> 345.2 (mixed_gemm there), 2048 732.6 -> 680.6; int4s 512 204.4 -> 198.3, 1024
    # 448.3 -> 370.8, 2048 780.0 -> 761.2; int4 1024 449.3 -> 379.7; fp8 1024 460.4 -> 344.6,
    # 2048 713.4 -> 662.8. Not taken (< 2% or slower): 512 int8 / int4 / fp8, 4096 and 8192
    # every kind (8192 int8 2780 vs 3014: dequantize + cuBLAS stays).
    ("int8", 28672, 4096, 1024): (256, 128, 64, 1, 4, 8, 1),
    ("int8", 28672, 4096, 2048): (256, 128, 64, 1, 4, 8, 1),
    ("int4s", 28672, 4096, 512): (256, 128, 64, 1, 4, 8, 1),
    ("int4s", 28672, 4096, 1024): (256, 128, 64, 1, 4, 8, 1),
    ("int4s", 28672, 4096, 2048): (256, 128, 64, 1, 4, 8, 1),
    ("int4", 28672, 4096, 1024): (256, 128, 64, 1, 4, 8, 1),
    ("fp8", 28672, 4096, 1024): (256, 128, 64, 1, 4, 8, 1),
    ("fp8", 28672, 4096, 2048): (256, 128, 64, 1, 4, 8, 1),
}
"""(kind, 2I, K, M bucket) -> the warp-specialized ``WoConfig`` that runs an MLP's merged gate_up
GEMM with the SiLU-and-mul in its epilogue where that beat what the layer runs otherwise (the
``WO_CONFIGS`` path, ``mixed_gemm`` or dequantize + cuBLAS) followed by ``silu_and_mul``
(``scripts/gpu_wonly.py --silu-sweep``); elsewhere ``common.silu_out_choice`` takes the epilogue
where the ``WO_CONFIGS`` entry is itself the warp-specialized form."""
M_BUCKETS = (32, 64, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096, 8192)


def m_bucket(m: int) -> int:
    """The smallest bucket >= M (beyond the last: none)."""
    for bucket in M_BUCKETS:
        if m <= bucket:
            return bucket
    return 0


def pick(kind: str, m: int, n: int, k: int) -> WoConfig | None:
    """The measured config of (kind, N, K, M's bucket), or None (not measured faster there)."""
    cfg = WO_CONFIGS.get((kind, n, k, m_bucket(m)))
    return None if cfg is None else WoConfig(*cfg)


def pick_silu(kind: str, m: int, n: int, k: int) -> WoConfig | None:
    """``WO_SILU_CONFIGS``' config of (kind, N, K, M's bucket), or None."""
    cfg = WO_SILU_CONFIGS.get((kind, n, k, m_bucket(m)))
    return None if cfg is None else WoConfig(*cfg)
