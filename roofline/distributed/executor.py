"""Executors: who runs the model for the engine.

The engine talks to one object with the runner's surface (``num_pages``, ``launch(sched_out)
-> handle``, ``handle.result()``, ``shutdown()``). With ``tensor_parallel_size == 1`` that
object is the in-process :class:`ModelRunner` itself: today's path, nothing added to a step.
With more ranks it is a :class:`MultiprocExecutor` (``mp``: one spawned worker process per
rank, each with its GPU, or gloo on the CPU) or a ``RayExecutor`` (``ray``, see
``ray_executor.py``): the scheduler and the KV manager stay in the engine process, which builds
each step's host batch once (``messages.StepPacker``) and sends the same bytes to every worker;
rank 0 replies with the sampled ids.

Failures: a worker that dies (its process sentinel fires) or reports an exception makes the
pending ``result()`` raise :class:`WorkerError` at once, naming the rank; the executor then
stops the other workers (terminate, then kill: no orphans) and every later call raises the same
error. The engine's callers see the step raise: ``LLM.generate`` aborts its requests, the
server's engine core reports ``CoreFailed`` (requests fail, ``/health`` answers 503).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import socket
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import torch

from roofline.core.outputs import ModelRunnerOutput, SchedulerOutput
from roofline.distributed.messages import StepPacker
from roofline.distributed.parallel_state import NO_MULTICAST_ENV
from roofline.distributed.worker import SHUTDOWN, WorkerSpec, run_worker
from roofline.request import Request
from roofline.worker.block_table import BlockTables
from roofline.worker.host_batch import HostBatch
from roofline.worker.prompt_logprobs import prompt_logprob_rows

logger = logging.getLogger(__name__)

BACKENDS = ("mp", "ray")
START_TIMEOUT_S = 900.0
"""Longest wait for the workers to load and warm up."""
STOP_TIMEOUT_S = 5.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot go on."""


class Executor(Protocol):
    num_pages: int

    def launch(
        self, sched_out: SchedulerOutput, prompt_logprobs: bool = False, mask_logits: Any = None
    ) -> Any: ...

    def shutdown(self) -> None: ...


class RemoteStep:
    """A step sent to the workers; ``result()`` waits for rank 0's sampled ids."""

    def __init__(self, executor: _RemoteExecutor, requests: list[Request], sent: bool) -> None:
        self._executor = executor
        self._requests = requests
        self._sent = sent

    def result(self) -> ModelRunnerOutput:
        if not self._sent:
            return ModelRunnerOutput(sampled_token_ids={})
        token_ids, logprobs, prompt_lps = self._executor.receive()
        requests = self._requests
        sampled = {r.request_id: t for r, t in zip(requests, token_ids)}
        lps = {r.request_id: lp for r, lp in zip(requests, logprobs) if lp is not None}
        return ModelRunnerOutput(
            sampled_token_ids=sampled, logprobs=lps, prompt_logprobs=prompt_lps
        )


