"""The Ray executor (``distributed_executor_backend="ray"``, ``pip install roofline[ray]``): one
actor per rank in a placement group (one bundle per GPU, ``PACK``: one node while it has room,
then the next), ``torch.distributed`` set up between the actors at rank 0's address, and the
same :class:`~roofline.distributed.worker.Worker` inside each actor as in the ``mp`` processes.

It joins the Ray cluster the process already uses (``ray.init`` done by the caller, or
``RAY_ADDRESS``), else starts a local one. Each step's message is put in the object store once
and every actor's ``execute`` takes the same reference; rank 0's call returns the sampled ids.
A dead actor surfaces as a Ray error on its call, which fails the executor (``WorkerError``)
within one polling interval; ``shutdown()`` kills the actors and removes the placement group.
Roofline must be importable on every node (the same install everywhere).
"""

from __future__ import annotations

import pickle
import socket
import weakref
from collections import deque
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from roofline.distributed.executor import START_TIMEOUT_S, WorkerError, _RemoteExecutor
from roofline.distributed.parallel_state import NO_MULTICAST_ENV
from roofline.distributed.worker import Worker, WorkerSpec

POLL_S = 0.5
"""How often a waiting ``receive`` looks for failed actors."""


class _RayWorker:
    """The actor: a :class:`Worker` built on ``start`` (Ray has set CUDA_VISIBLE_DEVICES to
    this actor's GPU, hence device index 0)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.rank = -1

    def address(self) -> str:
        """``tcp://ip:port`` on this actor's node, for the group's rendezvous."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def start(self, rank: int, world_size: int, init_method: str, spec: WorkerSpec) -> int:
        self.rank = rank
        self.worker = Worker(rank, world_size, init_method, spec, device_index=0)
        return self.worker.num_pages

    def execute(self, payload: bytes) -> bytes | None:
        assert self.worker is not None
        handle = self.worker.execute(payload)
        return self.worker.reply(handle) if self.rank == 0 else None


class RayExecutor(_RemoteExecutor):
    def __init__(self, spec: WorkerSpec, world_size: int) -> None:
        super().__init__(spec, world_size)
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, log_to_driver=False)
        gpu = spec.device_type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ray.get(self.pg.ready(), timeout=START_TIMEOUT_S)
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_RayWorker)
        self.actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": dict(NO_MULTICAST_ENV)},
            ).remote()
            for rank in range(world_size)
        ]
        self._finalizer = weakref.finalize(self, _stop, self.actors, self.pg)
        self._in_flight: deque[list[Any]] = deque()
        try:
            init_method = ray.get(self.actors[0].address.remote(), timeout=START_TIMEOUT_S)
            starts = [
                a.start.remote(rank, world_size, init_method, spec)
                for rank, a in enumerate(self.actors)
            ]
            self.num_pages = min(self._wait_all(starts, START_TIMEOUT_S))
        except WorkerError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a placement or import error
            self.fail(f"tensor-parallel Ray workers failed to start: {e}")

    def send(self, payload: bytes) -> None:
        ref = ray.put(payload)
        self._in_flight.append([a.execute.remote(ref) for a in self.actors])

    def receive(self) -> tuple[list[int], list, dict]:
        self._check()
        refs = self._in_flight.popleft()
        reply = self._wait_all(refs, None)[0]
        assert reply is not None
        return pickle.loads(reply)

    def _wait_all(self, refs: list[Any], timeout_s: float | None) -> list[Any]:
        """Every ref's value in order; the first failure (a dead actor, a raised step) fails
        the executor at once, without waiting for the others."""
        pending = set(refs)
        waited = 0.0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - RayActorError, RayTaskError, ...
                    rank = refs.index(ref)
                    self.fail(f"tensor-parallel worker rank {rank} (Ray actor) failed: {e}")
                pending.discard(ref)
            waited += POLL_S
            if timeout_s is not None and pending and waited > timeout_s:
                self.fail(f"tensor-parallel Ray workers sent nothing in {timeout_s} s")
        return ray.get(refs)

    def shutdown(self) -> None:
        self._finalizer()


def _stop(actors: list[Any], pg: Any) -> None:
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone, or Ray shut down
            pass
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001
        pass
