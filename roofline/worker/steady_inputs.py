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
gathers the block-table rows again (the new pages), adds one to positions and context lengths
and recomputes slots. A steady step is then an input-id copy and two graph replays (this one
and the decode graph). ``advance_inputs`` is the same in eager torch ops (the CPU tests compare
it with staging the next step from scratch).
"""

from __future__ import annotations

import torch

from roofline.worker.block_table import BlockTables


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

    def __init__(self, graphs, block_tables: BlockTables, page_size: int) -> None:
        self.graphs = graphs
        self.block_tables = block_tables
        self.page_size = page_size
        device = graphs.input_ids.device
        max_batch = graphs.input_ids.shape[0]
        self.table_rows = torch.zeros(max_batch, dtype=torch.int64, device=device)
        """Each static row's row in the block tables (written when a steady run starts)."""
        self.num_rows = torch.zeros(1, dtype=torch.int64, device=device)
        self.row_index = torch.arange(max_batch, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._table_ptr = 0
        """The block table's address at capture (a grown table makes the graphs stale)."""

    def _advance(self, bucket: int) -> None:
        g = self.graphs
        static = (g.positions[:bucket], g.slot_mapping[:bucket], g.seq_lens[:bucket],
                  g.block_table[:bucket])  # fmt: skip
        advance_inputs(
            static,
            self.table_rows[:bucket],
            self.num_rows,
            self.row_index[:bucket],
            self.block_tables.table,
            self.page_size,
        )

    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> None:
        """One graph per decode bucket. The buffers it touches are saved and put back, so a
        capture leaves the decode graphs' inputs as they were."""
        g = self.graphs
        saved = [t.clone() for t in (g.positions, g.slot_mapping, g.seq_lens, g.block_table)]
        self.table_rows.zero_()
        self.num_rows.zero_()
        for bucket in reversed(g.buckets):
            self._advance(bucket)  # warm up (allocator, kernels) outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._advance(bucket)
            pool = graph.pool()
            self._graphs[bucket] = graph
        for t, s in zip((g.positions, g.slot_mapping, g.seq_lens, g.block_table), saved):
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

    def advance(self, bucket: int, sampled: torch.Tensor) -> None:
        """Move the staged rows one token on: input ids from ``sampled`` (the previous step's
        ids, one per row in order), then the bucket's graph (block-table updates applied)."""
        self.graphs.input_ids[: sampled.shape[0]].copy_(sampled)
        self._graphs[bucket].replay()
