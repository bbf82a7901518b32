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
import triton
import triton.language as tl

from roofline.kernels import is_interpret


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


MAX_PAIRS_ONE_LAUNCH = 4096
"""Up to this many pairs (512 tokens at top-8) the grouping is one kernel (``_align_kernel``:
one program sorts every pair in registers); beyond, a sequence of torch ops (prefill chunks,
where ~25 small launches are noise beside the GEMMs)."""


ONE_LAUNCH_MIN_BLOCK = 1024
"""The kernel sorts at least this many slots (padding keys last): three compiled sizes (1024,
2048, 4096) cover every decode batch, and ``fused_moe.warm_up`` compiles each."""


@triton.jit
def _align_kernel(
    ids_ptr,  # [P] expert id per pair (any int dtype)
    sorted_ptr,  # [rows] int32 out
    block_expert_ptr,  # [rows // BLOCK_M] int32 out
    num_padded_ptr,  # [1] int64 out
    shift_ptr,  # [BLOCK_E] int32 scratch
    num_pairs,
    num_experts,
    rows,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,  # power of two >= num_pairs
    BLOCK_E: tl.constexpr,  # power of two >= num_experts
    CHUNK: tl.constexpr,
):
    """One program: the experts' counts (a histogram) and padded runs (cumulative sums), the
    pairs sorted by ``expert * BLOCK_P + pair`` (stable by construction) and each stored at its
    padded row (sorted position ``i`` of expert ``e`` goes to ``i + (padded start - unpadded
    start)[e]``), then every block's expert: that of its first row, always a real pair (runs
    pad at their ends), or ``num_experts`` past the padded end. Global stores are read back by
    other threads of the program only after a CTA barrier."""
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < num_pairs
    ids = tl.load(ids_ptr + offs_p, mask=p_ok, other=0).to(tl.int32)
    counts = tl.histogram(ids, BLOCK_E, mask=p_ok)  # [BLOCK_E]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    raw_end = tl.cumsum(counts, 0)
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(shift_ptr + offs_e, (pad_end - padded) - (raw_end - counts))
    num_padded = tl.sum(padded, 0)
    tl.store(num_padded_ptr, num_padded.to(tl.int64))
    fill = tl.full((CHUNK,), 0, tl.int32) + num_pairs  # the padding sentinel P
    for r0 in range(0, rows, CHUNK):
        offs_r = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs_r, fill, mask=offs_r < rows)
    tl.debug_barrier()  # the sentinel rows and the shifts, before the scatter reads / overwrites
    keys = tl.where(p_ok, ids * BLOCK_P + offs_p, 2147483647)
    keys = tl.sort(keys, 0)  # padding keys last
    shift = tl.load(shift_ptr + keys // BLOCK_P, mask=p_ok, other=0)
    tl.store(sorted_ptr + offs_p + shift, keys % BLOCK_P, mask=p_ok)
    tl.debug_barrier()  # the sorted rows, before the blocks read their first
    for b0 in range(0, rows // BLOCK_M, CHUNK):  # a block's first row is always a real pair
        offs_b = b0 + tl.arange(0, CHUNK)
        in_use = offs_b * BLOCK_M < num_padded
        first = tl.load(sorted_ptr + offs_b * BLOCK_M, mask=in_use, other=0)
        expert = tl.load(ids_ptr + first, mask=in_use, other=num_experts).to(tl.int32)
        tl.store(block_expert_ptr + offs_b, expert, mask=offs_b < rows // BLOCK_M)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group the ``P = T * k`` pairs by expert (stable: ascending pair order within an expert)
    with device ops only, so it runs inside a CUDA graph: one kernel up to
    ``MAX_PAIRS_ONE_LAUNCH`` pairs (on CUDA and under the interpreter), torch ops beyond."""
    flat = topk_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    if 0 < num_pairs <= MAX_PAIRS_ONE_LAUNCH and (flat.is_cuda or is_interpret()):
        rows = max_padded_rows(num_pairs, num_experts, block_m)
        sorted_ids = torch.empty(rows, dtype=torch.int32, device=device)
        block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=device)
        num_padded = torch.empty(1, dtype=torch.int64, device=device)
        block_e = max(16, triton.next_power_of_2(num_experts))
        shift = torch.empty(block_e, dtype=torch.int32, device=device)
        least = 16 if is_interpret() else ONE_LAUNCH_MIN_BLOCK  # (interpreted tests: small)
        block_p = max(least, triton.next_power_of_2(num_pairs))
        _align_kernel[(1,)](
            flat.contiguous(), sorted_ids, block_expert, num_padded, shift, num_pairs,
            num_experts, rows, BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_E=block_e, CHUNK=256,
            num_warps=4 if block_p <= 1024 else 8,
        )  # fmt: skip
        return MoeAlignment(sorted_ids, block_expert, num_padded)
    flat = flat.long()  # [P]
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
