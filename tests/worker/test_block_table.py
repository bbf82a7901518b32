"""Device block tables updated incrementally (``worker/block_table.py``), the host batch and its
one-copy upload (``worker/host_batch.py``), and the decode graphs' input staging, on the CPU.

The invariant under test: after a step's updates are applied, gathering the step's rows gives
exactly each scheduled request's block table (as the KV manager holds it) in its first columns,
whatever came before: growth by a page, finished and preempted requests, reused ids and rows."""

from __future__ import annotations

import random

import pytest
import torch

from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import ModelRunnerOutput
from roofline.core.scheduler import Scheduler
from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.worker.block_table import BlockTables, TableUpdates
from roofline.worker.cuda_graph import DecodeGraphs
from roofline.worker.host_batch import HostBatch, upload
from roofline.worker.pending import PendingInputs

CPU = torch.device("cpu")


def _request(rid: str, prompt_len: int = 4, max_tokens: int = 16) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [5] * prompt_len, params, max_tokens=max_tokens)


def _apply(tables: BlockTables, updates: TableUpdates) -> int:
    flat, pages = upload([updates.flat_index, updates.page_ids], CPU)
    tables.apply(flat, pages)
    return len(updates.page_ids)


def _rows(tables: BlockTables, rows: list[int], width: int) -> list[list[int]]:
    return tables.gather(torch.tensor(rows), width).tolist()


def test_rows_grow_by_the_new_pages_only() -> None:
    tables = BlockTables(num_rows=4, max_blocks=8, device=CPU)
    a, b = _request("a"), _request("b")
    upd = TableUpdates()
    rows = [tables.row_of(a, [7, 3], upd), tables.row_of(b, [1], upd)]
    assert rows == [0, 1] and _apply(tables, upd) == 3
    assert _rows(tables, rows, 2) == [[7, 3], [1, 0]]

    upd = TableUpdates()  # a decode step that adds no page: nothing to write
    assert [tables.row_of(a, [7, 3], upd), tables.row_of(b, [1], upd)] == rows
    assert _apply(tables, upd) == 0

    upd = TableUpdates()  # one new page each
    assert [tables.row_of(b, [1, 9], upd), tables.row_of(a, [7, 3, 4], upd)] == [1, 0]
    assert upd.page_ids == [9, 4] and upd.flat_index == [1 * 8 + 1, 0 * 8 + 2]
    _apply(tables, upd)
    assert _rows(tables, [1, 0], 3) == [[1, 9, 0], [7, 3, 4]]
    assert tables.gather(torch.tensor([0]), 2).shape == (1, 2)


def test_a_table_that_does_not_extend_the_row_is_rewritten() -> None:
    tables = BlockTables(num_rows=2, max_blocks=6, device=CPU)
    a = _request("a")
    upd = TableUpdates()
    row = tables.row_of(a, [1, 2, 3], upd)
    _apply(tables, upd)
    for new in ([1, 2, 5, 6], [4, 5], [8, 6, 3, 9]):  # last page differs; shorter; differs
        upd = TableUpdates()
        assert tables.row_of(a, new, upd) == row and upd.page_ids == new  # written whole
        _apply(tables, upd)
        assert _rows(tables, [row], len(new)) == [new]
    upd = TableUpdates()
    assert tables.row_of(a, [8, 6, 3, 9, 0], upd) == row and upd.page_ids == [0]
    again = _request("a")  # the same id, another request (an id reused after a finish)
    upd = TableUpdates()
    assert tables.row_of(again, [8, 6, 3, 9, 0], upd) == row and upd.page_ids == [8, 6, 3, 9, 0]


def test_dropped_rows_are_reused_and_the_table_grows_when_full() -> None:
    tables = BlockTables(num_rows=2, max_blocks=4, device=CPU)
    upd = TableUpdates()
    reqs = [_request(str(i)) for i in range(3)]
    assert [tables.row_of(r, [i], upd) for i, r in enumerate(reqs[:2])] == [0, 1]
    tables.drop(["0", "unknown"])
    assert tables.num_rows_in_use == 1
    assert tables.row_of(reqs[2], [2, 6], upd) == 0  # row 0 again, written whole
    assert tables.row_of(_request("x"), [3], upd) == 2  # all rows taken: the table doubles
    assert tables.table.shape == (4, 4)
    _apply(tables, upd)
    assert _rows(tables, [1, 0, 2], 2) == [[1, 0], [2, 6], [3, 0]]
    with pytest.raises(RuntimeError, match="exceed the table's 4 columns"):
        tables.row_of(_request("y"), [1, 2, 3, 4, 5], TableUpdates())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("page_size", [1, 4])
