"""Steady decode steps moved on inside the decode graphs' static buffers, without an upload.

A decode step copies its inputs into the decode graphs' static buffers (``DecodeGraphs``):
input ids, positions, slots, context lengths and block-table rows, one upload of ~6 ints per
request and a staging launch. In a steady decode run (``core/steady.py``: the same requests
step after step, every input pending) those buffers already hold the previous step's inputs,
and the next step's follow from them: each position and context length one further, each slot
recomputed from the block table, the input ids the tokens the previous step sampled. Only the
page ids of the rows that reached a new page travel, as block-table updates.

:class:`SteadyInputs` captures, per decode bucket, a small CUDA graph that does it over the
bucket's rows (rows past the real ones keep their padding: slot -1, context length 1): it
writes the block-table updates, gathers the block-table rows again (the new pages), adds one
to positions and context lengths and recomputes slots. A steady step is then one small copy
(the page ids of the rows that reached a new page, into a fixed buffer the graph reads:
``write_updates``), an input-id copy and two graph replays (this one and the decode graph).
On CUDA the graph is one launch (``kernels/steady_advance.py``); ``advance_inputs`` and
``write_updates`` are the same in plain torch ops (the CPU tests compare them with staging the
next step from scratch and with a direct write, and the kernel with them).
"""

from __future__ import annotations

from array import array

import torch

from roofline.kernels import steady_advance
from roofline.worker.block_table import BlockTables
from roofline.worker.staging import PinnedStaging


def write_updates(
    table: torch.Tensor,  # [rows, max_blocks] int32: the device block tables
    updates: torch.Tensor,  # [1 + 2 * capacity] int64: k, k flat indices, k page ids, stale rest
    update_index: torch.Tensor,  # [capacity] int64: 0..capacity-1
) -> None:
    """``table.view(-1)[flat[:k]] = pages[:k]`` for the ``k >= 1`` updates packed in
    ``updates`` as ``[k, flat..., pages...]``, in fixed-shape ops (a CUDA graph's): the slots
    past ``k`` repeat the first update (the same value to the same place)."""
    capacity = update_index.shape[0]
    k = updates[:1]
    valid = update_index < k  # [capacity]
    flat = updates[1 : 1 + capacity]
    pages = updates.gather(0, (update_index + 1 + k).clamp_(max=updates.shape[0] - 1))
    flat = torch.where(valid, flat, flat[:1])
    pages = torch.where(valid, pages, pages[:1])
    table.view(-1).index_copy_(0, flat, pages.to(table.dtype))


