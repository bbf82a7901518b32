"""The host-side layout of mixed steps: token buckets, decode-first order, padded lists.

Plain Python over host lists (no Triton, no device work), shared by the runner's mixed-step path
(``worker/graph_mode.py``), the mixed CUDA graphs (``worker/mixed_graph.py``) and their CPU
tests. A bucket of ``T`` query rows holds ``num_decode_slots(T)`` decode rows and
``num_prefill_slots(T)`` prefill requests (the real ones, one padding request that owns rows
``n .. T``, empty ones).
"""

from __future__ import annotations

from roofline.core.outputs import SchedulerOutput
from roofline.worker.host_batch import HostBatch

DEFAULT_MAX_TOKENS = 1024
"""Largest mixed bucket: past it a step's GPU work dwarfs its launches (eager is fine)."""


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, then every 64 up to 512 and every 128 beyond, up to ``max_tokens``
    (padding waste at most 50% below 128 tokens, 12.5% above 512)."""
    sizes = [t for t in (16, 32, 64) if t < max_tokens]
    sizes += [t for t in range(128, min(512, max_tokens) + 1, 64)]
    sizes += [t for t in range(640, max_tokens + 1, 128)]
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


def num_leading_decodes(query_start: list[int]) -> int:
    """Requests at the front of the batch that bring one query row each: the largest ``i``
    with ``query_start[i] == i`` (``query_start[i] - i`` never decreases: a binary search)."""
    lo, hi = 0, len(query_start) - 1  # query_start[lo] == lo holds; find the last such index
    if query_start[hi] == hi:  # a decode-only step
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if query_start[mid] == mid:
            lo = mid
        else:
            hi = mid
    return lo


def decode_first(sched_out: SchedulerOutput) -> SchedulerOutput:
    """``sched_out`` with its one-token requests first (stable); the same object when they
    already are (the scheduler lists running requests, mostly decodes, before new ones). The
    check walks only the trailing multi-token requests: the ones before them are all one-token
    exactly when their count equals the tokens left (``num_batched_tokens`` is the sum)."""
    num_new = sched_out.num_new_tokens
    i, tail_tokens = len(num_new), 0
    while i and num_new[i - 1] != 1:
        i -= 1
        tail_tokens += num_new[i]
    if sched_out.num_batched_tokens - tail_tokens == i:
        return sched_out
    ones = [k for k, n in enumerate(num_new) if n == 1]
    rest = [k for k, n in enumerate(num_new) if n != 1]
    return sched_out.reordered(ones + rest)


MAX_GRAPH_PREFILLS = 16
"""Most prefill requests a mixed graph takes (more run eagerly): each prefill slot adds idle
prefill-kernel programs to every replay, and steps with many new prompts are large anyway."""


def num_prefill_slots(bucket: int) -> int:
    """Prefill request slots of a bucket: its real prefill requests plus the padding one."""
    return min(MAX_GRAPH_PREFILLS, max(1, bucket // 2)) + 1


def num_decode_slots(bucket: int, max_num_seqs: int) -> int:
    return min(bucket, max_num_seqs)


def fits_bucket(
    bucket: int, num_tokens: int, num_decodes: int, num_prefills: int, max_num_seqs: int
) -> bool:
    return (
        num_tokens <= bucket
        and num_prefills < num_prefill_slots(bucket)
        and num_decodes <= num_decode_slots(bucket, max_num_seqs)
    )


def padding_lists(
    batch: HostBatch, num_decodes: int, bucket: int, max_num_seqs: int
) -> list[list[int]]:
    """Host lists of the padded per-request buffers for ``batch`` (decode-first, its first
    ``num_decodes`` requests one row each) in ``bucket``: [prefill seq_lens (P), prefill
    query_start (P + 1), decode seq_lens (D)], P = ``num_prefill_slots``, D =
    ``num_decode_slots``. The prefill slots hold the requests after the decodes, then the
    padding request over rows ``n .. bucket`` (its context is its own rows), then empty ones."""
    n, d = batch.num_tokens, num_decodes
    if not fits_bucket(bucket, n, d, batch.num_reqs - d, max_num_seqs):
        raise ValueError(f"a step of {batch.num_reqs} requests, {n} rows misses bucket {bucket}")
    pad = num_prefill_slots(bucket) - (batch.num_reqs - d) - 1  # empty slots after the padding
    seq_lens = batch.seq_lens[d:] + [bucket - n] + [0] * pad
    query_start = batch.query_start[d:] + [bucket] * (pad + 1)
    decode = batch.seq_lens[:d] + [0] * (num_decode_slots(bucket, max_num_seqs) - d)
    return [seq_lens, query_start, decode]


def pool_bytes(max_tokens: int, hidden_size: int, intermediate_size: int, itemsize: int) -> int:
    """GPU memory the mixed graphs keep: the largest bucket's activations (a few hidden- and
    MLP-sized buffers per row) plus every bucket's output buffer."""
    act = max_tokens * (6 * hidden_size + 3 * intermediate_size) * itemsize
    outputs = sum(token_buckets(max_tokens)) * hidden_size * itemsize
    return act + outputs
