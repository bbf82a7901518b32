"""Triton compiles of many kernel specialisations at once: a dry run records, a thread pool builds.

A cold start compiles every specialisation the engine's warm-up and graph capture launch, one
after the other on the launching thread: per kernel the Triton pipeline (mostly LLVM and
``ptxas``, a subprocess) and, at its first launch, the C launcher stub for its signature (``gcc``,
another subprocess). Both release the GIL, so they parallelise over threads. ``ParallelCompiler``
is the mechanism: while its ``dry_run()`` context is open, a launch that would compile is not
launched; its specialisation (the arguments Triton's ``jit_cache_hook`` receives, exactly what the
launch would have compiled) is submitted to a pool of threads that compiles it and builds its
launcher, and a no-op stand-in sits in the kernel's in-memory cache so later launches of the same
specialisation cost only their binding. ``finish()`` puts the compiled kernels in their caches
(Triton's ``jit_post_compile_hook`` is called for each, as a compile would), either waiting for
the pool or leaving a deferred entry for each kernel still compiling, which its first launch
waits for; the real launches that follow compile nothing. A specialisation whose compile failed
is left out: the real launch compiles it again and raises its error where it always did.

A dry run computes nothing with Triton: outputs of skipped kernels hold whatever memory they got.
Run under it only code whose control flow and indexing do not depend on Triton kernels' outputs
(``worker/startup.py`` decides which models qualify).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


class _NullKernel:
    """Stands in a kernel cache during a dry run: launching it does nothing."""

    function = None
    packed_metadata = None

    def launch_metadata(self, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        return None


NULL_KERNEL = _NullKernel()


@dataclass
class _Pending:
    jit: Any  # triton.runtime.jit.JITFunction
    device: int
    key: str
    compile_args: dict
    future: Future


@dataclass
class CompileStats:
    """What one dry run compiled."""

    num_kernels: int = 0
    """Specialisations submitted to the pool."""
    num_failed: int = 0
    """Of those, the ones whose compile raised (left to the real launch)."""
    wait_s: float = 0.0
    """Seconds ``finish()`` waited for the pool after the dry run ended."""
    num_deferred: int = 0
    """Kernels still compiling when ``finish(wait=False)`` returned (their first launch
    waits)."""
    names: list[str] = field(default_factory=list)


def default_num_threads() -> int:
    """Compile threads: the CPUs this process may run on (each compile spends most of its time
    in LLVM and in ``ptxas``/``gcc`` subprocesses)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 32))


class ParallelCompiler:
    """A pool of compile threads, fed by dry runs (``dry_run``) or by recorded
    specialisations (``preload``); ``finish`` waits and installs, ``close`` stops the pool."""

    def __init__(self, num_threads: int | None = None) -> None:
        self.num_threads = num_threads or default_num_threads()
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="triton-compile")
        self._pending: list[_Pending] = []
        self._thread: int | None = None
        self._lock = threading.Lock()
        self._preloads: list[Future] = []
        self._setup: list[Future] = []
        self.stats = CompileStats()
        self.specializations: list[tuple[str, str, str]] = []
        """What the dry runs found: (module, kernel name, Triton's specialization data)."""

    @contextlib.contextmanager
    def dry_run(self) -> Iterator[ParallelCompiler]:
        """Launches on this thread that would compile submit their compile instead and launch
        nothing; launches of kernels already compiled run as usual."""
        from triton import knobs

        previous = knobs.runtime.jit_cache_hook
        self._thread = threading.get_ident()

        def hook(**kwargs: Any) -> bool:
            if threading.get_ident() == self._thread and self._submit(**kwargs):
                return True
            return bool(previous(**kwargs)) if previous is not None else False

        knobs.runtime.jit_cache_hook = hook
        try:
            yield self
        finally:
            knobs.runtime.jit_cache_hook = previous
            self._thread = None

    def _submit(self, *, key: str, fn: Any, compile: dict, **_: Any) -> bool:
        jit = fn.jit_function
        device = compile["device"]
        kernel_cache = jit.device_caches[device][0]
        kernel_cache[key] = NULL_KERNEL  # later dry launches of this specialisation: no-op
        future = self._pool.submit(_compile, jit, device, compile)
        with self._lock:
            self._pending.append(_Pending(jit, device, key, compile, future))
            self.stats.names.append(jit.fn.__name__)
            self.specializations.append(
                (jit.fn.__module__, jit.fn.__name__, compile["specialization_data"])
            )
        return True

    def prepare(self) -> None:
        """Start Triton's one-time set-up on the pool: its active driver (CUDA utilities
        built with ``gcc`` on a cold cache) and the key of its own sources (a hash of the
        compiler library), which the first compile or cache lookup would otherwise compute."""
        with self._lock:
            self._setup.append(self._pool.submit(_prepare))

    def preload(self, specializations: list[tuple[str, str, str]], device: int) -> None:
        """Load (from Triton's disk cache, else compile) recorded specialisations on the pool,
        each into its kernel's in-memory cache: ``(module, kernel name, specialization data)``
        as ``specializations`` lists them after a dry run. Entries that no longer resolve or
        load are counted as failed and left to their first launch."""
        for module, name, spec in specializations:
            _make_binder(module, name, device)
            future = self._pool.submit(_preload, module, name, spec, device)
            with self._lock:
                self._preloads.append(future)

    def finish(self, wait: bool = True) -> CompileStats:
        """Wait for the preloads and install the dry runs' kernels; returns the stats.
        ``wait``: wait for every compile first. Otherwise a kernel still compiling gets a
        deferred entry whose first launch waits for it (compile tails overlap the host work
        that follows; the failure count then covers only what had finished)."""
        t0 = time.perf_counter()
        with self._lock:
            pending, self._pending = self._pending, []
            preloads, self._preloads = self._preloads, []
            setup, self._setup = self._setup, []
        for future in setup:  # a failure here shows again where Triton needs it
            with contextlib.suppress(Exception):
                future.result()
        # preloads install themselves from their threads: one left running would show as a
        # compile in the middle of serving
        for future in preloads:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - its first launch compiles it
                self.stats.num_failed += 1
        self.stats.num_kernels += len(preloads)
        for p in pending:
            if not wait and not p.future.done():
                p.jit.device_caches[p.device][0][p.key] = _Deferred(p)
                self.stats.num_deferred += 1
            elif not _install(p):
                self.stats.num_failed += 1
        self.stats.num_kernels += len(pending)
        self.stats.wait_s += time.perf_counter() - t0
        return self.stats

    def close(self, wait: bool = True) -> None:
        """Drop the stand-ins of anything not finished and stop the pool (``wait=False``:
        compiles that deferred entries wait for go on in the background)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for p in pending:
            p.future.cancel()
            kernel_cache = p.jit.device_caches[p.device][0]
            if kernel_cache.get(p.key) is NULL_KERNEL:
                del kernel_cache[p.key]
        self._pool.shutdown(wait=wait, cancel_futures=wait)


def _install(p: _Pending) -> Any:
    """Put a finished compile's kernel in its cache, as ``JITFunction._do_compile`` would (the
    post-compile hook included); None (and the stand-in removed) if the compile failed."""
    from triton import knobs

    kernel_cache = p.jit.device_caches[p.device][0]
    try:
        kernel, options = p.future.result()
    except Exception:  # noqa: BLE001 - the real launch compiles it again and raises
        entry = kernel_cache.get(p.key)
        if entry is NULL_KERNEL or isinstance(entry, _Deferred):
            del kernel_cache[p.key]
        return None
    kernel_cache[p.key] = kernel
    c = p.compile_args
    p.jit._call_hook(
        knobs.runtime.jit_post_compile_hook, p.key, c["signature"], p.device, c["constants"],
        options, c["configs"], False,
    )  # fmt: skip
    return kernel


class _Deferred:
    """A kernel still compiling on the pool, in its kernel's cache: Triton's launch calls
    ``result()`` (as for its own asynchronous compiles), which waits and installs it; if the
    pool's compile failed, the launching thread compiles it (and raises what that raises)."""

    def __init__(self, pending: _Pending) -> None:
        self.pending = pending

    def result(self) -> Any:
        p = self.pending
        kernel = _install(p)
        if kernel is None:  # compile here, as the launch would have
            c = p.compile_args
            _, _, _, backend, _ = p.jit.device_caches[p.device]
            options = _parse_options(backend, c["specialization_data"])
            kernel = p.jit._do_compile(p.key, c["signature"], p.device, c["constants"], options,
                                       c["configs"][0], False)  # fmt: skip
        return kernel


