"""Row-count dispatch of the unquantized 16-bit GEMMs on Hopper: where cuBLAS's own kernel
choice for ``x[M, K] @ w[N, K]^T`` is measured slow at some row counts M, run those counts
another way; everything else goes to ``F.linear`` untouched.

cuBLAS picks its kernel by the problem's size, and at some row counts it picks badly: on the H100
Llama-3.1-8B's gate_up GEMM (N 28672, K 4096) took 332 us at 448 rows and 186 us at 512, so the
mixed-step graph of the 448-row bucket was slower than the 512-row one. ``PLANS[(N, K)]`` lists,
for a weight shape, bands of row counts ``lo <= M <= hi`` and what they run instead:

* ``Pad(rows)``: cuBLAS on x padded with zero rows up to ``rows`` (one copy of x, a few us),
  the output a view of the first M rows (contiguous);
* ``Lt()``: cuBLASLt instead of cuBLAS for this call (the BLAS backend torch prefers is
  switched around it and restored);
* ``Chunks(rows)``: cuBLAS on blocks of ``rows`` rows, each written into its slice of the
  output (where cuBLAS runs two halves faster than the whole);
* ``Tiles(config)``: the descriptor GEMM of ``kernels/dense_gemm.py`` with that config.

The bands come from ``scripts/gpu_short.py``'s sweep (every M from 1 to 1024 in steps of 8, then
coarser to 8192) on an H100 SXM, bf16, weights not in L2; they apply on compute capability 9.0
in bf16 (``choose``). ``ROOFLINE_GEMM_ROWS=0`` turns the dispatch off. The check is a dict
lookup and a bisect on host ints: no device work, capturable in CUDA graphs (whose buckets fix M
at capture, so the choice is made once per bucket).
"""

from __future__ import annotations

import bisect
import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from roofline.kernels.dense_gemm_configs import DenseGemmConfig


class Pad(NamedTuple):
    rows: int
    """Run cuBLAS at this many rows (>= M)."""


class Lt(NamedTuple):
    """Run cuBLASLt (``torch.backends.cuda.preferred_blas_library("cublaslt")`` for the call):
    its heuristics pick another kernel than cuBLAS's at some counts."""


class Chunks(NamedTuple):
    rows: int
    """Run cuBLAS on consecutive blocks of this many rows, each into its rows of the output."""


class Tiles(NamedTuple):
    config: DenseGemmConfig
    """Run ``kernels.dense_gemm`` with these tiles."""


class Band(NamedTuple):
    lo: int
    hi: int
    action: Pad | Lt | Chunks | Tiles


Plan = list[Band]
"""A weight shape's bands, sorted by ``lo``, not overlapping."""

_GATE_UP_896 = Tiles(DenseGemmConfig(128, 256, 64, 8, 8, 3, 1))
PLANS: dict[tuple[int, int], Plan] = {
    # H100 SXM, bf16, us per GEMM (cuBLAS at M -> the band's way), scripts/gpu_short.py
    (6144, 4096): [  # qkv
        Band(169, 176, Pad(192)),  # 27 -> 24
        Band(217, 224, Pad(256)),  # 29 -> 24
        Band(313, 320, Pad(336)),  # 38 -> 28
        Band(825, 832, Pad(896)),  # 85 -> 68
        Band(833, 880, Pad(904)),  # 77..84 -> 63
    ],
    (4096, 4096): [  # o
        Band(441, 448, Pad(464)),  # 30 -> 24
        Band(825, 832, Pad(840)),  # 71 -> 39
    ],
    (28672, 4096): [  # gate_up
        Band(281, 288, Pad(296)),  # 143 -> 114
        Band(393, 400, Pad(408)),  # 201 -> 147
        Band(433, 448, Pad(456)),  # 204..296 -> 159
        Band(529, 560, Pad(568)),  # 299..303 -> 194
        Band(577, 584, Pad(592)),  # 279 -> 205
        Band(593, 600, Pad(608)),  # 272 -> 212
        Band(609, 616, Pad(640)),  # 272 -> 213
        Band(641, 672, Pad(680)),  # 267..272 -> 232
        Band(825, 840, Pad(848)),  # 326 -> 276
        Band(889, 896, _GATE_UP_896),  # 336 -> 275
    ],
    (4096, 14336): [  # down
        Band(121, 128, Lt()),  # 53 -> 47
        Band(137, 144, Lt()),  # 53 -> 47
        Band(153, 160, Lt()),  # 54 -> 48
        Band(265, 272, Lt()),  # 75 -> 65
        Band(329, 336, Lt()),  # 85 -> 64
        Band(345, 360, Pad(376)),  # 78..90 -> 65
        Band(377, 384, Lt()),  # 87 -> 65
        Band(393, 400, Lt()),  # 87 -> 69
        Band(409, 416, Pad(432)),  # 103 -> 73
        Band(417, 424, Lt()),  # 85 -> 74
        Band(457, 464, Lt()),  # 89 -> 77
    ],
}
"""(N, K) -> bands, from one H100 sweep (see the module docstring): the Llama-3.1-8B (and
Mistral-7B) shapes; other shapes have none."""

