"""The parallel context: which rank this process is, of how many, and the group its collectives
run in. It is passed explicitly to the model and the layers that need it (never a global), and
it owns the two collectives a tensor-parallel forward needs: the all-reduce after each
row-parallel projection (o_proj, down_proj, the vocab-parallel embedding) and the gather of the
vocab-sharded logits. On CUDA a :class:`~roofline.distributed.custom_allreduce.CustomAllReduce`
may take small all-reduces (one-shot over peer memory); everything else goes through
``torch.distributed`` (NCCL on CUDA, gloo on the CPU). All of it is capturable in CUDA graphs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""Set in every worker's environment before CUDA or NCCL start: NVLink multicast (NVLS,
multimem) stays off on the machines we run on."""


@dataclass
class ParallelContext:
    """One rank's view of its tensor-parallel group."""

    rank: int
    world_size: int
    group: Any = None
    """The ``torch.distributed`` process group (None only when ``world_size == 1``)."""
    custom_allreduce: Any = field(default=None, repr=False)
    """A ``CustomAllReduce`` for small messages on CUDA, or None (NCCL/gloo only)."""
    expert_parallel: bool = False
    """MoE layers place whole experts over this group (``enable_expert_parallel``) instead of
    splitting every expert's columns (``distributed/expert_parallel.py``)."""
    expert_parallel_dispatch: str = "replicated"
    """How tokens reach their experts' ranks: ``replicated`` or ``all_to_all``."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group (in place where the transport allows; use the result)."""
        ca = self.custom_allreduce
        if ca is not None and ca.applies(x):
            return ca.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, n]`` on every rank -> ``[rows, world_size * n]`` (rank order) on every rank."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place)."""
        dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x


SINGLE = ParallelContext(0, 1)
"""The context of an unsharded model."""


def init_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float = 600.0,
) -> ParallelContext:
    """Join the ``world_size`` ranks at ``init_method`` (``tcp://host:port``) and return this
    rank's context: NCCL between GPUs, gloo between CPU processes."""
    for key, value in NO_MULTICAST_ENV.items():
        os.environ[key] = value
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    group = dist.group.WORLD
    ctx = ParallelContext(rank, world_size, group)
    if device.type == "cuda" and world_size > 1:
        from roofline.distributed.custom_allreduce import CustomAllReduce

        ctx.custom_allreduce = CustomAllReduce.create(group, device)
    return ctx


def destroy_parallel() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