class _RemoteExecutor:
    """What the ``mp`` and ``ray`` executors share: the host-side block-table rows and the
    step packing. Subclasses send bytes to every worker and receive rank 0's replies."""

    def __init__(self, spec: WorkerSpec, world_size: int) -> None:
        self.spec = spec
        self.world_size = world_size
        sc = spec.scheduler_config
        max_blocks = -(-sc.max_model_len // spec.cache_config.page_size)
        # Row bookkeeping only (its small table tensor is never read): the workers apply the
        # updates it records to their own device tables.
        self.block_tables = BlockTables(sc.max_num_seqs, max_blocks, torch.device("cpu"))
        self.packer = StepPacker()
        self.error: str | None = None
        self.num_pages = 0
        self.dtype = spec.dtype
        self.device = torch.device(spec.device_type)
        """Rank 0's kind of device and the dtype (what benchmarks read off a runner)."""

    def launch(
        self,
        sched_out: SchedulerOutput,
        prompt_logprobs: bool = False,
        mask_logits: Any = None,
    ) -> RemoteStep:
        """``prompt_logprobs``: some request in flight asks for them; the step's rows that
        predict prompt tokens go to every worker (all ranks take part in the LM head), rank 0
        replies with them. ``mask_logits`` (structured outputs) is the single-process runner's
        option: the engine refuses such requests under tensor parallelism."""
        if mask_logits is not None:
            raise ValueError("structured outputs need tensor_parallel_size 1")
        self._check()
        finished, preempted = sched_out.finished_request_ids, sched_out.preempted_request_ids
        if finished or preempted:
            self.block_tables.drop(list(finished) + list(preempted))
        if sched_out.is_empty and not finished:
            return RemoteStep(self, [], sent=False)
        batch = None
        if not sched_out.is_empty:
            batch = HostBatch.build(sched_out, self.spec.cache_config.page_size, self.block_tables)
        rows = prompt_logprob_rows(sched_out) if prompt_logprobs else None
        payload = self.packer.pack(batch, list(finished), list(preempted), rows)
        self.send(payload)
        return RemoteStep(self, batch.sample_requests if batch else [], sent=True)

    def _check(self) -> None:
        if self.error is not None:
            raise WorkerError(self.error)

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
            logger.error("%s", message)
        self.shutdown()
        raise WorkerError(message)

    # subclasses
    def send(self, payload: bytes) -> None:
        raise NotImplementedError

    def receive(self) -> tuple[list[int], list, dict]:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class MultiprocExecutor(_RemoteExecutor):
    """One spawned process per rank, a pipe to each (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, world_size: int) -> None:
        super().__init__(spec, world_size)
        if spec.device_type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(
                f"tensor_parallel_size={world_size} needs {world_size} GPUs, "
                f"{torch.cuda.device_count()} visible"
            )
        ctx = _worker_context()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        saved = {k: os.environ.get(k) for k in NO_MULTICAST_ENV}
        _environ_set(NO_MULTICAST_ENV)  # inherited by the spawned workers
        # The server's engine core is a daemon process, which multiprocessing forbids to have
        # children; the workers are ours to stop (finalizer, EOF on their pipe when we die).
        config = mp.current_process()._config  # noqa: SLF001
        was_daemon = config.pop("daemon", None)
        try:
            for rank in range(world_size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=run_worker,
                    args=(rank, world_size, init_method, spec, theirs),
                    name=f"roofline-tp{rank}",
                    daemon=True,
                )
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)
        finally:
            _environ_set(saved)
            if was_daemon is not None:
                config["daemon"] = was_daemon
        self._graceful = [True]
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._graceful)
        self.num_pages = self._expect_ready()

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.procs]

    def _expect_ready(self) -> int:
        """Wait until every rank has built its shard; the smallest KV pool of them."""
        pages: dict[int, int] = {}
        ranks = {c: r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(pages) < self.world_size:
            waiting = [c for c, r in ranks.items() if r not in pages]
            ready = wait(waiting + list(sentinels), START_TIMEOUT_S)
            if not ready:
                self.fail(f"tensor-parallel workers not ready after {START_TIMEOUT_S} s")
            for c in ready:
                if c in ranks:
                    try:
                        kind, value = pickle.loads(c.recv_bytes())
                    except (EOFError, OSError):
                        continue  # its sentinel tells
                    if kind != "ready":
                        self.fail(value)
                    pages[ranks[c]] = int(value)
            for s in ready:
                if s in sentinels and sentinels[s] not in pages:
                    self._died(sentinels[s])
        return min(pages.values())

    def _worker_failed(self, text: str) -> None:
        """A worker reported an exception: blame a dead peer if there is one (a rank whose
        peer was killed sees only a broken connection), else the exception itself."""
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        dead = wait(list(sentinels), 1.0)
        if dead:
            self._died(sentinels[dead[0]], text.splitlines()[0])
        self.fail(text)

    def _died(self, rank: int, then: str = "") -> None:
        proc = self.procs[rank]
        proc.join(0.1)
        also = f"; then {then}" if then else ""
        self.fail(
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) died "
            f"(exit code {proc.exitcode}){also}"
        )

    def _recv_from(self, rank: int, timeout_s: float | None) -> tuple[str, Any]:
        """The next message of ``rank`` (rank 0's step replies; the other ranks send only
        errors); fails the executor if any worker dies or reports an error first."""
        conn = self.conns[rank]
        others = {c: r for r, c in enumerate(self.conns) if r != rank}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while True:
            ready = wait([conn, *others, *sentinels], timeout_s)
            if not ready:
                self.fail(f"tensor-parallel worker rank {rank} sent nothing in {timeout_s} s")
            if conn in ready:
                try:
                    return pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    ready = [self.procs[rank].sentinel]
            for c in ready:
                if c in others:
                    try:
                        msg = pickle.loads(c.recv_bytes())
                    except (EOFError, OSError):
                        continue  # its sentinel says more
                    if msg[0] == "error":
                        self._worker_failed(msg[1])
            for s in ready:
                if s in sentinels:
                    self._died(sentinels[s])

    def fail(self, message: str) -> None:
        self._graceful[0] = False  # the others may sit in a collective: no goodbyes
        super().fail(message)

    def check_health(self) -> None:
        """Raise ``WorkerError`` if the executor failed or a worker process is gone (the
        server's core calls this while idle, so ``/health`` notices without a request)."""
        self._check()
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._died(rank)

    def send(self, payload: bytes) -> None:
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                self.fail(f"tensor-parallel worker rank {rank} is gone (its pipe is closed)")

    def receive(self) -> tuple[list[int], list, dict]:
        self._check()
        msg = self._recv_from(0, None)
        if msg[0] == "error":
            self._worker_failed(msg[1])
        return msg

    def shutdown(self) -> None:
        self._finalizer()


def _stop(procs: list[BaseProcess], conns: list[Connection], graceful: list[bool]) -> None:
    """Stop the workers: SHUTDOWN and a join when ``graceful[0]``, then terminate and kill."""
    if graceful[0]:
        for conn in conns:
            try:
                conn.send_bytes(SHUTDOWN)
            except OSError:
                pass
        for proc in procs:
            proc.join(STOP_TIMEOUT_S)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


def _worker_context() -> mp.context.BaseContext:
    """``forkserver`` where there is one: the server imports torch and roofline once, and each
    worker forks from it (no CUDA in the server, so this is as safe as ``spawn``, and later
    executors of the same process start in a blink); ``spawn`` elsewhere."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["roofline.distributed.worker"])
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environ_set(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def make_executor(spec: WorkerSpec, world_size: int, backend: str) -> _RemoteExecutor:
    if backend == "mp":
        return MultiprocExecutor(spec, world_size)
    if backend == "ray":
        from roofline.distributed.ray_executor import RayExecutor

        return RayExecutor(spec, world_size)
    raise ValueError(f"distributed_executor_backend must be one of {BACKENDS}, got {backend!r}")


def build_executor(
    args, source, model_config, device: torch.device, dtype, dummy: bool, quant_config=None
):
    """The engine's executor for ``args.tensor_parallel_size > 1`` (validated first, before
    any worker starts)."""
    from roofline.distributed.expert_parallel import resolve_dispatch_name
    from roofline.distributed.sharding import check_shardable

    world_size = args.tensor_parallel_size
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    backend = args.distributed_executor_backend or "mp"
    if backend not in BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {BACKENDS}, got {backend!r}")
    check_shardable(model_config, world_size, args.enable_expert_parallel)
    from roofline.quantization.registry import check_tensor_parallel

    check_tensor_parallel(quant_config, model_config, world_size)
    if source.kind == "gguf" and not dummy:
        logger.warning("GGUF under tensor parallelism: each rank dequantizes whole tensors")
    spec = WorkerSpec(
        source=source,
        model_config=model_config,
        cache_config=args.cache_config(),
        scheduler_config=args.scheduler_config(model_config, device),
        device_type=device.type,
        dtype=dtype,
        dummy=dummy,
        seed=args.seed,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        quant_config=quant_config,
        enable_expert_parallel=args.enable_expert_parallel,
        expert_parallel_dispatch=resolve_dispatch_name(),
    )
    return make_executor(spec, world_size, backend)
