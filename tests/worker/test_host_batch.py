"""``HostBatch.build``'s decode-only fast path against its general loop.

A step of one token per request takes ``HostBatch._build_decode`` (per-request lists from list
comprehensions); every other step the general loop. Random scheduler runs (async scheduling:
pending input tokens; chunked prefills; preemptions in a small pool; finished requests dropping
their block-table rows) lay every decode-only step out both ways, each over its own copy of the
block tables, and the two batches (and the table updates) must be identical.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import ModelRunnerOutput
from roofline.core.scheduler import Scheduler
from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.worker.block_table import BlockTables
from roofline.worker.host_batch import HostBatch

PS = 4


def _general(sched_out, tables: BlockTables) -> HostBatch:
    """The general loop on a decode-only step (``build`` would take the fast path)."""
    real = sched_out.num_batched_tokens
    sched_out.num_batched_tokens = -1  # not decode-only as far as ``build`` can tell
    try:
        return HostBatch.build(sched_out, PS, tables)
    finally:
        sched_out.num_batched_tokens = real


def _clone(tables: BlockTables) -> BlockTables:
    """A copy of the tables whose rows still point at the same request objects."""
    other = copy.copy(tables)
    other.table = tables.table.clone()
    other._rows = {rid: dataclasses.replace(row) for rid, row in tables._rows.items()}
    other._free = list(tables._free)
    return other


@pytest.mark.parametrize("seed", range(6))
def test_decode_fast_path_matches_the_general_loop(seed: int) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(8, 24, 64)
    sched = Scheduler(config, KVCacheManager(40, PS, True), PS)
    tables = BlockTables(8, 16, torch.device("cpu"))
    in_flight = None
    num_decode_steps = num_pending = num_updates = num_known = 0
    for step in range(120):
        if rng.random() < 0.3:
            prompt = [rng.randrange(50) for _ in range(rng.randint(1, 20))]
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30))
            sched.add_request(Request(f"r{step}", prompt, params, max_tokens=params.max_tokens))
        out = sched.schedule()
        tables.drop(out.finished_request_ids + out.preempted_request_ids)
        if out.requests and out.num_batched_tokens == len(out.requests):
            num_decode_steps += 1
            other = _clone(tables)
            fast = HostBatch.build(out, PS, tables)
            slow = _general(out, other)
            assert fast.one_row_each and not slow.one_row_each
            assert fast.max_query_len == slow.max_query_len == 1
            got = dataclasses.asdict(dataclasses.replace(fast, one_row_each=False))
            want = dataclasses.asdict(slow)
            for key in ("table_updates", "sample_requests"):
                got.pop(key), want.pop(key)
            assert got == want
            assert fast.sample_requests == slow.sample_requests
            assert fast.table_updates.flat_index == slow.table_updates.flat_index
            assert fast.table_updates.page_ids == slow.table_updates.page_ids
            assert torch.equal(tables.table, other.table)
            num_pending += bool(fast.pending_rows)
            num_known += len(fast.pending_rows) < fast.num_reqs
            num_updates += bool(fast.table_updates.flat_index)
        else:
            HostBatch.build(out, PS, tables)
        if in_flight is not None:  # async scheduling: fold the previous step in now
            prev = in_flight
            sampled = {
                r.request_id: rng.randrange(50) for r, s in zip(prev.requests, prev.samples) if s
            }
            sched.update(prev, ModelRunnerOutput(sampled))
        in_flight = out if out.requests else None
    assert num_decode_steps >= 10 and num_pending and num_updates and num_known


@pytest.mark.parametrize("seed", range(4))
def test_steady_step_advances_the_last_batch(seed: int) -> None:
    """``HostBatch.advanced`` (a steady decode step: ``core/steady.py``) against ``build`` on
    the same step, over long async decode runs with bursts of arrivals and page crossings."""
    rng = random.Random(seed)
    page = (4, 16, 2, 8)[seed]
    sched = Scheduler(SchedulerConfig(8, 64, 96), KVCacheManager(200, page, True), page)
    tables = BlockTables(8, 96 // page, torch.device("cpu"))
    in_flight, last = None, (None, None)
    num_advanced = num_changed = 0
    for step in range(400):
        if step % 60 == 0:
            for i in range(rng.randint(1, 8)):
                prompt = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
                params = SamplingParams(temperature=0.0, max_tokens=rng.randint(20, 60))
                rid = f"r{step}-{i}"
                sched.add_request(Request(rid, prompt, params, max_tokens=params.max_tokens))
        out = sched.schedule()
        tables.drop(out.finished_request_ids + out.preempted_request_ids)
        batch = None
        if out.advances is not None and out.advances is last[0] and out.inputs_pending:
            other = _clone(tables)
            batch = last[1].advanced(out, tables)
            assert batch is not None
            want = HostBatch.build(out, page, other)
            got_d, want_d = dataclasses.asdict(batch), dataclasses.asdict(want)
            for key in ("table_updates", "sample_requests"):
                got_d.pop(key), want_d.pop(key)
            assert got_d == want_d
            assert batch.sample_requests == want.sample_requests
            assert batch.table_updates.flat_index == want.table_updates.flat_index
            assert batch.table_updates.page_ids == want.table_updates.page_ids
            num_advanced += 1
            num_changed += bool(batch.table_updates.flat_index)
        if batch is None:
            batch = HostBatch.build(out, page, tables)
        last = (out, batch)
        if in_flight is not None:
            prev = in_flight
            ids = [r.request_id for r, s in zip(prev.requests, prev.samples) if s]
            tokens = [rng.randrange(50) for _ in ids]
            sched.update(prev, ModelRunnerOutput(None, token_ids=tokens, request_ids=ids))
        in_flight = out if out.requests else None
    assert num_advanced > 100 and num_changed > 5
