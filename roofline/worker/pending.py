"""Input tokens still on the device: async scheduling launches step N+1 before the host has
seen the tokens step N sampled, so a decode row's input id is copied from N's sampled ids on
the device instead of being uploaded from the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingInputs:
    """``input_ids[dst] = sampled[src]``; with ``src`` and ``dst`` None, the first
    ``len(sampled)`` rows take ``sampled`` in order (steady decode: no index tensors)."""

    sampled: torch.Tensor
    """The previous launch's sampled ids ([num_sampled] int64, on the device)."""
    src: torch.Tensor | None
    dst: torch.Tensor | None


def fill_pending(input_ids: torch.Tensor, pending: PendingInputs) -> None:
    if pending.dst is None:
        input_ids[: pending.sampled.shape[0]].copy_(pending.sampled)
    else:
        assert pending.src is not None
        input_ids.index_copy_(0, pending.dst, pending.sampled.index_select(0, pending.src))