SILU_PLANS: dict[tuple[int, int], Plan] = {}
"""(2I, K) of an MLP's merged gate_up weight -> bands whose ``Tiles`` config runs the GEMM with
the SiLU-and-mul in its epilogue (``kernels/dense_gemm_silu.py``): the ``[M, 2I]`` activation is
never written nor read back (``MergedLinear.fuses_silu_mul_out``)."""

_ENABLED = os.environ.get("ROOFLINE_GEMM_ROWS", "1") != "0"


def set_enabled(enabled: bool) -> None:
    """Turn the dispatch on or off (benchmarks compare both; graphs keep what they captured)."""
    global _ENABLED
    _ENABLED = enabled


@functools.lru_cache(maxsize=8)
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def find_band(plan: Plan, rows: int) -> Band | None:
    """The band of ``plan`` holding ``rows``, or None."""
    i = bisect.bisect_right(plan, (rows, float("inf"))) - 1
    if i >= 0 and plan[i].lo <= rows <= plan[i].hi:
        return plan[i]
    return None


def choose(x: torch.Tensor, weight: torch.Tensor) -> Band | None:
    """The band that re-routes ``x @ weight.T``, or None (``F.linear`` as usual)."""
    if not (_ENABLED and x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16):
        return None
    plan = PLANS.get((weight.shape[0], weight.shape[1]))
    if plan is None or weight.dtype != x.dtype:
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if not _hopper(index):
        return None
    return find_band(plan, x.shape[0])


def choose_silu(x: torch.Tensor, weight: torch.Tensor) -> Band | None:
    """The ``SILU_PLANS`` band for ``silu_and_mul(x @ weight.T)`` in one GEMM, or None."""
    if not (_ENABLED and x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16):
        return None
    plan = SILU_PLANS.get((weight.shape[0], weight.shape[1]))
    if plan is None or weight.dtype != x.dtype:
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if not _hopper(index):
        return None
    return find_band(plan, x.shape[0])


def run_silu(x: torch.Tensor, weight: torch.Tensor, band: Band) -> torch.Tensor:
    """``silu_and_mul(x @ weight.T)`` in one GEMM with ``band``'s tiles. x: [M, K], weight:
    [2I, K] -> [M, I]."""
    from roofline.kernels.dense_gemm_silu import dense_gemm_silu

    assert isinstance(band.action, Tiles)
    return dense_gemm_silu(x, weight, band.action.config)


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, band: Band):
    """``F.linear(x, weight, bias)`` the way ``band`` says."""
    # x: [M, K], weight: [N, K] -> [M, N]
    m = x.shape[0]
    action = band.action
    if isinstance(action, Pad):
        xp = F.pad(x, (0, 0, 0, action.rows - m))  # [rows, K], the extra rows zero
        return F.linear(xp, weight, bias)[:m]
    if isinstance(action, Lt):
        saved = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return F.linear(x, weight, bias)
        finally:
            torch.backends.cuda.preferred_blas_library(saved)
    if isinstance(action, Chunks):
        out = x.new_empty(m, weight.shape[0])  # [M, N]
        for start in range(0, m, action.rows):
            rows = slice(start, min(m, start + action.rows))
            if bias is None:
                torch.mm(x[rows], weight.t(), out=out[rows])
            else:
                torch.addmm(bias, x[rows], weight.t(), out=out[rows])
        return out
    from roofline.kernels.dense_gemm import dense_gemm, dense_gemm_applies

    if not dense_gemm_applies(x, weight):
        return F.linear(x, weight, bias)
    out = dense_gemm(x, weight, action.config)
    return out if bias is None else out.add_(bias)


def warm_up(model: torch.nn.Module) -> None:
    """Run each ``Tiles`` band (of ``PLANS`` and ``SILU_PLANS``) of ``model``'s layers once (at
    its smallest count, on zeros), so that the runner's warm-up compiles the descriptor GEMM for
    every config a step can reach, eager steps included (graph buckets reach only their own
    counts)."""
    from roofline.layers.linear import MergedLinear

    done: set[tuple] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, MergedLinear) or not isinstance(weight, torch.Tensor):
            continue
        shape = (weight.shape[0], weight.shape[1])
        for fused, plan in ((False, PLANS.get(shape, [])), (True, SILU_PLANS.get(shape, []))):
            for band in plan:
                key = (fused, band.action, weight.dtype, shape[0] % 16, shape[1] % 16)
                if not isinstance(band.action, Tiles) or key in done:
                    continue
                x = torch.zeros(band.lo, shape[1], dtype=weight.dtype, device=weight.device)
                if fused and choose_silu(x, weight) is band:
                    run_silu(x, weight, band)
                elif not fused and choose(x, weight) is band:
                    run(x, weight, None, band)
                else:
                    continue
                done.add(key)
