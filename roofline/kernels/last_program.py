"""The "last program finishes the job" pattern shared by the fused decode kernels.

A kernel whose programs each produce a partial (a split's attention output, a column block's
argmax, a router block's logits) can finish the reduction itself instead of launching a second
kernel: every program stores its partial, passes a CTA barrier (``tl.debug_barrier``) and
increments a counter with a GPU-scope acq_rel atomic (one thread per program); the program that
reads ``count == programs - 1`` is the last, loads all the partials (``.cg``: from L2, never a
stale L1 line) and writes the result, then stores 0 so the next launch finds the counter zeroed.
The barrier orders every thread's stores before the atomic's release, which is cumulative (PTX
memory model; CUDA's cooperative-groups grid sync relies on the same: a barrier, then one
thread's fence and atomic), so the last program's acquire sees all the partials. No program
waits on another, so there is no deadlock whatever the scheduling.

Counters live in a zeroed int32 buffer per (device, owner), kept for the process. A launch
never leaves its counters non-zero, so the buffer is never cleared again, also inside CUDA
graphs. Kernels that launch back to back on one stream (or as PDL dependents, which wait for
their predecessor before their atomics) never share a counter in flight.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

_COUNTERS: dict[tuple[torch.device, Hashable], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # replaced buffers: captured CUDA graphs may still use them


def counters(device: torch.device, n: int, owner: Hashable) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters on ``device`` for the kernels of
    ``owner``. Grown outside CUDA-graph capture in practice: graphs' warm-up forwards run first,
    the largest batch first."""
    buf = _COUNTERS.get((device, owner))
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)  # never freed: a graph replay must not count in reused memory
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[(device, owner)] = buf
    return buf


def stream_counters(device: torch.device, n: int, owner: str) -> torch.Tensor:
    """``counters`` of ``owner`` on ``device``'s current stream: for kernels that may run on
    several streams at once (the split-K GEMMs), which must not share a counter in flight."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return counters(device, n, (owner, stream))
