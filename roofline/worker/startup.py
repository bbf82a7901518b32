"""A CUDA runner's start-up compiles: every Triton kernel its warm-up and graph capture launch,
compiled at once on a thread pool before they run for real.

``precompile_kernels(runner, graphs)`` runs the runner's ``warmup()`` and, with ``graphs``, its
``capture_cuda_graphs()`` once as a dry run (``kernels/parallel_compile.py``): Triton launches
that would compile submit their compile to the pool and launch nothing, and graph capture runs
its forwards eagerly (``torch.cuda.CUDAGraph``/``torch.cuda.graph`` stand-ins for the length of
the dry run), so every specialisation the real start-up needs is found in one pass of host work
while the pool compiles them. The graphs the dry run made are dropped; the engine then warms up
and captures as before, finding every kernel compiled. On a warm Triton cache the pool loads the
kernels from disk, also in parallel.

Only models whose forward indexes nothing with a Triton kernel's output qualify (the dry run
leaves those outputs unwritten): MoE models route tokens with a Triton kernel, so they start as
before. ``ROOFLINE_PARALLEL_COMPILE=0`` turns the dry run off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from roofline.kernels.parallel_compile import CompileStats
    from roofline.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def enabled() -> bool:
    """``ROOFLINE_PARALLEL_COMPILE`` unset or not "0"."""
    return os.environ.get("ROOFLINE_PARALLEL_COMPILE", "1") != "0"


def qualifies(model: torch.nn.Module) -> bool:
    """Whether a dry run of ``model``'s forward is safe: no layer whose indexing depends on a
    Triton kernel's output (the fused MoE routes tokens by the ids its routing kernel writes)."""
    from roofline.layers.moe import FusedMoE

    return not any(isinstance(m, FusedMoE) for m in model.modules())


def precompile_kernels(
    runner: ModelRunner, graphs: bool, num_threads: int | None = None
) -> CompileStats | None:
    """Compile, in parallel, every Triton kernel ``runner.warmup()`` (and with ``graphs``
    ``runner.capture_cuda_graphs()``) will launch. None when it does not apply (not CUDA, no
    Triton, a model that does not qualify, or turned off)."""
    if runner.device.type != "cuda" or not enabled() or not qualifies(runner.model):
        return None
    try:
        from roofline.kernels.parallel_compile import ParallelCompiler
    except ImportError:  # no Triton: nothing to compile
        return None
    t0 = time.perf_counter()
    compiler = ParallelCompiler(num_threads)
    try:
        with compiler.dry_run(), eager_graph_capture():
            runner.warmup()
            if graphs:
                runner.capture_cuda_graphs()
        dry_s = time.perf_counter() - t0
        stats = compiler.finish()
    finally:
        _drop_graphs(runner)
        compiler.close()
        torch.cuda.synchronize(runner.device)
    logger.info(
        "compiled %d kernel specialisations on %d threads in %.2f s (dry run %.2f s, then "
        "waited %.2f s; %d failed, left to their first launch)",
        stats.num_kernels, compiler.num_threads, time.perf_counter() - t0, dry_s, stats.wait_s,
        stats.num_failed,
    )  # fmt: skip
    return stats


def _drop_graphs(runner: ModelRunner) -> None:
    """Forget what a dry-run capture made (eager stand-ins, not graphs)."""
    runner.graphs = None
    runner.cascade_graphs = None
    if runner.mixed is not None:
        runner.mixed.graphs = None


class _EagerGraph:
    """``torch.cuda.CUDAGraph`` during a dry run: the forward under ``torch.cuda.graph`` just
    runs; there is nothing to replay."""

    def pool(self) -> None:
        return None

    def replay(self) -> None:
        return None

    def reset(self) -> None:
        return None


@contextlib.contextmanager
def _eager_capture(graph: Any, pool: Any = None, **_: Any) -> Iterator[None]:
    yield


@contextlib.contextmanager
def eager_graph_capture() -> Iterator[None]:
    """For the length of the block, capture code runs its forwards eagerly and makes stand-in
    graphs (only for a dry run: nothing captured can be replayed)."""
    cuda = torch.cuda
    saved = cuda.CUDAGraph, cuda.graph, cuda.graph_pool_handle
    cuda.CUDAGraph, cuda.graph, cuda.graph_pool_handle = _EagerGraph, _eager_capture, _no_pool
    try:
        yield
    finally:
        cuda.CUDAGraph, cuda.graph, cuda.graph_pool_handle = saved


def _no_pool() -> None:
    return None