def test_scheduler_steps_gather_every_block_table(seed: int, page_size: int) -> None:
    """Random prompts through the real scheduler in a pool small enough to preempt, with
    chunked prefill, finishes and new arrivals: each step's gathered table equals the KV
    manager's block tables, padded."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=128)
    kv = KVCacheManager(num_pages=48 // page_size, page_size=page_size, enable_prefix_caching=True)
    sched = Scheduler(config, kv, page_size)
    tables = BlockTables(num_rows=config.max_num_seqs, max_blocks=128 // page_size, device=CPU)
    next_id, preemptions = 0, 0
    for step in range(300):
        if step < 200 and rng.random() < 0.3:
            sched.add_request(_request(str(next_id), rng.randrange(1, 30), rng.randrange(1, 20)))
            next_id += 1
        out = sched.schedule()
        tables.drop(out.finished_request_ids)
        tables.drop(out.preempted_request_ids)
        preemptions += len(out.preempted_request_ids)
        if out.is_empty:
            continue
        batch = HostBatch.build(out, page_size, tables)
        ids, flat, pages, rows = upload(
            [batch.input_ids, batch.table_updates.flat_index, batch.table_updates.page_ids,
             batch.table_rows], CPU)  # fmt: skip
        tables.apply(flat, pages)
        got = tables.gather(rows, batch.num_pages).tolist()
        for entry, got_row in zip(out.scheduled, got):
            bt = kv.get_block_ids(entry.request.request_id)
            assert entry.block_ids == bt and got_row[: len(bt)] == bt
        assert ids.tolist() == batch.input_ids
        assert tables.num_rows_in_use <= config.max_num_seqs
        sampled = {e.request.request_id: 7 for e in out.scheduled if e.samples}
        sched.update(out, ModelRunnerOutput(sampled))
    assert preemptions > 0 and next_id > 20
    assert not sched.has_unfinished_requests()


def test_host_batch_lays_out_prefill_decode_and_pending_rows() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    kv = KVCacheManager(num_pages=16, page_size=4, enable_prefix_caching=False)
    sched = Scheduler(config, kv, 4)
    sched.add_request(_request("a", prompt_len=6))
    out = sched.schedule()  # a: 6-token prefill, samples one (pending) token
    tables = BlockTables(4, 16, CPU)
    first = HostBatch.build(out, 4, tables)
    assert first.positions == list(range(6)) and first.query_start == [0, 6]
    assert first.sample_rows == [5] and first.pending_rows == [] and first.num_pages == 2
    sched.add_request(_request("b", prompt_len=3))
    out = sched.schedule()  # a decodes its pending token; b prefills 3
    batch = HostBatch.build(out, 4, tables)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert batch.input_ids == [0, 5, 5, 5] and batch.pending_rows == [0]
    assert batch.pending_requests == ["a"] and batch.positions == [6, 0, 1, 2]
    a_pages, b_pages = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert batch.slots == [a_pages[1] * 4 + 2] + [b_pages[0] * 4 + p for p in range(3)]
    assert batch.seq_lens == [7, 3] and batch.query_start == [0, 1, 4]
    assert batch.table_rows == [0, 1] and batch.sample_rows == [0, 3]
    assert batch.max_query_len == 3 and batch.num_tokens == 4


def test_upload_splits_one_tensor() -> None:
    parts = upload([[1, 2], [], [3], [4, 5, 6]], CPU)
    assert [p.tolist() for p in parts] == [[1, 2], [], [3], [4, 5, 6]]
    assert all(p.dtype == torch.int64 for p in parts)
    assert parts[0].untyped_storage().data_ptr() == parts[3].untyped_storage().data_ptr()


def test_decode_graph_inputs_are_staged_with_padding() -> None:
    """What a CUDA-graph decode step copies into its static buffers, on the CPU (no capture):
    bucket 4 for 3 rows, the gathered block table, the pending ids filled, padding rows."""
    graphs = DecodeGraphs(None, [], None, max_batch=8, max_model_len=16, page_size=4, device=CPU)
    tables = BlockTables(8, 4, CPU)
    upd = TableUpdates()
    rows = [tables.row_of(_request(r), bt, upd) for r, bt in (("a", [3]), ("b", [1, 2, 5]))]
    rows.append(tables.row_of(_request("c"), [9, 8], upd))
    _apply(tables, upd)
    ids, pos, slots, seq_lens, table_rows, dst = upload(
        [[11, 0, 13], [2, 9, 5], [14, 21, 33], [3, 10, 6], rows, [1]], CPU
    )
    pending = PendingInputs(torch.tensor([40, 41]), torch.tensor([1]), dst)
    bs = graphs.stage_inputs(ids, pos, slots, seq_lens, tables, table_rows, pending)
    assert bs == 4
    assert graphs.input_ids[:3].tolist() == [11, 41, 13]
    assert graphs.positions[:3].tolist() == [2, 9, 5]
    assert graphs.slot_mapping[:4].tolist() == [14, 21, 33, -1]
    assert graphs.seq_lens[:4].tolist() == [3, 10, 6, 1] and graphs.seq_lens.dtype == torch.int32
    assert graphs.block_table[:3].tolist() == [[3, 0, 0, 0], [1, 2, 5, 0], [9, 8, 0, 0]]
