"""Cached prefixes of long chunks gathered out of the paged KV cache into contiguous rows, so the
descriptor (TMA) prefill attention reads them as whole boxes instead of page-by-page loads.

A chunk of a long prompt over a cached prefix (chunked prefill, a prefix-cache hit) spends most
of its attention on the prefix: a 2,048-token chunk over 8,192 cached tokens attends 89% of its
(query, key) pairs there. Inside the kernel those keys are gathered through the block table with
per-row addresses; gathered once per layer into contiguous rows here (``index_select`` of whole
pages: K and V of an 8k prefix, 8 KV heads of 128, are 2 x 16 MiB, read and written once), the
kernel's every query tile then reads them through tensor descriptors like the chunk's own keys.

Only requests whose chunk is long enough for the copy to pay (``MIN_QUERY_LEN`` rows: each key
is read by every query tile of every head of its group) are gathered; a request left out (decode
rows beside a chunk, short chunks) has ``start_loc = -1`` and the kernel reads its prefix from the
pages as before. The plan is built once per step from the metadata's host lists; the copy runs
once per layer. Not under CUDA graph capture (host-sized tensors).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from roofline.kernels import is_interpret

MIN_QUERY_LEN = 128
"""Chunks shorter than this keep reading their prefix from the pages."""
MAX_ROWS = 1 << 16
"""Gathered rows per step at most (8B: 2 x 128 MiB per layer's copy at this size)."""
MAX_REQUESTS = 16
"""Requests gathered per step at most (one slice each)."""


class PrefixPlan(NamedTuple):
    """Which pages one step gathers, and where each request's prefix lands."""

    pages: torch.Tensor  # [num_gathered_pages] int64, request after request
    start_loc: torch.Tensor  # [num_reqs] int32: first gathered row of each request, -1: none
    num_rows: int


class GatheredPrefix(NamedTuple):
    """One layer's gathered prefixes (rows ``start_loc[r] ..`` hold request ``r``'s positions
    ``0 ..`` up to its last prefix page's end; rows past its context are never read)."""

    k: torch.Tensor  # [num_rows, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_rows, num_kv_heads, head_dim]
    start_loc: torch.Tensor  # [num_reqs] int32, -1: read from the pages


def plan_prefix(
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: list[int],
    query_lens: list[int],
    page_size: int,
) -> PrefixPlan | None:
    """The step's gather plan from its host lists; None when no request qualifies."""
    starts: list[int] = []
    parts: list[torch.Tensor] = []
    num_rows = 0
    for r, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        context_len = seq_len - query_len
        num_pages = -(-context_len // page_size)
        rows = num_pages * page_size
        take = context_len > 0 and query_len >= MIN_QUERY_LEN and len(parts) < MAX_REQUESTS
        if take and num_rows + rows <= MAX_ROWS:
            starts.append(num_rows)
            parts.append(block_table[r, :num_pages])
            num_rows += rows
        else:
            starts.append(-1)
    if not parts:
        return None
    pages = torch.cat(parts).long()  # [num_gathered_pages]
    start_loc = torch.tensor(starts, dtype=torch.int32)  # [num_reqs]
    if block_table.is_cuda:  # no host wait for the queue (a pageable copy would synchronise)
        start_loc = start_loc.pin_memory().to(block_table.device, non_blocking=True)
    return PrefixPlan(pages, start_loc, num_rows)


def gather_prefix(
    plan: PrefixPlan,
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
) -> GatheredPrefix:
    """Copy the planned pages of one layer's K and V into contiguous rows."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.index_select(0, plan.pages).view(-1, num_kv_heads, head_dim)  # [rows, Hk, D]
    v = v_cache.index_select(0, plan.pages).view(-1, num_kv_heads, head_dim)  # [rows, Hk, D]
    return GatheredPrefix(k, v, plan.start_loc)


class PrefixGatherer:
    """A backend's gathering: the plan made once per step (the metadata object it was made for
    is remembered), the copy once per layer."""

    def __init__(self) -> None:
        self._step: tuple[object, list[int], PrefixPlan | None] | None = None

    def gather(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_new: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v_new: torch.Tensor,
        k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta,  # AttentionMetadata of the step
        k_scale: torch.Tensor | None = None,  # a quantized cache's: not gathered
    ) -> GatheredPrefix | None:
        """This layer's gathered prefixes, or None (no request qualifies, a quantized cache, a
        variant or tensors the descriptor kernel does not take, CUDA graph capture)."""
        if meta.max_query_len < MIN_QUERY_LEN or k_scale is not None:
            return None
        if not (q.is_cuda or is_interpret()):
            return None
        from roofline.kernels import prefill_attention as pa
        from roofline.kernels.prefill_attention_tma import tma_applies

        if not pa.DEFAULT_VARIANT.startswith("tma") or not tma_applies(q, k_new, v_new):
            return None
        step = self._step
        if step is None or step[0] is not meta or step[1] != meta.seq_lens_cpu:
            plan = None
            if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
                plan = plan_prefix(meta.block_table, meta.seq_lens_cpu, meta.query_lens_cpu,
                                   meta.page_size)  # fmt: skip
            self._step = step = (meta, list(meta.seq_lens_cpu), plan)
        plan = step[2]
        return None if plan is None else gather_prefix(plan, k_cache, v_cache)
