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
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
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
    manifest = manifest_path(runner, graphs)
    recorded = read_manifest(manifest)
    compiler = ParallelCompiler(num_threads)
    try:
        if recorded is not None:  # a start-up like this one ran before: load what it found
            compiler.preload(recorded, _device_index(runner.device))
        else:
            with compiler.dry_run(), eager_graph_capture():
                runner.warmup()
                if graphs:
                    runner.capture_cuda_graphs()
        dry_s = time.perf_counter() - t0
        stats = compiler.finish()
    except Exception:  # noqa: BLE001 - the start-up that follows compiles what is missing
        logger.warning("parallel kernel compile failed; compiling at first launch", exc_info=True)
        return None
    finally:
        _drop_graphs(runner)
        compiler.close()
        torch.cuda.synchronize(runner.device)
    if recorded is None and stats.num_failed == 0:
        write_manifest(manifest, compiler.specializations)
    logger.info(
        "%s %d kernel specialisations on %d threads in %.2f s (%s %.2f s, then waited %.2f s; "
        "%d failed, left to their first launch)",
        "loaded" if recorded is not None else "compiled", stats.num_kernels, compiler.num_threads,
        time.perf_counter() - t0, "submitting" if recorded is not None else "dry run", dry_s,
        stats.wait_s, stats.num_failed,
    )  # fmt: skip
    return stats


# ------------------------------------------------------------------ the manifest (warm starts)
# After a dry run, the specialisations it found are written beside Triton's cache, under a key
# of everything that decides them; a later start with the same key loads them on the pool
# without a dry run (from the disk cache, or compiled if it was emptied). Anything the manifest
# misses compiles at its first launch, as without it.
_KEY_SOURCES = ("kernels", "layers", "attention", "worker", "models", "quantization")


def manifest_path(runner: ModelRunner, graphs: bool) -> Path | None:
    """Where this start-up's manifest lives (None: no Triton cache directory)."""
    try:
        import triton
        from triton import knobs

        cache_dir = knobs.cache.dir
    except (ImportError, AttributeError):
        return None
    if not cache_dir:
        return None
    digest = hashlib.sha256()
    device = runner.device
    for part in (
        repr(runner.model_config), repr(runner.scheduler_config), repr(runner.cache_config),
        repr(runner.dtype), repr(runner.quant_config), graphs, runner.mixed is not None,
        runner.cascade is not None, runner.max_sampled_rows, runner.parallel.world_size,
        torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
        torch.__version__, triton.__version__, _sources_digest(),
    ):  # fmt: skip
        digest.update(repr(part).encode())
    return Path(cache_dir) / "roofline-startup" / f"{digest.hexdigest()[:32]}.json"


@functools.lru_cache(maxsize=1)
def _sources_digest() -> str:
    """The roofline sources that decide which kernels launch with which arguments."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in _KEY_SOURCES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()


def read_manifest(path: Path | None) -> list[tuple[str, str, str]] | None:
    if path is None or os.environ.get("ROOFLINE_STARTUP_MANIFEST", "1") == "0":
        return None
    try:
        entries = json.loads(path.read_text())
        return [(str(m), str(n), str(spec)) for m, n, spec in entries]
    except (OSError, ValueError, TypeError):
        return None


def write_manifest(path: Path | None, entries: list[tuple[str, str, str]]) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: every start does the dry run
        logger.debug("could not write the start-up manifest %s", path, exc_info=True)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


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
