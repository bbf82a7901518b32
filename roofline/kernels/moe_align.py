"""Grouping a MoE batch's (token, expert) pairs by expert on the device, for the grouped GEMM of
``kernels.fused_moe``: the pairs sorted by expert (stable), each expert's run padded to the
GEMM's ``block_m`` rows, so every block of the sorted list belongs to one expert. Device ops
only and sizes that depend on the shapes alone: no host sync, CUDA-graph capturable. The
expert-parallel ``NOT_LOCAL`` id is one more expert here (``fused_moe`` passes ``E + 1``), so
its pairs form their own runs, whose blocks the GEMM skips.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class MoeAlignment(NamedTuple):
    """Pairs sorted by expert, each expert's run padded to ``block_m`` rows (device tensors)."""

    sorted_pair_ids: torch.Tensor
    """[max_padded] int32: pair index per row of the sorted list; ``P`` marks a padding row."""
    block_expert_ids: torch.Tensor
    """[max_padded // block_m] int32: the expert of each block (``E`` past the padded end)."""
    num_padded: torch.Tensor
    """[1] int64: rows in use (the sum of the padded runs); later blocks are skipped."""


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound of the sorted list: every touched expert (at most min(E, P)) pads at most
    ``block_m - 1`` rows; rounded up to whole blocks."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group the ``P = T * k`` pairs by expert (stable: ascending pair order within an expert)
    with device ops only, so it runs inside a CUDA graph."""
    flat = topk_ids.reshape(-1).long()  # [P]
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] (bincount would sync for its size)
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    pad_end = torch.cumsum(padded, 0)  # [E]
    raw_start = torch.cumsum(counts, 0) - counts  # [E]
    order = torch.sort(flat, stable=True).indices  # [P] pair ids, grouped by expert
    expert_of = flat[order]  # [P]
    rank = torch.arange(num_pairs, device=device) - raw_start[expert_of]  # [P] rank in its run
    dest = pad_end[expert_of] - padded[expert_of] + rank  # [P] row in the sorted list
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, rows, block_m, device=device)  # [num_blocks]
    block_expert = torch.searchsorted(pad_end, block_starts, right=True).to(torch.int32)
    return MoeAlignment(sorted_ids, block_expert, pad_end[-1:])
