"""A steady decode step's inputs moved on inside the decode graphs' static buffers, in one launch.

``worker/steady_inputs.py`` advances the buffers a decode graph reads by one token per row: the
step's block-table updates written, each real row's block-table row gathered again, its position
and context length one further and its slot recomputed; padding rows keep slot -1 and context
length 1. In torch ops that is about twenty small kernels per step (~35 us of GPU time on the
H100 even inside a CUDA graph); ``steady_advance`` does it with one program per row of the
bucket. Each program applies the updates of its own block-table row (the updates of a steady
step are new pages of the step's rows, a row per request), so no program reads what another
writes. ``steady_advance_ref`` is the same in torch ops (``write_updates`` then
``advance_inputs``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret


def applies(device: torch.device) -> bool:
    return device.type == "cuda" or is_interpret()


@triton.jit
def _steady_advance_kernel(
    pos_ptr, slots_ptr, lens_ptr, table_out, ids_ptr, ids_src,
    rows_ptr, num_rows_ptr, upd_ptr, table_ptr, stride_t, stride_to,
    PAGE: tl.constexpr, MAX_BLOCKS: tl.constexpr, BLOCK: tl.constexpr, HAS_IDS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    if HAS_IDS:  # the previous step's greedy ids, from a buffer of the decode graph's head
        tl.store(ids_ptr + r, tl.load(ids_src + r))
    n = tl.load(num_rows_ptr)
    if r < n:
        t = tl.load(rows_ptr + r)
        cols = tl.arange(0, BLOCK)
        ok = cols < MAX_BLOCKS
        row = tl.load(table_ptr + t * stride_t + cols, mask=ok, other=0)
        k = tl.load(upd_ptr)
        base = t * MAX_BLOCKS  # flat index of the row's first entry
        for j in range(0, k):
            flat = tl.load(upd_ptr + 1 + j)
            if (flat >= base) & (flat < base + MAX_BLOCKS):  # an update of this row
                page = tl.load(upd_ptr + 1 + k + j).to(tl.int32)
                tl.store(table_ptr + t * stride_t + (flat - base), page)
                row = tl.where(cols == flat - base, page, row)
        tl.store(table_out + r.to(tl.int64) * stride_to + cols, row, mask=ok)
        p = tl.load(pos_ptr + r) + 1
        tl.store(pos_ptr + r, p)
        tl.store(lens_ptr + r, tl.load(lens_ptr + r) + 1)
        page_id = tl.sum(tl.where(cols == p // PAGE, row, 0))
        tl.store(slots_ptr + r, page_id.to(tl.int64) * PAGE + p % PAGE)
    else:  # padding: nothing stored, a context of one token
        tl.store(slots_ptr + r, -1)
        tl.store(lens_ptr + r, 1)


def steady_advance(
    static: tuple[torch.Tensor, ...],  # (positions, slots, seq_lens int32, block table) [bucket]
    table_rows: torch.Tensor,  # [bucket] int64
    num_rows: torch.Tensor,  # [1] int64
    updates: torch.Tensor,  # [1 + 2 * capacity] int64: k, k flat indices, k page ids
    table: torch.Tensor,  # [rows, max_blocks] int32 (contiguous)
    page_size: int,
    ids: tuple[torch.Tensor, torch.Tensor] | None = None,  # (input ids, greedy ids) [bucket]
) -> None:
    """``steady_advance_ref`` in one launch (arguments as there; all on one device)."""
    positions, slots, seq_lens, block_table = static
    check_device(positions, table, updates)
    bucket, max_blocks = positions.shape[0], table.shape[1]
    assert table.is_contiguous() and block_table.shape[1] == max_blocks
    assert seq_lens.dtype == table.dtype == torch.int32 and table_rows.shape[0] >= bucket
    ids_out, ids_src = ids if ids is not None else (positions, positions)
    _steady_advance_kernel[(bucket,)](
        positions, slots, seq_lens, block_table, ids_out, ids_src, table_rows, num_rows,
        updates, table, table.stride(0), block_table.stride(0), PAGE=page_size,
        MAX_BLOCKS=max_blocks, BLOCK=triton.next_power_of_2(max_blocks),
        HAS_IDS=ids is not None, num_warps=1,
    )  # fmt: skip


def steady_advance_ref(
    static: tuple[torch.Tensor, ...],
    table_rows: torch.Tensor,
    num_rows: torch.Tensor,
    updates: torch.Tensor,
    table: torch.Tensor,
    page_size: int,
    ids: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    from roofline.worker.steady_inputs import advance_inputs, write_updates

    bucket = static[0].shape[0]
    if ids is not None:
        ids[0].copy_(ids[1])
    capacity = (updates.shape[0] - 1) // 2
    if int(updates[0]):
        write_updates(table, updates, torch.arange(capacity, device=updates.device))
    row_index = torch.arange(bucket, device=table.device)
    advance_inputs(static, table_rows[:bucket], num_rows, row_index, table, page_size)
