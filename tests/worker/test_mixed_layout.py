"""The host-side layout of mixed steps (``worker/mixed_layout.py``): buckets, decode-first
order, the padded per-request lists a bucket's graph reads. Exact values, no device."""

from __future__ import annotations

from roofline.core.outputs import ScheduledRequest, SchedulerOutput
from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.worker.host_batch import HostBatch
from roofline.worker.mixed_layout import (
    MAX_GRAPH_PREFILLS,
    decode_first,
    fits_bucket,
    num_leading_decodes,
    num_prefill_slots,
    padding_lists,
    pool_bytes,
    token_buckets,
)


def _out(*lens: int) -> SchedulerOutput:
    scheduled = [
        ScheduledRequest(Request(f"r{i}", [1], SamplingParams()), n, [0], 0, True)
        for i, n in enumerate(lens)
    ]
    return SchedulerOutput(scheduled=scheduled, num_batched_tokens=sum(lens))


def _batch(query_lens: list[int], seq_lens: list[int]) -> HostBatch:
    b = HostBatch(16)
    for q, s in zip(query_lens, seq_lens, strict=True):
        b.input_ids.extend([0] * q)
        b.query_start.append(b.query_start[-1] + q)
        b.seq_lens.append(s)
    return b


def test_token_buckets() -> None:
    assert token_buckets(1024) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512] + [
        640,
        768,
        896,
        1024,
    ]
    assert token_buckets(300) == [16, 32, 64, 128, 192, 256, 300]
    assert token_buckets(64) == [16, 32, 64]
    assert token_buckets(8) == [8]
    for cap in (16, 100, 700, 2048):
        b = token_buckets(cap)
        assert b == sorted(set(b)) and b[-1] == cap


def test_num_leading_decodes() -> None:
    assert num_leading_decodes([0, 1, 2, 3]) == 3
    assert num_leading_decodes([0, 1, 2, 9, 10]) == 2
    assert num_leading_decodes([0, 5, 6]) == 0
    assert num_leading_decodes([0]) == 0
    assert num_leading_decodes([0, 1, 3, 4, 6]) == 1  # a one-row request after a prefill
    for d in range(40):  # against the plain walk
        qs = list(range(d + 1)) + [d + 2 + 3 * i for i in range(7)]
        assert num_leading_decodes(qs) == d


def test_decode_first_is_stable_and_lazy() -> None:
    out = _out(1, 1, 7, 3)
    assert decode_first(out) is out  # already decode-first: no copy
    out = _out(1, 7, 1, 3, 1)
    reordered = decode_first(out)
    assert [s.request.request_id for s in reordered.scheduled] == ["r0", "r2", "r4", "r1", "r3"]
    # the original is untouched
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1", "r2", "r3", "r4"]
    assert reordered.num_batched_tokens == out.num_batched_tokens
    decode_only = _out(1, 1, 1)
    assert decode_first(decode_only) is decode_only
    only_prefill = _out(5, 9)
    assert decode_first(only_prefill) is only_prefill


def test_slots_and_fit() -> None:
    assert num_prefill_slots(16) == 9 and num_prefill_slots(64) == MAX_GRAPH_PREFILLS + 1 == 17
    assert num_prefill_slots(1024) == MAX_GRAPH_PREFILLS + 1
    assert fits_bucket(64, 64, 10, 16, max_num_seqs=256)
    assert not fits_bucket(64, 65, 10, 3, max_num_seqs=256)  # rows
    assert not fits_bucket(64, 60, 10, 17, max_num_seqs=256)  # prefill requests
    assert not fits_bucket(64, 60, 9, 3, max_num_seqs=8)  # decode rows


def test_padding_lists() -> None:
    b = _batch([1, 1, 5, 3], [10, 20, 7, 30])  # 10 rows, 2 decodes, 2 prefills
    seq_lens, query_start, decode = padding_lists(b, 2, 16, max_num_seqs=4)
    # 9 prefill slots: the 2 real ones, the padding request over rows 10..16, 6 empty
    assert seq_lens == [7, 30, 6] + [0] * 6
    assert query_start == [2, 7, 10] + [16] * 7
    assert decode == [10, 20, 0, 0]  # 4 decode slots
    # a full bucket: the padding request is empty
    b = _batch([1, 15], [3, 15])
    seq_lens, query_start, decode = padding_lists(b, 1, 16, max_num_seqs=2)
    assert seq_lens == [15, 0] + [0] * 7 and query_start == [1, 16] + [16] * 8
    assert decode == [3, 0]


def test_padding_lists_refuses_a_step_too_big() -> None:
    b = _batch([1, 1, 5], [10, 20, 7])
    for bucket, seqs in ((4, 8), (16, 1)):
        try:
            padding_lists(b, 2, bucket, max_num_seqs=seqs)
        except ValueError:
            continue
        raise AssertionError(f"bucket {bucket} with {seqs} slots accepted 7 rows x 3 requests")


def test_pool_bytes_counts_the_largest_bucket_and_every_output() -> None:
    got = pool_bytes(64, hidden_size=8, intermediate_size=16, itemsize=2)
    assert got == 64 * (6 * 8 + 3 * 16) * 2 + (16 + 32 + 64) * 8 * 2
