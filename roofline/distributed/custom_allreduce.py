"""One-shot all-reduce for small messages on GPUs of one host, with NCCL above a size threshold.

Batch-1 decode all-reduces one hidden state twice per layer (8 KB for an 8B model in bf16): at
that size NCCL's ring (``2 (p - 1)`` latency hops) is all latency. Here each rank's input is
copied into a buffer every rank can read over NVLink/PCIe peer access (CUDA IPC handles,
exchanged once at start-up through PyTorch's symmetric memory), the ranks signal each other, and
each reads all peers' buffers and sums them: one hop, ``(p - 1) n`` bytes read per rank. The
kernel is PyTorch's ``symm_mem.one_shot_all_reduce`` (maintained upstream, CUDA-graph
capturable); no multicast object is ever created (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` in
every worker, NVLS off), so only peer loads are used.

``CustomAllReduce.create`` returns None where it cannot work (no CUDA, no peer access between
the GPUs, a PyTorch without symmetric memory, ``ROOFLINE_CUSTOM_ALLREDUCE=0``); the caller then
uses NCCL for everything.
Checked and timed against NCCL by ``scripts/gpu_tp.py`` (8 KB to 1 MB, in and out of graphs).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from roofline.distributed.comm_model import ONE_SHOT_MAX_BYTES

logger = logging.getLogger(__name__)

MAX_BYTES = ONE_SHOT_MAX_BYTES
"""Messages up to this size take the one-shot path (above it NCCL's ring reads fewer bytes
per rank; the crossover is re-measured by ``scripts/gpu_tp.py``; the planner's cost model,
``comm_model``, uses the same threshold)."""


class CustomAllReduce:
    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int) -> None:
        self.buffer = buffer  # [max_bytes] uint8, symmetric (peer-readable) memory
        self.group_name = group_name
        self.max_bytes = max_bytes

    @classmethod
    def create(
        cls, group: Any, device: torch.device, max_bytes: int = MAX_BYTES
    ) -> CustomAllReduce | None:
        if device.type != "cuda" or dist.get_world_size(group) == 1:
            return None
        if os.environ.get("ROOFLINE_CUSTOM_ALLREDUCE", "1") == "0":
            return None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            world = dist.get_world_size(group)
            for peer in range(torch.cuda.device_count()):
                if peer != device.index and peer < world:
                    if not torch.cuda.can_device_access_peer(device.index, peer):
                        logger.info("custom all-reduce off: no peer access %s -> %d", device, peer)
                        return None
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:  # needed before rendezvous by older PyTorch releases
                enable(group.group_name)
            buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, group=group)
            ca = cls(buffer, group.group_name, max_bytes)
            probe = torch.ones(4, device=device)
            if not torch.equal(ca.all_reduce(probe).cpu(), torch.full((4,), float(world))):
                raise RuntimeError("the one-shot all-reduce gave a wrong sum")
        except Exception as e:  # noqa: BLE001 - any missing piece: NCCL only
            logger.warning("custom all-reduce off (NCCL for every size): %s", e)
            return None
        return ca

    def applies(self, x: torch.Tensor) -> bool:
        """Shapes only (no sync): small contiguous CUDA tensors."""
        return x.is_cuda and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group (a new tensor; ``x`` is left as it was)."""
        num_bytes = x.numel() * x.element_size()
        staged = self.buffer[:num_bytes].view(x.dtype).view(x.shape)
        staged.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name)
