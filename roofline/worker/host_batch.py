"""One step's ragged batch as host lists, and their trip to the device in one copy.

``HostBatch.build`` walks the scheduled requests once and lays out the flat per-token lists
(``input_ids``, ``positions``, ``slots``), the per-request ones (``query_start``, ``seq_lens``,
the request's row in the device block tables) and the page ids the block tables lack. A decode
row costs a few appends; no request's token list or block table is copied. ``upload`` then sends
every list the step needs as one int64 tensor (pinned on CUDA) in one host-to-device copy, and
hands back device views of its parts.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from roofline.core.outputs import SchedulerOutput
from roofline.request import Request
from roofline.worker.block_table import BlockTables, TableUpdates
from roofline.worker.staging import PinnedStaging


@dataclass
class HostBatch:
    page_size: int
    input_ids: list[int] = field(default_factory=list)
    """[num_tokens]; 0 where the token is pending (the device fills it)."""
    positions: list[int] = field(default_factory=list)
    """[num_tokens]"""
    slots: list[int] = field(default_factory=list)
    """[num_tokens] flat KV-cache slot of each token."""
    query_start: list[int] = field(default_factory=lambda: [0])
    """[num_reqs + 1] cumulative query lengths."""
    seq_lens: list[int] = field(default_factory=list)
    """[num_reqs] context length of each request after this step."""
    table_rows: list[int] = field(default_factory=list)
    """[num_reqs] each request's row in the device block tables."""
    table_updates: TableUpdates = field(default_factory=TableUpdates)
    """Page ids the device block tables lack (written before the step's gather)."""
    sample_rows: list[int] = field(default_factory=list)
    """Row of each sampling request's last token in the batch."""
    sample_requests: list[Request] = field(default_factory=list)
    pending_rows: list[int] = field(default_factory=list)
    """Rows whose input token is pending (async scheduling): a 0 here, the device fills it."""
    pending_requests: list[str] = field(default_factory=list)
    """The request id of each pending row."""
    verifies: bool = False
    """Some sampling request carries proposals: its last ``1 + k`` rows all sample (in
    ``sample_rows``), and the verifier, not the sampler, decides its tokens."""
    one_row_each: bool = False
    """Known to have one row per request (built from a decode-only step): ``max_query_len``
    is 1 without a scan of ``query_start``."""

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_pages(self) -> int:
        """Pages that cover the longest context of the step (the block table's width)."""
        return -(-max(self.seq_lens) // self.page_size)

    @property
    def max_query_len(self) -> int:
        if self.one_row_each and self.seq_lens:
            return 1
        return max(b - a for a, b in zip(self.query_start, self.query_start[1:]))

    @classmethod
    def build(cls, sched_out: SchedulerOutput, page: int, tables: BlockTables) -> HostBatch:
        if sched_out.num_batched_tokens == len(sched_out.requests):
            return cls._build_decode(sched_out, page, tables)
        b = cls(page)
        input_ids, positions, slots, query_start = b.input_ids, b.positions, b.slots, b.query_start
        # The loop body runs once per scheduled request per step: bound methods hoisted.
        add_id, add_position, add_slot = input_ids.append, positions.append, slots.append
        add_start, add_seq_len, add_table_row = (
            query_start.append,
            b.seq_lens.append,
            b.table_rows.append,
        )
        add_sample_row, add_sample_request = b.sample_rows.append, b.sample_requests.append
        add_pending_row, add_pending_request = b.pending_rows.append, b.pending_requests.append
        row_of, updates = tables.row_of, b.table_updates
        get_row = tables.rows.get
        num_rows = 0
        for req, n, bt, start, samples in zip(
            sched_out.requests,
            sched_out.num_new_tokens,
            sched_out.block_ids,
            sched_out.start_positions,
            sched_out.samples,
        ):
            end = start + n
            known = len(req.prompt_token_ids) + len(req.output_token_ids)
            num_spec = len(req.spec_token_ids)
            known += num_spec
            if end > known:  # the last input token is pending (sampled by the last launch)
                if end != known + 1:
                    raise RuntimeError(f"request {req.request_id}: more than one pending input")
                add_pending_row(num_rows + n - 1)
                add_pending_request(req.request_id)
            if n == 1:  # a decode row (or a one-token chunk): no ranges, no list copies
                add_id(0 if end > known else _known_ids(req, start, end, num_spec)[0])
                add_position(start)
                add_slot(bt[start // page] * page + start % page)
            else:
                input_ids.extend(_known_ids(req, start, end, num_spec))
                if end > known:
                    add_id(0)
                positions.extend(range(start, end))
                # slots page by page: one C-level range per page, not a Python step per token
                for i in range(start // page, (end - 1) // page + 1):
                    base = bt[i] * page
                    slots.extend(
                        range(base + max(start - i * page, 0), base + min(end - i * page, page))
                    )
            num_rows += n
            add_start(num_rows)
            add_seq_len(end)
            # most decode steps: the request's row as it is (``BlockTables.row_of``'s first case)
            row = get_row(req.request_id)
            if (
                row is not None
                and row.num_pages == len(bt)
                and row.request is req
                and (not bt or bt[-1] == row.last_page)
            ):
                add_table_row(row.index)
            else:
                add_table_row(row_of(req, bt, updates))
            if samples:
                if num_spec:  # a verification row: the known token and every proposal
                    b.sample_rows.extend(range(num_rows - 1 - num_spec, num_rows - 1))
                    b.verifies = True
                add_sample_row(num_rows - 1)
                add_sample_request(req)
        return b

    @classmethod
    def _build_decode(cls, sched_out: SchedulerOutput, page: int, tables: BlockTables) -> HostBatch:
        """``build`` for a step of one token per request (steady decode), in the same layout:
        the per-request lists whose entries follow from the start positions alone come from
        list comprehensions, the rest from one lean loop."""
        starts, block_ids = sched_out.start_positions, sched_out.block_ids
        n = len(starts)
        b = cls(
            page,
            positions=starts[:],
            slots=[bt[s // page] * page + s % page for bt, s in zip(block_ids, starts)],
            query_start=list(range(n + 1)),
            seq_lens=[s + 1 for s in starts],
            one_row_each=True,
        )
        input_ids, table_rows, updates = b.input_ids, b.table_rows, b.table_updates
        add_id, add_table_row = input_ids.append, table_rows.append
        add_pending_row, add_pending_request = b.pending_rows.append, b.pending_requests.append
        row_of, get_row = tables.row_of, tables.rows.get
        sample_rows, sample_requests = b.sample_rows, b.sample_requests
        i = 0
        for req, bt, start, samples in zip(
            sched_out.requests, block_ids, starts, sched_out.samples
        ):
            num_spec = len(req.spec_token_ids)
            known = len(req.prompt_token_ids) + len(req.output_token_ids) + num_spec
            if start >= known:  # the input token is pending (sampled by the last launch)
                if start != known:
                    raise RuntimeError(f"request {req.request_id}: more than one pending input")
                add_pending_row(i)
                add_pending_request(req.request_id)
                add_id(0)
            else:
                add_id(_known_ids(req, start, start + 1, num_spec)[0])
            # most steps: the request's row as it is (``BlockTables.row_of``'s first case)
            row = get_row(req.request_id)
            if (
                row is not None
                and row.num_pages == len(bt)
                and row.request is req
                and (not bt or bt[-1] == row.last_page)
            ):
                add_table_row(row.index)
            else:
                add_table_row(row_of(req, bt, updates))
            if samples:
                if num_spec:  # (as ``build``'s general case lays a verification row out)
                    sample_rows.extend(range(i - num_spec, i))
                    b.verifies = True
                sample_rows.append(i)
                sample_requests.append(req)
            i += 1
        return b

    def advanced(self, sched_out: SchedulerOutput, tables: BlockTables) -> HostBatch | None:
        """This batch moved on by one token per row for ``sched_out``, a steady decode step
        that advances the step this batch was built for (``SchedulerOutput.advances``) with
        every input pending: positions, slots and context lengths one further, and only the
        rows in ``sched_out.changed_rows`` (a new page, maybe) laid out again. None where this
        batch is not a decode batch whose rows all sample a pending input."""
        n = len(self.seq_lens)
        if (
            not self.one_row_each
            or self.verifies
            or len(self.pending_rows) != n
            or len(self.sample_rows) != n
            or len(sched_out.requests) != n
        ):
            return None
        page = self.page_size
        positions = sched_out.start_positions[:]
        b = HostBatch(
            page,
            input_ids=self.input_ids,  # all pending: zeros, filled on the device
            positions=positions,
            slots=[s + 1 for s in self.slots],  # the same page unless the row changed
            query_start=self.query_start,
            seq_lens=[s + 1 for s in positions],
            table_rows=self.table_rows,
            sample_rows=self.sample_rows,
            sample_requests=self.sample_requests,
            pending_rows=self.pending_rows,
            pending_requests=self.pending_requests,
            one_row_each=True,
        )
        changed = sched_out.changed_rows
        if changed:
            slots, block_ids, requests = b.slots, sched_out.block_ids, sched_out.requests
            table_rows = b.table_rows = self.table_rows[:]
            row_of, updates = tables.row_of, b.table_updates
            for i in changed:
                bt, start = block_ids[i], positions[i]
                slots[i] = bt[start // page] * page + start % page
                table_rows[i] = row_of(requests[i], bt, updates)
        return b


def _known_ids(request: Request, start: int, end: int, num_spec: int) -> list[int]:
    """``ScheduledRequest.token_ids`` of a row (positions ``[start, end)``): the ids the host
    knows, then the proposals it verifies (pending tokens excluded)."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_prompt = len(prompt)
    if num_spec:
        known = num_prompt + len(output)
        return (
            _known_ids(request, start, min(end, known), 0) + request.spec_token_ids[: end - known]
        )
    if end <= num_prompt:
        return prompt[start:end]
    if start >= num_prompt:  # decode rows: never copy the whole sequence
        return output[start - num_prompt : end - num_prompt]
    return prompt[start:] + output[: end - num_prompt]


def upload(
    lists: list[list[int]], device: torch.device, staging: PinnedStaging | None = None
) -> list[torch.Tensor]:
    """Int lists -> int64 tensors on ``device`` (views of one tensor), through one host tensor
    (pinned on CUDA) and one asynchronous copy. The lists are packed into an ``array`` (a
    C-level copy per list) and read as a tensor from its buffer: about half the time of
    ``torch.tensor`` over a Python list of the same ints. ``staging`` (CUDA): its reused pinned
    buffers carry the bytes (``worker/staging.py``) instead of a fresh pinned tensor."""
    joined: list[int] = []
    sizes: list[int] = []
    for values in lists:  # pointer copies; then one conversion to int64 (array.extend per
        joined += values  # list converts each int about half as fast as the constructor)
        if len(values) & 1:  # every view starts 16-byte aligned: Triton specializes pointer
            joined.append(0)  # alignment, so an odd list length would compile kernels mid-run
        sizes.append(len(values) + (len(values) & 1))
    flat = array("q", joined)
    if not flat:
        packed = torch.empty(0, dtype=torch.int64, device=device)
    elif device.type == "cpu":
        packed = torch.frombuffer(flat, dtype=torch.int64)  # keeps ``flat`` alive
    elif staging is not None:
        packed = staging.to_device(flat)
    else:
        host = torch.empty(len(flat), dtype=torch.int64, pin_memory=True)
        host.copy_(torch.frombuffer(flat, dtype=torch.int64))
        packed = host.to(device, non_blocking=True)
    return [view[: len(x)] for view, x in zip(packed.split(sizes), lists)]
