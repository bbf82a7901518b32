"""Block tables that stay on the device: one row per request in flight, updated incrementally.

Rebuilding every request's block table on the host each step costs ``O(num_reqs x num_pages)``
Python and one large upload (256 decode requests over 1k-token contexts: ~16k page ids, most of
the host's input-building time). Instead the table lives where the attention kernels read it,
``table[num_rows, max_blocks]`` int32, and each request in flight owns one row of it from its
first scheduled step until the runner hears that it finished or was preempted. A step uploads
only the page ids added since the request's previous step (one page every ``page_size``
decode steps) and each scheduled request's row index; the batch's block table is then a gather
of those rows on the device.

A row is written whole again whenever its owner is not the request it was written for, or the
request's block table no longer extends what was written (its last written page differs, or it
shrank); a request preempted (pages freed, recomputed later under new pages) is dropped by the
runner and gets a fresh row. Columns past a request's pages hold stale but valid page ids: the
kernels never read a page past a request's context length.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from roofline.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _Row:
    index: int
    """Row of ``BlockTables.table`` this request owns."""
    request: Request
    """The request the row was written for (a reused id is a different object)."""
    num_pages: int
    """Page ids written so far: ``table[index, :num_pages]`` is the request's block table."""
    last_page: int
    """``table[index, num_pages - 1]`` (-1 when no page is written yet)."""


class TableUpdates:
    """Page ids to write into the table this step: ``table.view(-1)[flat_index] = page_ids``."""

    def __init__(self) -> None:
        self.flat_index: list[int] = []
        self.page_ids: list[int] = []


class BlockTables:
    """The device block tables of the requests in flight (see the module docstring).

    ``row_of`` assigns rows and records the page ids to write on the host; ``apply`` then writes
    them on the device and ``gather`` builds a step's ``[num_reqs, width]`` block table. Rows of
    finished or preempted requests go back with ``drop``, before the step's ``row_of`` calls."""

    def __init__(self, num_rows: int, max_blocks: int, device: torch.device) -> None:
        if num_rows <= 0 or max_blocks <= 0:
            raise ValueError(f"num_rows ({num_rows}) and max_blocks ({max_blocks}) must be > 0")
        self.max_blocks = max_blocks
        self.table = torch.zeros(num_rows, max_blocks, dtype=torch.int32, device=device)
        self._rows: dict[str, _Row] = {}
        self._free = list(range(num_rows - 1, -1, -1))  # pop() hands out row 0 first

    @property
    def rows(self) -> dict[str, _Row]:
        """Request id -> its row (read-only: ``HostBatch.build`` checks the common case, a row
        already holding the request's pages, without a call per request)."""
        return self._rows

    @property
    def num_rows_in_use(self) -> int:
        return len(self._rows)

    def drop(self, request_ids: list[str]) -> None:
        """Give back the rows of requests that finished or were preempted (unknown ids are
        ignored)."""
        rows, free = self._rows, self._free
        for rid in request_ids:
            row = rows.pop(rid, None)
            if row is not None:
                free.append(row.index)

    def row_of(self, request: Request, block_ids: list[int], updates: TableUpdates) -> int:
        """The row holding ``request``'s block table ``block_ids`` once ``updates`` is applied;
        appends to ``updates`` the page ids that row lacks."""
        num_pages = len(block_ids)
        row = self._rows.get(request.request_id)
        if (
            row is not None
            and row.num_pages == num_pages
            and row.request is request
            and (not num_pages or block_ids[-1] == row.last_page)
        ):
            return row.index  # nothing new (most decode steps)
        if num_pages > self.max_blocks:
            raise RuntimeError(
                f"request {request.request_id}: {num_pages} pages exceed the table's "
                f"{self.max_blocks} columns (max_model_len)"
            )
        if row is None:
            row = _Row(self._take_row(), request, 0, -1)
            self._rows[request.request_id] = row
        start = row.num_pages
        if (
            row.request is not request
            or num_pages < start
            or (start and block_ids[start - 1] != row.last_page)
        ):
            row.request, start = request, 0  # not an extension of what was written: rewrite
        if start < num_pages:
            base = row.index * self.max_blocks
            updates.flat_index.extend(range(base + start, base + num_pages))
            updates.page_ids.extend(block_ids[start:])
        row.num_pages, row.last_page = num_pages, block_ids[-1] if num_pages else -1
        return row.index

    def unchanged_entry(self) -> tuple[list[int], list[int]]:
        """One table entry as it is (a row's last written page): ``([flat index], [page id])``,
        a write that changes nothing (a fixed-shape graph writes one update at least)."""
        for row in self._rows.values():
            if row.num_pages:
                return [row.index * self.max_blocks + row.num_pages - 1], [row.last_page]
        raise RuntimeError("no row holds a page")

    def _take_row(self) -> int:
        if not self._free:  # more requests in flight than rows: grow (rows are cheap)
            old = self.table.shape[0]
            logger.warning("block table: %d rows in use, growing to %d", old, 2 * old)
            extra = torch.zeros_like(self.table)
            self.table = torch.cat([self.table, extra])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def apply(self, flat_index: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Write a step's updates (device tensors from ``TableUpdates``; int64 both)."""
        if flat_index.numel():
            self.table.view(-1).index_copy_(0, flat_index, page_ids.to(torch.int32))

    def gather(
        self, rows: torch.Tensor, width: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[len(rows), width]`` block table of a step (rows: int64 on the device); into
        ``out`` (contiguous ``[len(rows), max_blocks]``, full width) when given."""
        if out is not None:
            return torch.index_select(self.table, 0, rows, out=out)
        return self.table[:, :width].index_select(0, rows)
