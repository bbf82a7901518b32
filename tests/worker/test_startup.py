"""Start-up compiles on a thread pool (``kernels/parallel_compile.py``, ``worker/startup.py``).

No GPU here: a stand-in Triton driver reports an sm_90 device, so kernel launches on CPU tensors
go through Triton's real launch path (binding, specialisation, cache hooks) and compile real
sm_90 code on the pool; the launches themselves are skipped by the dry run, which is the point.
Those tests run in a fresh process (``test_compiles_in_a_fresh_process``): once Triton's CPU
interpreter has run a kernel in a process (``tests/kernels`` does), the GPU compiler's code
generation there fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from roofline.kernels import count_jit_compiles  # noqa: E402
from roofline.kernels.parallel_compile import NULL_KERNEL, ParallelCompiler  # noqa: E402
from roofline.worker import startup  # noqa: E402


def _scale(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * factor, mask=mask)


_scale = JITFunction(_scale)  # compiled, whatever TRITON_INTERPRET says

_CHILD = os.environ.get("ROOFLINE_STARTUP_TEST_CHILD") == "1"
compiles = pytest.mark.skipif(not _CHILD, reason="runs in test_compiles_in_a_fresh_process")


def test_compiles_in_a_fresh_process():
    if _CHILD:
        pytest.skip("this is the fresh process")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ROOFLINE_STARTUP_TEST_CHILD"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed, 1 skipped" in done.stdout  # everything but this test ran there


class _Launcher:
    built: list[str] = []

    def __init__(self, src, metadata) -> None:  # noqa: ANN001
        _Launcher.built.append(metadata.name)


class _FakeDriver:
    """What Triton's launch path asks the active driver, for an sm_90 device 0."""

    launcher_cls = _Launcher

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    previous = driver._active
    driver.set_active(_FakeDriver())
    _Launcher.built.clear()
    _scale.device_caches.clear()
    try:
        yield _scale
    finally:
        driver._active = previous


@compiles
def test_dry_run_compiles_each_specialisation_once_and_installs_it(fake_gpu):
    kernel = fake_gpu
    x = torch.ones(64)
    out = torch.full((64,), 7.0)
    compiler = ParallelCompiler(num_threads=2)
    with count_jit_compiles() as compiled:
        with compiler.dry_run():
            for block in (16, 32, 16, 32, 16):  # two specialisations, launched five times
                kernel[(4,)](x, out, 64, 2.0, BLOCK=block)
            cache = kernel.device_caches[0][0]
            assert len(cache) == 2 and all(k is NULL_KERNEL for k in cache.values())
        assert compiled == []  # nothing is compiled before finish()
        stats = compiler.finish()
    compiler.close()
    assert torch.equal(out, torch.full((64,), 7.0))  # no launch ran
    assert stats.num_kernels == 2 and stats.num_failed == 0
    assert compiled == ["_scale", "_scale"]  # the post-compile hook saw both, once each
    kernels = list(kernel.device_caches[0][0].values())
    assert sorted(k.metadata.num_warps for k in kernels) == [4, 4]
    assert all(k is not NULL_KERNEL and "cubin" in k.asm for k in kernels)
    assert sorted(_Launcher.built) == ["_scale", "_scale"]  # launchers built on the pool
    # The same launches outside the dry run find the kernels: no compile, no hook.
    with count_jit_compiles() as compiled_again:
        for block in (16, 32):
            key_count = len(kernel.device_caches[0][0])
            with pytest.raises(Exception):  # noqa: B017 - the fake driver cannot launch
                kernel[(4,)](x, out, 64, 2.0, BLOCK=block)
            assert len(kernel.device_caches[0][0]) == key_count
    assert compiled_again == []


@compiles
def test_failed_compile_is_left_to_the_real_launch(fake_gpu):
    kernel = fake_gpu
    x, out = torch.ones(64), torch.zeros(64)
    compiler = ParallelCompiler(num_threads=1)
    with compiler.dry_run():
        kernel[(1,)](x, out, 64, 2.0, BLOCK=48)  # not a power of two: tl.arange refuses it
    stats = compiler.finish()
    compiler.close()
    assert stats.num_kernels == 1 and stats.num_failed == 1
    assert kernel.device_caches[0][0] == {}  # no stand-in left: the real launch compiles