_KEY_LOCK = threading.Lock()


def _triton_key() -> None:
    """Triton's source key, computed once (threads arriving meanwhile wait for it)."""
    from triton.runtime.cache import triton_key

    with _KEY_LOCK:
        triton_key()


def _prepare() -> None:
    _triton_key()
    from triton.runtime import driver

    driver.active.get_current_target()


def _compile(jit: Any, device: int, compile_args: dict) -> tuple[Any, Any]:
    """What ``JITFunction._do_compile`` does for one specialisation (the arguments its cache hook
    saw), then the launcher stub its first launch would build."""
    _triton_key()
    _, _, target, backend, _ = jit.device_caches[device]
    options = _parse_options(backend, compile_args["specialization_data"])
    src = jit.ASTSource(jit, compile_args["signature"], compile_args["constants"],
                        compile_args["configs"][0])  # fmt: skip
    kernel = jit.compile(src, target=target, options=options.__dict__)
    _build_launcher(kernel)
    return kernel, options


def _parse_options(backend: Any, specialization_data: str) -> Any:
    """The launch's backend options from its specialisation data (as ``JITFunction.preload``
    reads them)."""
    spec = json.loads(specialization_data)
    return backend.parse_options(
        {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    )


def _make_binder(module: str, name: str, device: int) -> None:
    """Create the kernel's per-device cache entry on this thread. ``device_caches`` is a
    ``defaultdict`` whose factory is Python code: two pool threads preloading the same kernel
    into a missing entry would each build one and the later would replace the earlier, losing
    its kernel. An entry that does not resolve is left to ``_preload`` to count as failed."""
    import importlib

    import torch

    try:
        jit = getattr(importlib.import_module(module), name)
        on_device = (
            torch.cuda.device(device) if torch.cuda.is_available() else contextlib.nullcontext()
        )
        with on_device:
            jit.device_caches[device]  # noqa: B018 - the defaultdict creates it
    except Exception:  # noqa: BLE001 - the pool's attempt fails the same way and counts it
        return


def _preload(module: str, name: str, spec: str, device: int) -> None:
    """``JITFunction.preload`` of one recorded specialisation on ``device`` (the pool's threads
    start on device 0), then its launcher."""
    import importlib

    import torch

    _triton_key()
    jit = getattr(importlib.import_module(module), name)
    on_device = torch.cuda.device(device) if torch.cuda.is_available() else contextlib.nullcontext()
    with on_device:
        kernel = jit.preload(spec)
    _build_launcher(kernel)


def _build_launcher(kernel: Any) -> None:
    """Build (and cache on disk) the C launcher of ``kernel``'s signature, which its first
    launch would otherwise build on the launching thread; the launch then loads it."""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - the first launch builds it and reports any error
        pass
