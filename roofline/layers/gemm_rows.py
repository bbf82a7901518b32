"""Row-count dispatch of the unquantized 16-bit GEMMs on Hopper: where cuBLAS's own kernel
choice for ``x[M, K] @ w[N, K]^T`` is measured slow at some row counts M, run those counts
another way; everything else goes to ``F.linear`` untouched.

cuBLAS picks its kernel by the problem's size, and at some row counts it picks badly: on the H100
Llama-3.1-8B's gate_up GEMM (N 28672, K 4096) took 293 us at 448 rows and 155 us padded to 456,
so the mixed-step graph of the 448-row bucket was slower than the 512-row one. ``PLANS[(N, K)]``
lists, for a weight shape, bands of row counts ``lo <= M <= hi`` and what they run instead:

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
from collections.abc import Callable
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

_TILES_128X256 = Tiles(DenseGemmConfig(128, 256, 64, 8, 8, 3, 1))
PLANS: dict[tuple[int, int], Plan] = {
    # H100 SXM, bf16, us per GEMM at the band's top count: cuBLAS -> the band's way, from
    # scripts/gpu_short.py's second check (its derived table at <= 1024 rows; above, the gains
    # were within the run-to-run spread and the eager steps got no faster with them)
    (6144, 4096): [  # qkv
        Band(313, 320, Pad(344)),  # 38 -> 28
        Band(409, 416, Pad(432)),  # 43 -> 33
        Band(825, 832, Pad(888)),  # 89 -> 66
        Band(833, 880, Pad(904)),  # 76..84 -> 63
    ],
    (4096, 4096): [  # o
        Band(537, 568, Lt()),  # 31..43 -> 28
        Band(705, 712, Lt()),  # 43 -> 34
        Band(825, 832, Pad(840)),  # 68 -> 39
        Band(841, 856, Lt()),  # 48 -> 40
    ],
    (28672, 4096): [  # gate_up
        Band(281, 288, Pad(296)),  # 133 -> 110
        Band(393, 400, Pad(408)),  # 199 -> 142
        Band(433, 448, Pad(456)),  # 203..293 -> 155
        Band(513, 520, Pad(528)),  # 211 -> 181
        Band(529, 536, Pad(568)),  # 295 -> 190
        Band(545, 560, Pad(568)),  # 296..300 -> 190
        Band(577, 584, Pad(592)),  # 280 -> 199
        Band(593, 600, Pad(608)),  # 274 -> 206
        Band(609, 616, Pad(632)),  # 274 -> 208
        Band(641, 672, Pad(680)),
        Band(705, 712, Pad(720)),
        Band(785, 824, Lt()),
        Band(825, 840, Pad(848)),  # 326 -> 274
        Band(857, 864, Pad(872)),
        Band(881, 888, Pad(944)),
        Band(889, 896, _TILES_128X256),  # 319 -> 274 (1.16x; 1.22x in the first check)
        Band(897, 904, Pad(944)),
        Band(913, 920, Pad(944)),
        Band(929, 936, Pad(944)),
        Band(953, 960, Lt()),
        Band(961, 984, Pad(992)),
        Band(1001, 1008, Pad(1024)),
        Band(1009, 1016, Lt()),
    ],
    (4096, 14336): [  # down: cuBLASLt from 32 to 288 rows (both checks: 2-20% at every decode
        # bucket but 208, where the two tie), and at the slow counts above
        Band(25, 192, Lt()),  # 128: 53 -> 47, 192: 61 -> 49
        Band(217, 224, Lt()),  # 60 -> 54
        Band(241, 256, Lt()),  # 60 -> 56
        Band(265, 288, Lt()),  # 70..74 -> 63..65
        Band(329, 336, Lt()),  # 83 -> 64
        Band(345, 352, Pad(376)),  # 79 -> 64
        Band(353, 360, Lt()),  # 91 -> 73
        Band(377, 384, Lt()),  # 86 -> 64
        Band(393, 400, Lt()),  # 90 -> 69
        Band(409, 416, Pad(440)),  # 96 -> 71
    ],
    (128256, 4096): [  # an LM head (Llama-3 vocabulary)
        Band(337, 352, Pad(360)),  # 636 -> 547
        Band(409, 416, Pad(440)),
    ],
}
"""(N, K) -> bands, from H100 sweeps (see the module docstring): the Llama-3.1-8B shapes
(Mistral-7B shares them); other shapes have none."""

SILU_PLANS: dict[tuple[int, int], Plan] = {}
"""(2I, K) of an MLP's merged gate_up weight -> bands whose ``Tiles`` config runs the GEMM with
the SiLU-and-mul in its epilogue (``kernels/dense_gemm_silu.py``): the ``[M, 2I]`` activation is
never written nor read back (``MergedLinear.fuses_silu_mul_out``). None shipped: measured by
``scripts/gpu_short.py`` (section 4b), not yet in an end-to-end run."""

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


def _chooser(
    plans: dict[tuple[int, int], Plan], name: str, doc: str
) -> Callable[[torch.Tensor, torch.Tensor], Band | None]:
    """A ``(x, weight) -> Band | None`` that looks ``x`` up in ``plans`` (a closure, not a
    wrapper: one Python call per linear, as on the hot path before)."""

    def choose(x: torch.Tensor, weight: torch.Tensor) -> Band | None:
        if not (_ENABLED and x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16):
            return None
        plan = plans.get((weight.shape[0], weight.shape[1]))
        if plan is None or weight.dtype != x.dtype:
            return None
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if not _hopper(index):
            return None
        return find_band(plan, x.shape[0])

    choose.__name__ = choose.__qualname__ = name
    choose.__doc__ = doc
    return choose


choose = _chooser(
    PLANS, "choose", "The band that re-routes ``x @ weight.T``, or None (``F.linear`` as usual)."
)
choose_silu = _chooser(
    SILU_PLANS,
    "choose_silu",
    "The ``SILU_PLANS`` band for ``silu_and_mul(x @ weight.T)`` in one GEMM, or None.",
)


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