@compiles
def test_other_threads_compile_as_usual_during_a_dry_run(fake_gpu):
    kernel = fake_gpu
    x, out = torch.ones(64), torch.zeros(64)
    compiler = ParallelCompiler(num_threads=1)
    errors: list[BaseException] = []

    def launch() -> None:
        try:
            kernel[(4,)](x, out, 64, 2.0, BLOCK=16)
        except BaseException as e:  # noqa: BLE001 - the fake driver cannot launch
            errors.append(e)

    with compiler.dry_run():
        t = threading.Thread(target=launch)
        t.start()
        t.join()
    compiler.finish()
    compiler.close()
    assert compiler.stats.num_kernels == 0  # the other thread's launch was not intercepted
    (compiled,) = kernel.device_caches[0][0].values()
    assert compiled is not NULL_KERNEL and len(errors) == 1


def test_eager_graph_capture_runs_the_captured_code_and_restores_torch():
    saved = torch.cuda.CUDAGraph, torch.cuda.graph
    ran = []
    with startup.eager_graph_capture():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=None):
            ran.append(1)
        assert graph.pool() is None and torch.cuda.graph_pool_handle() is None
        graph.replay()
    assert ran == [1]
    assert (torch.cuda.CUDAGraph, torch.cuda.graph) == saved


def test_eager_capture_skips_the_forward_it_just_ran():
    class Model(torch.nn.Module):
        calls = 0

        def forward(self, input_ids, positions, ctx):  # noqa: ANN001
            Model.calls += 1
            return input_ids * 2

    model = Model()
    ids, pos = torch.arange(8), torch.arange(8)
    with startup.eager_graph_capture(model):
        for bs in (8, 4):  # a capture loop: an eager forward, then the same one captured
            warm = model(ids[:bs], pos[:bs], None)
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                captured = model(ids[:bs], pos[:bs], None)
            assert captured is warm
        with torch.cuda.graph(torch.cuda.CUDAGraph()):  # other buffers: it runs
            model(ids[1:5], pos[1:5], None)
        model(ids[:4], pos[:4], None)  # outside a capture: it runs
    assert Model.calls == 4
    assert "forward" not in vars(model)  # the class's forward again


def test_precompile_does_not_apply_off_cuda_or_to_moe(monkeypatch):
    from types import SimpleNamespace

    from roofline.layers.moe import FusedMoE

    dense = torch.nn.Sequential(torch.nn.Linear(2, 2))
    cpu_runner = SimpleNamespace(device=torch.device("cpu"), model=dense)
    compiles = startup.StartupCompiles(torch.device("cpu"), ("key",))
    assert compiles.compiler is None and compiles.run(cpu_runner, graphs=True) is None
    assert startup.qualifies(dense)

    class _Experts(FusedMoE):
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)  # the type is what counts, not the weights

    assert not startup.qualifies(torch.nn.Sequential(torch.nn.Linear(2, 2), _Experts()))
    monkeypatch.setenv("ROOFLINE_PARALLEL_COMPILE", "0")
    assert not startup.enabled()