def advance_inputs(
    static: tuple[torch.Tensor, ...],  # (positions, slots, seq_lens int32, block table) [bs...]
    table_rows: torch.Tensor,  # [bs] int64: each row's row in ``table`` (any valid row past n)
    num_rows: torch.Tensor,  # [1] int64: the real rows n
    row_index: torch.Tensor,  # [bs] int64: 0..bs-1
    table: torch.Tensor,  # [rows, max_blocks] int32: the device block tables
    page_size: int,
) -> None:
    """One token further for rows ``0..n-1`` of the static buffers (in place)."""
    positions, slots, seq_lens, block_table = static
    valid = row_index < num_rows  # [bs] bool
    positions.add_(valid)
    seq_lens.add_(valid)
    torch.index_select(table, 0, table_rows, out=block_table)
    page = block_table.gather(1, (positions // page_size).unsqueeze(1)).squeeze(1)  # [bs]
    slot = page.to(torch.int64) * page_size + positions % page_size
    slots.copy_(torch.where(valid, slot, -1))


class SteadyInputs:
    """Per-bucket advance graphs over a ``DecodeGraphs``' static buffers (CUDA)."""

    MOVED = frozenset(
        ("input_ids", "positions", "slot_mapping", "seq_lens", "block_table", "query_start_loc")
    )
    """The decode graphs' input buffers this advance keeps right (query starts never change)."""

    def __init__(self, graphs, block_tables: BlockTables, page_size: int) -> None:
        inputs = {name for name, value in vars(graphs).items() if isinstance(value, torch.Tensor)}
        if inputs != self.MOVED:  # a buffer added to the decode graphs would go stale here
            raise RuntimeError(f"decode graph inputs {sorted(inputs ^ self.MOVED)} not advanced")
        self.graphs = graphs
        self.block_tables = block_tables
        self.page_size = page_size
        device = graphs.input_ids.device
        max_batch = graphs.input_ids.shape[0]
        self.table_rows = torch.zeros(max_batch, dtype=torch.int64, device=device)
        """Each static row's row in the block tables (written when a steady run starts)."""
        self.num_rows = torch.zeros(1, dtype=torch.int64, device=device)
        self.row_index = torch.arange(max_batch, device=device)
        self.capacity = max_batch
        """Most block-table updates one steady step writes in its graph (one page per row)."""
        self.updates = torch.zeros(1 + 2 * max_batch, dtype=torch.int64, device=device)
        """``[k, flat indices (k), page ids (k)]`` of a step's block-table updates, uploaded
        into this fixed buffer (``write_updates``)."""
        self._ring = PinnedStaging(device) if device.type == "cuda" else None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._head_graphs: dict[int, tuple[torch.cuda.CUDAGraph, int]] = {}
        """Per bucket whose decode graph computes greedy ids (``graph_head``): the advance that
        also copies them into the input ids, and their address (a step sampled by that head
        needs no copy of its own)."""
        self._table_ptr = 0
        """The block table's address at capture (a grown table makes the graphs stale)."""

    def _advance(self, bucket: int, ids_from: torch.Tensor | None = None) -> None:
        """The graph's body: one launch on CUDA (``kernels/steady_advance.py``), else the same
        in torch ops. ``ids_from``: the bucket's graph head's greedy ids (a static buffer),
        copied into the input ids here."""
        g = self.graphs
        static = (g.positions[:bucket], g.slot_mapping[:bucket], g.seq_lens[:bucket],
                  g.block_table[:bucket])  # fmt: skip
        table, rows = self.block_tables.table, self.table_rows[:bucket]
        if steady_advance.applies(table.device):
            ids = None if ids_from is None else (g.input_ids[:bucket], ids_from)
            steady_advance.steady_advance(
                static, rows, self.num_rows, self.updates, table, self.page_size, ids
            )
            return
        if ids_from is not None:
            g.input_ids[:bucket].copy_(ids_from)
        write_updates(table, self.updates, self.row_index)
        advance_inputs(static, rows, self.num_rows, self.row_index[:bucket], table, self.page_size)

    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> None:
        """One graph per decode bucket. The buffers it touches are saved and put back, so a
        capture leaves the decode graphs' inputs as they were."""
        g = self.graphs
        buffers = (g.input_ids, g.positions, g.slot_mapping, g.seq_lens, g.block_table)
        saved = [t.clone() for t in buffers]
        self.table_rows.zero_()
        self.num_rows.zero_()
        self.updates.zero_()  # the warm-ups write one update: table[0, 0] as it is
        self.updates[0] = 1
        self.updates[2] = self.block_tables.table[0, 0]
        for bucket in reversed(g.buckets):
            head = g.heads.get(bucket)
            ids = head.token_ids if head is not None else None
            for ids_from in (None, ids) if ids is not None else (None,):
                self._advance(bucket, ids_from)  # warm up (allocator, kernels) outside
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._advance(bucket, ids_from)
                pool = graph.pool()
                if ids_from is None:
                    self._graphs[bucket] = graph
                else:
                    self._head_graphs[bucket] = (graph, ids_from.data_ptr())
        for t, s in zip(buffers, saved):
            t.copy_(s)
        torch.cuda.synchronize()
        self._table_ptr = self.block_tables.table.data_ptr()

    def usable(self, bucket: int) -> bool:
        return bucket in self._graphs and self.block_tables.table.data_ptr() == self._table_ptr

    def start(self, num_rows: int, table_rows: torch.Tensor) -> None:
        """A steady run starts from the buffers as a decode step staged them: its ``num_rows``
        rows and their block-table rows (int64, on the device)."""
        self.table_rows[:num_rows].copy_(table_rows)
        self.num_rows.fill_(num_rows)

    def advance(
        self, bucket: int, sampled: torch.Tensor, flat_index: list[int], page_ids: list[int]
    ) -> None:
        """Move the staged rows one token on: input ids from ``sampled`` (the previous step's
        ids, one per row in order), then the bucket's graph, which first writes the block-table
        updates ``table.view(-1)[flat_index] = page_ids`` (1 to ``capacity`` of them: a step
        with none passes one that rewrites a page id as it is)."""
        k = len(flat_index)
        assert 0 < k <= self.capacity and len(page_ids) == k
        packed = array("q", [k])
        packed += array("q", flat_index)
        packed += array("q", page_ids)
        self._ring.copy_into(packed, self.updates)  # type: ignore[union-attr]
        head = self._head_graphs.get(bucket)
        if head is not None and head[1] == sampled.data_ptr():
            head[0].replay()  # the ids come from the head's buffer inside the graph
            return
        self.graphs.input_ids[: sampled.shape[0]].copy_(sampled)
        self._graphs[bucket].replay()
