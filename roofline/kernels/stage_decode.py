"""A decode step's inputs copied into the CUDA graph's static buffers in one launch.

Before a decode graph replays, its static buffers take the step's input ids (the pending ones
from the previous launch's sampled ids), positions, slots, context lengths and block-table rows,
and padding rows get slot -1 and context length 1: six to eight small copies and gathers, each a
launch of its own. ``stage_decode`` does all of it with one program per row of the bucket.
``stage_decode_ref`` is the same in torch ops (what ``DecodeGraphs.stage_inputs`` ran before).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret

_ENABLED = os.environ.get("ROOFLINE_STAGE_DECODE", "1") != "0"


def set_enabled(enabled: bool) -> None:
    """Stage decode inputs in one launch (True) or in torch ops (benchmarks compare)."""
    global _ENABLED
    _ENABLED = enabled


def applies(device: torch.device) -> bool:
    return _ENABLED and (device.type == "cuda" or is_interpret())


def stage_decode_ref(
    input_ids: torch.Tensor,  # [n] int64: the step's uploaded rows
    positions: torch.Tensor,  # [n] int64
    slots: torch.Tensor,  # [n] int64
    seq_lens: torch.Tensor,  # [n] int64
    table_rows: torch.Tensor,  # [n] int64: rows of ``table``
    pending: torch.Tensor | None,  # [k] int64: ids of rows 0..k-1 sampled by the previous launch
    table: torch.Tensor,  # [rows, max_blocks] int32: the device block tables
    out: tuple[torch.Tensor, ...],  # static (ids, positions, slots, seq_lens int32, block table)
    bucket: int,
) -> None:
    ids_s, pos_s, slots_s, lens_s, table_s = out
    n = input_ids.shape[0]
    ids_s[:n].copy_(input_ids)
    if pending is not None:
        ids_s[: pending.shape[0]].copy_(pending)
    pos_s[:n].copy_(positions)
    slots_s[:n].copy_(slots)
    lens_s[:n].copy_(seq_lens)
    torch.index_select(table, 0, table_rows, out=table_s[:n])
    slots_s[n:bucket].fill_(-1)
    lens_s[n:bucket].fill_(1)


@triton.jit(do_not_specialize=["n", "num_pending"])
def _stage_decode_kernel(
    ids_ptr, pos_ptr, slots_ptr, lens_ptr, rows_ptr, pending_ptr, table_ptr,
    ids_out, pos_out, slots_out, lens_out, table_out,
    n, num_pending, stride_t, stride_to,
    MAX_BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    if r < n:
        token = tl.load(ids_ptr + r)
        if r < num_pending:
            token = tl.load(pending_ptr + r)
        tl.store(ids_out + r, token)
        tl.store(pos_out + r, tl.load(pos_ptr + r))
        tl.store(slots_out + r, tl.load(slots_ptr + r))
        tl.store(lens_out + r, tl.load(lens_ptr + r).to(tl.int32))
        src = table_ptr + tl.load(rows_ptr + r) * stride_t
        dst = table_out + r.to(tl.int64) * stride_to
        for c0 in range(0, MAX_BLOCKS, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < MAX_BLOCKS
            tl.store(dst + cols, tl.load(src + cols, mask=ok), mask=ok)
    else:  # padding: nothing stored, a context of one token
        tl.store(slots_out + r, -1)
        tl.store(lens_out + r, 1)


def stage_decode(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    table_rows: torch.Tensor,
    pending: torch.Tensor | None,
    table: torch.Tensor,
    out: tuple[torch.Tensor, ...],
    bucket: int,
) -> None:
    """``stage_decode_ref`` in one launch (arguments as there; all on one device)."""
    ids_s, pos_s, slots_s, lens_s, table_s = out
    check_device(input_ids, table, ids_s)
    n = input_ids.shape[0]
    assert table.shape[1] == table_s.shape[1] and lens_s.dtype == torch.int32
    assert all(t.dtype == torch.int64 for t in (input_ids, positions, slots, seq_lens, table_rows))
    num_pending = 0 if pending is None else pending.shape[0]
    assert num_pending <= n <= bucket <= ids_s.shape[0]
    max_blocks = table.shape[1]
    _stage_decode_kernel[(bucket,)](
        input_ids, positions, slots, seq_lens, table_rows,
        input_ids if pending is None else pending, table,
        ids_s, pos_s, slots_s, lens_s, table_s, n, num_pending, table.stride(0),
        table_s.stride(0), MAX_BLOCKS=max_blocks,
        BLOCK=min(1024, triton.next_power_of_2(max_blocks)), num_warps=1,
    )  # fmt: skip
