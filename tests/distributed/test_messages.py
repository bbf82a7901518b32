"""The step message the engine sends its tensor-parallel workers: mirrors are created once,
fed new output tokens only when their sampling reads them, and a plain decode step carries only
request ids."""

from __future__ import annotations

import pickle

import pytest

from roofline.distributed.messages import StepPacker, StepUnpacker
from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.worker.block_table import TableUpdates
from roofline.worker.host_batch import HostBatch


def _batch(reqs: list[Request]) -> HostBatch:
    n = len(reqs)
    b = HostBatch(16)
    b.input_ids, b.positions, b.slots = list(range(n)), list(range(5, 5 + n)), list(range(n))
    b.query_start, b.seq_lens = list(range(n + 1)), [7] * n
    b.table_rows, b.sample_rows, b.pending_rows = list(range(n)), list(range(n)), []
    b.table_updates = TableUpdates()
    b.table_updates.flat_index, b.table_updates.page_ids = [3], [9]
    b.pending_requests, b.sample_requests = [], reqs
    return b


def test_mirrors_round_trip():
    plain = Request("a", [1, 2, 3], SamplingParams(temperature=0.0), eos_token_ids=frozenset({2}))
    pen = Request("b", [4, 5], SamplingParams(repetition_penalty=1.3, min_tokens=2))
    packer, worker = StepPacker(), StepUnpacker(16)
    msg, batch = worker.unpack(packer.pack(_batch([plain, pen]), [], []))
    assert batch is not None and batch.positions == [5, 6] and batch.table_updates.page_ids == [9]
    a, b = batch.sample_requests
    assert (a.request_id, a.eos_token_ids, a.sampling_params.temperature) == ("a", {2}, 0.0)
    assert b.prompt_token_ids == [4, 5]  # the penalty reads the prompt
    pen.output_token_ids.extend([7, 8])
    plain.output_token_ids.append(6)
    payload = packer.pack(_batch([plain, pen]), [], [])
    msg = pickle.loads(payload)
    assert msg.sample_ids == ["a", "b"] and not msg.new_mirrors
    assert msg.new_output_ids == {"b": [7, 8]}  # nothing for the request that reads no history
    _, batch = worker.unpack(payload)
    assert batch.sample_requests[1].output_token_ids == [7, 8]
    assert batch.sample_requests[0].output_token_ids == []
    assert not pickle.loads(packer.pack(_batch([plain, pen]), [], [])).new_output_ids
    worker.unpack(packer.pack(None, ["a"], []))
    assert "a" not in worker.mirrors
    with pytest.raises(RuntimeError, match="request b samples with no mirror"):
        StepUnpacker(16).unpack(packer.pack(_batch([pen]), [], []))  # a worker that missed it
