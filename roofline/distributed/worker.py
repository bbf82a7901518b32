"""A tensor-parallel worker: one per rank, in its own process (``mp``) or Ray actor (``ray``).

It joins the group, builds a :class:`ModelRunner` over its shard (weights read as slices, a KV
pool of its KV heads), warms up and captures its decode graphs like the in-process runner, and
then executes the engine's step messages in order. Every rank runs every step (the collectives
inside the forward keep them in lock-step); rank 0 alone samples and replies with the sampled
ids. While a step runs on the device the worker already takes the next message, so with async
scheduling the device never waits for a worker's Python either.
"""

from __future__ import annotations

import logging
import os
import pickle
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from roofline.config import CacheConfig, ModelConfig, SchedulerConfig
from roofline.distributed.loader import iter_dummy_sharded, iter_sharded_weights
from roofline.distributed.messages import StepUnpacker
from roofline.distributed.parallel_state import NO_MULTICAST_ENV, destroy_parallel, init_parallel
from roofline.distributed.sharding import ShardLayout
from roofline.models.weights import ModelSource
from roofline.quantization.base import QuantizationConfig
from roofline.worker.model_runner import ModelRunner, StepHandle

logger = logging.getLogger(__name__)

SHUTDOWN = b"shutdown"
"""The message that ends a worker's loop."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard (picklable)."""

    source: ModelSource
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_type: str
    """``cuda`` or ``cpu``; the GPU index comes from the rank (mp) or Ray."""
    dtype: torch.dtype
    dummy: bool
    seed: int
    attention_backend: str
    enforce_eager: bool
    quant_config: QuantizationConfig | None = None
    """The model's quantization (its methods slice their own tensors where they must)."""
    enable_expert_parallel: bool = False
    """MoE layers: whole experts per rank (``distributed/expert_parallel.py``)."""
    expert_parallel_dispatch: str = "replicated"
    """``replicated`` or ``all_to_all`` (``ROOFLINE_EP_DISPATCH`` in the engine's process)."""


class Worker:
    def __init__(
        self, rank: int, world_size: int, init_method: str, spec: WorkerSpec, device_index: int
    ) -> None:
        os.environ.update(NO_MULTICAST_ENV)
        from roofline.engine.llm_engine import _make_backend

        device = torch.device(spec.device_type, device_index if spec.device_type == "cuda" else 0)
        if device.type == "cpu":
            device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        self.rank = rank
        self.parallel = init_parallel(rank, world_size, init_method, device)
        self.parallel.expert_parallel = spec.enable_expert_parallel
        self.parallel.expert_parallel_dispatch = spec.expert_parallel_dispatch
        cfg = spec.model_config
        layout = ShardLayout.of(cfg, rank, world_size, spec.enable_expert_parallel)
        if spec.dummy:
            weights = iter_dummy_sharded(cfg, spec.seed, spec.dtype, device, layout)
        else:
            weights = iter_sharded_weights(spec.source, cfg, layout, spec.quant_config)
        self.runner = ModelRunner(
            cfg,
            spec.cache_config,
            spec.scheduler_config,
            device,
            spec.dtype,
            weights=weights,
            seed=spec.seed,
            attention_backend=_make_backend(spec.attention_backend, device),
            quant_config=spec.quant_config,
            parallel=self.parallel,
        )
        self.runner.warmup()
        if device.type == "cuda" and not spec.enforce_eager:
            self.runner.capture_cuda_graphs()
        self.unpacker = StepUnpacker(spec.cache_config.page_size)

    @property
    def num_pages(self) -> int:
        return self.runner.num_pages

    @torch.inference_mode()
    def execute(self, payload: bytes) -> StepHandle | None:
        """Launch one step message (None when it carries no batch)."""
        msg, batch = self.unpacker.unpack(payload)
        runner = self.runner
        if msg.finished:
            runner.sampler.remove(msg.finished)
        if batch is None:
            return None
        tables = runner.block_tables
        while tables.table.shape[0] <= max(batch.table_rows):  # the engine's rows grew
            tables.table = torch.cat([tables.table, torch.zeros_like(tables.table)])
        return runner.launch_batch(batch, msg.prompt_logprob_rows or None)

    def reply(self, handle: StepHandle | None) -> bytes:
        """Rank 0's answer to a step: its sampled ids and logprobs, in row order."""
        if handle is None:
            return pickle.dumps(([], [], {}))
        return pickle.dumps((handle.token_ids(), handle.logprobs(), handle.prompt_logprobs()))

    def serve(self, conn: Connection) -> None:
        """Execute messages from ``conn`` until SHUTDOWN or EOF (the engine went away).
        A step's reply waits while another message is already there to launch."""
        in_flight: deque[StepHandle | None] = deque()
        while True:
            if in_flight and (in_flight[0] is None or in_flight[0].ready()):
                handle = in_flight.popleft()
                if self.rank == 0:
                    conn.send_bytes(self.reply(handle))
                continue
            if not conn.poll(None if not in_flight else 0.0001):
                continue
            try:
                payload = conn.recv_bytes()
            except EOFError:
                return
            if payload == SHUTDOWN:
                return
            in_flight.append(self.execute(payload))

    def close(self) -> None:
        destroy_parallel()


def run_worker(
    rank: int,
    world_size: int,
    init_method: str,
    spec: WorkerSpec,
    conn: Connection,
) -> None:
    """The ``mp`` worker process: build, report ready (or the error), serve, exit."""
    logging.basicConfig(level=logging.WARNING)
    try:
        worker = Worker(rank, world_size, init_method, spec, device_index=rank)
        conn.send_bytes(pickle.dumps(("ready", worker.num_pages)))
    except BaseException:  # noqa: BLE001 - reported to the engine, then the process ends
        _report(conn, rank)
        return
    try:
        worker.serve(conn)
    except BaseException:  # noqa: BLE001
        _report(conn, rank)
    finally:
        worker.close()


def _report(conn: Connection, rank: int) -> None:
    text = f"tensor-parallel worker rank {rank} failed:\n{traceback.format_exc()}"
    try:
        conn.send_bytes(pickle.dumps(("error", text)))
    except OSError:
        pass