@compiles
def test_manifest_round_trip_preloads_what_the_dry_run_found(fake_gpu, tmp_path):
    kernel = fake_gpu
    x, out = torch.ones(64), torch.zeros(64)
    compiler = ParallelCompiler(num_threads=2)
    with compiler.dry_run():
        for block in (16, 32, 16):
            kernel[(4,)](x, out, 64, 2.0, BLOCK=block)
    compiler.finish()
    compiler.close()
    keys = sorted(kernel.device_caches[0][0])
    path = tmp_path / "m" / "key.json"
    startup.write_manifest(path, compiler.specializations)
    entries = startup.read_manifest(path)
    assert entries is not None and len(entries) == 2
    assert {(m, n) for m, n, _ in entries} == {(_scale.fn.__module__, "_scale")}
    # A later start: nothing in memory, the manifest loads both (disk hits) on the pool.
    kernel.device_caches.clear()
    later = ParallelCompiler(num_threads=2)
    later.preload(entries + [("no.such.module", "_k", "{}")], device=0)
    stats = later.finish()
    later.close()
    assert stats.num_kernels == 3 and stats.num_failed == 1  # the stale entry is left out
    assert sorted(kernel.device_caches[0][0]) == keys
    assert startup.read_manifest(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text("not json")
    assert startup.read_manifest(tmp_path / "bad.json") is None


@compiles
def test_concurrent_preloads_of_one_kernel_keep_every_specialisation(fake_gpu):
    """Two pool threads preloading the same kernel into an empty cache: each used to build the
    kernel's ``device_caches`` entry (a defaultdict with a Python factory) and the later replaced
    the earlier with its kernel in it. Thread switches every microsecond make that near certain
    (about 60% of rounds lost one before the entry was created ahead of the pool)."""
    kernel = fake_gpu
    x, out = torch.ones(64), torch.zeros(64)
    compiler = ParallelCompiler(num_threads=2)
    with compiler.dry_run():
        for block in (16, 32):
            kernel[(4,)](x, out, 64, 2.0, BLOCK=block)
    compiler.finish()
    compiler.close()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(30):
            kernel.device_caches.clear()
            later = ParallelCompiler(num_threads=2)
            later.preload(compiler.specializations, device=0)
            stats = later.finish()
            later.close()
            assert stats.num_failed == 0 and len(kernel.device_caches[0][0]) == 2
    finally:
        sys.setswitchinterval(interval)


@compiles
def test_startup_compiles_dry_run_then_manifest(fake_gpu, monkeypatch):
    """The engine's path: a dry run of warm-up and capture (graphs eager) compiles on the pool
    and writes the manifest; a second start-up with the same key preloads without a dry run."""
    for name, value in (("synchronize", None), ("get_device_name", "fake"),
                        ("get_device_capability", (9, 0))):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, lambda *a, _v=value: _v)
    kernel = fake_gpu
    x, out = torch.ones(64), torch.zeros(64)

    class Runner:
        device = torch.device("cuda", 0)
        model = torch.nn.Linear(2, 2)
        graphs = cascade_graphs = mixed = None
        warmups = 0

        def warmup(self) -> None:
            self.warmups += 1
            kernel[(4,)](x, out, 64, 2.0, BLOCK=16)

        def capture_cuda_graphs(self) -> None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=None):
                kernel[(4,)](x, out, 64, 2.0, BLOCK=32)
            self.graphs = graph

    runner = Runner()
    first = startup.StartupCompiles(runner.device, ("same key",), num_threads=2)
    assert first.recorded is None and first.manifest is not None
    stats = first.run(runner, graphs=True)
    assert stats is not None and stats.num_kernels == 2 and stats.num_failed == 0
    assert runner.warmups == 1 and runner.graphs is None  # the dry run's stand-in is dropped
    assert first.manifest.exists() and first.run(runner, graphs=True) is None  # once only
    kernel.device_caches.clear()
    second = startup.StartupCompiles(runner.device, ("same key",), num_threads=2)
    assert second.recorded is not None and len(second.recorded) == 2
    stats = second.run(runner, graphs=True)
    assert stats.num_kernels == 2 and runner.warmups == 1  # preloaded, no dry run
    assert len(kernel.device_caches[0][0]) == 2
    other = startup.StartupCompiles(runner.device, ("another key",), num_threads=1)
    assert other.recorded is None
    other.compiler.close()


@compiles
def test_unfinished_compiles_are_waited_for_at_their_first_launch(fake_gpu):
    from roofline.kernels.parallel_compile import _Deferred

    kernel = fake_gpu
    x, out = torch.ones(64), torch.zeros(64)
    compiler = ParallelCompiler(num_threads=1)
    gate = threading.Event()
    compiler._pool.submit(gate.wait)  # the pool's one thread is busy: nothing compiles yet
    with compiler.dry_run():
        kernel[(4,)](x, out, 64, 2.0, BLOCK=16)
        kernel[(1,)](x, out, 64, 2.0, BLOCK=48)  # fails to compile (not a power of two)
    stats = compiler.finish(wait=False)
    compiler.close(wait=False)
    assert stats.num_deferred == 2 and stats.num_failed == 0
    good, bad = kernel.device_caches[0][0].values()
    assert isinstance(good, _Deferred) and isinstance(bad, _Deferred)
    gate.set()
    with count_jit_compiles() as compiled:
        compiled_kernel = good.result()  # waits for the pool, installs the kernel
    assert compiled == ["_scale"] and "cubin" in compiled_kernel.asm
    assert list(kernel.device_caches[0][0].values())[0] is compiled_kernel
    with pytest.raises(Exception, match="arange"):  # compiled again here: the same error
        bad.result()
