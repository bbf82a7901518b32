"""Tile configs of the descriptor dense GEMM (``dense_gemm.py``), importable without Triton (the
row-count dispatch in ``layers/gemm_rows.py`` lists them in its bands)."""

from __future__ import annotations

from typing import NamedTuple


class DenseGemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    persistent: int = 0
    """0: one program per tile; 1: one per SM, flattened tile loop; 2: that, warp-specialized."""
    split_k: int = 1
    """K slices per tile (> 1: one program per tile and slice, ``persistent`` ignored)."""
