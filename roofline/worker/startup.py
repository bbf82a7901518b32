"""A CUDA runner's start-up compiles: every Triton kernel its warm-up and graph capture launch,
compiled at once on a thread pool before they run for real.

``StartupCompiles.run(runner, graphs)`` runs the runner's ``warmup()`` and, with ``graphs``, its
``capture_cuda_graphs()`` once as a dry run (``kernels/parallel_compile.py``): Triton launches
that would compile submit their compile to the pool and launch nothing, and graph capture runs
its forwards eagerly (``torch.cuda.CUDAGraph``/``torch.cuda.graph`` stand-ins for the length of
the dry run), so every specialisation the real start-up needs is found in one pass of host work
while the pool compiles them. The graphs the dry run made are dropped; the engine then warms up
and captures as before, finding every kernel compiled. The specialisations found are written to a
manifest beside Triton's cache; a later start-up with the same key loads them on the pool from
the start of the engine's construction (overlapping the model's build), with no dry run.

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


class StartupCompiles:
    """One engine start-up's kernel compiles. Begun before anything is built: Triton's own
    initialisation (its cache key, its CUDA utilities) starts on the pool, and where a manifest
    of an earlier start-up with the same key exists, its kernels start loading too, while the
    model and the KV pool are built. ``run(runner, graphs)``, just before the runner's warm-up,
    does the dry run when there was no manifest, waits for the preloads and installs what the
    pool compiled (what is still compiling is waited for at its first launch)."""

    def __init__(self, device: torch.device, key: tuple, num_threads: int | None = None) -> None:
        self.device = device
        self.compiler = None
        self.manifest: Path | None = None
        self.recorded: list[tuple[str, str, str]] | None = None
        self.t0 = time.perf_counter()
        if device.type != "cuda" or not enabled():
            return
        try:
            from roofline.kernels.parallel_compile import ParallelCompiler
        except ImportError:  # no Triton: nothing to compile
            return
        self.compiler = ParallelCompiler(num_threads)
        self.compiler.prepare()
        self.manifest = manifest_path(key, device)
        self.recorded = read_manifest(self.manifest)
        if self.recorded is not None:  # a start-up like this one ran before: load what it found
            self.compiler.preload(self.recorded, _device_index(device))

    @classmethod
    def begin(cls, args: Any, device: torch.device, *configs: Any) -> StartupCompiles:
        """For ``LLMEngine``: its ``EngineArgs`` and resolved configs are the key; nothing is
        done for a tensor-parallel engine (its workers start their own runners)."""
        if args.tensor_parallel_size != 1 or args.distributed_executor_backend is not None:
            device = torch.device("cpu")  # the no-op
        return cls(device, (repr(args), *map(repr, configs)))

    def run(self, runner: ModelRunner, graphs: bool) -> CompileStats | None:
        """Compile, in parallel, every Triton kernel ``runner.warmup()`` (and with ``graphs``
        ``runner.capture_cuda_graphs()``) will launch. None when it does not apply (not CUDA,
        no Triton, a model that does not qualify, turned off, or already run)."""
        compiler, self.compiler = self.compiler, None
        if compiler is None:
            return None
        dry = self.recorded is None and qualifies(runner.model)
        t_dry = time.perf_counter()
        stats = None
        try:
            if dry:
                with compiler.dry_run(), eager_graph_capture(runner.model):
                    runner.warmup()
                    if graphs:
                        runner.capture_cuda_graphs()
            t_dry = time.perf_counter() - t_dry
            # kernels still compiling are waited for at their first launch in the warm-up
            stats = compiler.finish(wait=False)
        except Exception:  # noqa: BLE001 - the start-up that follows compiles what is missing
            logger.warning("parallel compile failed; compiling at first launch", exc_info=True)
            return None
        finally:
            _drop_graphs(runner)
            compiler.close(wait=stats is None)
            torch.cuda.synchronize(runner.device)
        if dry and stats.num_failed == 0:
            write_manifest(self.manifest, compiler.specializations)
        logger.info(
            "%s %d kernel specialisations on %d threads, %.2f s since the engine began (dry "
            "run %.2f s; %d still compiling, %d failed: left to their first launch)",
            "compiled" if dry else "loaded", stats.num_kernels, compiler.num_threads,
            time.perf_counter() - self.t0, t_dry if dry else 0.0, stats.num_deferred,
            stats.num_failed,
        )  # fmt: skip
        return stats


# ------------------------------------------------------------------ the manifest (warm starts)
# After a dry run, the specialisations it found are written beside Triton's cache, under a key
# of everything that decides them; a later start with the same key loads them on the pool
# without a dry run (from the disk cache, or compiled if it was emptied). Anything the manifest
# misses compiles at its first launch, as without it.
_KEY_SOURCES = ("kernels", "layers", "attention", "worker", "models", "quantization")


def manifest_path(key: tuple, device: torch.device) -> Path | None:
    """Where the manifest of a start-up keyed by ``key`` lives (None: no Triton cache)."""
    try:
        import triton
        from triton import knobs

        cache_dir = knobs.cache.dir
    except (ImportError, AttributeError):
        return None
    if not cache_dir:
        return None
    digest = hashlib.sha256()
    for part in (
        *key, torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
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
    """``torch.cuda.CUDAGraph`` during a dry run: there is nothing to replay."""

    def pool(self) -> None:
        return None

    def replay(self) -> None:
        return None

    def reset(self) -> None:
        return None


@contextlib.contextmanager
def eager_graph_capture(model: torch.nn.Module | None = None) -> Iterator[None]:
    """For the length of the block, capture code makes stand-in graphs and the code under
    ``torch.cuda.graph`` runs eagerly (only for a dry run: nothing can be replayed). With
    ``model``: a forward under a stand-in capture over the same input buffers as the forward
    just before it (every capture loop runs one eager forward, then captures the same one)
    returns that forward's output instead of running again, which would launch nothing new."""
    state: dict[str, Any] = {"capturing": False, "last": None}

    @contextlib.contextmanager
    def capture(graph: Any, pool: Any = None, **_: Any) -> Iterator[None]:
        state["capturing"] = True
        try:
            yield
        finally:
            state["capturing"] = False

    if model is not None:
        original = model.forward

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
            key = (input_ids.data_ptr(), input_ids.shape, positions.data_ptr())
            last = state["last"]
            if state["capturing"] and last is not None and last[0] == key:
                return last[1]
            out = original(input_ids, positions, ctx)
            state["last"] = (key, out)
            return out

        model.forward = forward
    cuda = torch.cuda
    saved = cuda.CUDAGraph, cuda.graph, cuda.graph_pool_handle
    cuda.CUDAGraph, cuda.graph, cuda.graph_pool_handle = _EagerGraph, capture, _no_pool
    try:
        yield
    finally:
        cuda.CUDAGraph, cuda.graph, cuda.graph_pool_handle = saved
        if model is not None:
            del model.forward
            state["last"] = None


def _no_pool() -> None:
    return None
