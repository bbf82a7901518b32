"""Long prompt chunks through torch's SDPA (cuDNN backend): a prefill strategy of the Triton
attention backends.

On the H100 cuDNN's fused attention ran the 8k causal prompt of Llama-3.1-8B (32 query heads, 8
KV heads, d 128, GQA native) at 566 TFLOP/s against 405-415 for our descriptor kernel
(``kernels/prefill_attention_tma.py``). This strategy hands it the requests of an eager prefill
step whose chunk has at least ``min_query_len`` rows and is fresh (no cached prefix) or sits
over a prefix short enough (``plan_segments``'s cost rule); every other request (long prefixes,
short chunks, decode rows) keeps the Triton kernels, launched over runs of consecutive such
requests with their own freshly allocated metadata (``sdpa_runs.py``).

torch aligns ``is_causal`` top-left (its ``causal_lower_right`` bias runs on flash or
efficient attention, or a materialised mask, never cuDNN), and its ragged cuDNN form (nested
tensors) is experimental (``TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED``), rebuilds its graph on
every call in the sources read and expects densely packed ``[tokens, heads, d]`` rows; so each
segment is one call over a *window* that starts at position 0: the cached prefix's keys and
values (copied from the pages, zero queries whose outputs are dropped), the chunk's rows, then
padding up to a bucket length (``bucket_len``: ``BUCKETS_PER_OCTAVE`` lengths per power of
two). A real query row attends only to keys at or before itself, so the mask is exactly the
chunk's and the padding changes nothing.
cuDNN builds an execution graph per shape (length and strides): fresh segments are read in place
when q/k/v are views of one QKV row per token (the model's layout) and the bucket's rows exist
in the step's tensor; otherwise the window is a copy in the same layout (same strides, same
graph). The warm-up (``warm_up``) builds every bucket's graph at start-up; once it has run, only
those buckets are used, so serving never builds one.

Eager steps only: under CUDA graph capture ``plan`` returns None. On by default
(``ROOFLINE_SDPA_PREFILL=0`` turns it off). H100, 8B, same process (``scripts/gpu_sdpa.py``,
2026-11-24): 8192-token prefill 224.9 -> 222.6 ms, 7808 over 192 cached 221.9 -> 217.6 ms; a
layer's attention at 8192 tokens 1.26 -> 1.02 ms; at 2048 padded windows are no faster than our
kernel, hence the 4096-row threshold. A fresh process starts in 8.4 s with the warm-up and its
first preset runs compile nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ENABLED = os.environ.get("ROOFLINE_SDPA_PREFILL", "1") == "1"
MIN_QUERY_LEN = int(os.environ.get("ROOFLINE_SDPA_MIN_LEN", "4096"))
"""Shortest fresh segment sent to cuDNN (a measured threshold: below it our kernels run)."""
BUCKETS_PER_OCTAVE = int(os.environ.get("ROOFLINE_SDPA_BUCKETS_PER_OCTAVE", "8"))
"""Bucket lengths per power of two: a segment pads by at most ~1/8 of its length; each bucket
is one graph the warm-up builds (4096 .. 8192: 9)."""
MIN_GRANULE = 128
"""Buckets are multiples of this (cuDNN before 9.15.1 mishandled lengths not divisible by 128)."""
MAX_PAD_COST = 1.25
"""A segment goes to cuDNN only if its window's causal work (``bucket^2``: prefix and padding
rows included) is at most this multiple of the chunk's own (cuDNN measured ~1.4x our kernel's
rate at 8k)."""
WITH_CONTEXT = True
"""Chunks over a (short) cached prefix too: the prefix's keys and values copied from the pages
into the window's first rows, queries of zeros there (their outputs are dropped). The causal
mask, aligned top-left over the whole window, is then exactly the chunk's."""


def bucket_len(num_rows: int, per_octave: int | None = None,
               min_granule: int | None = None) -> int:  # fmt: skip
    """The padded length of a ``num_rows`` segment: the next multiple of its octave's granule
    (``next_pow2(num_rows) / (2 * per_octave)``, at least ``min_granule``; defaults: the
    module's ``BUCKETS_PER_OCTAVE`` and ``MIN_GRANULE``)."""
    if num_rows <= 0:
        raise ValueError(f"bucket_len: num_rows must be positive, got {num_rows}")
    per_octave = BUCKETS_PER_OCTAVE if per_octave is None else per_octave
    min_granule = MIN_GRANULE if min_granule is None else min_granule
    octave = 1 << (num_rows - 1).bit_length()  # next power of two >= num_rows
    granule = max(min_granule, octave // (2 * per_octave))
    return -(-num_rows // granule) * granule


def bucket_lengths(lo: int, hi: int, **kw) -> list[int]:  # noqa: ANN003 - bucket_len's
    """Every bucket a segment of ``lo .. hi`` rows can take, ascending."""
    out: list[int] = []
    n = max(1, lo)
    while n <= hi:
        b = bucket_len(n, **kw)
        out.append(b)
        n = b + 1
    return out


class Segment(NamedTuple):
    """One request's chunk sent to SDPA: window rows ``0 .. context`` hold its cached prefix
    (keys and values from the pages, zero queries), then its ``num_rows`` rows, then padding."""

    req: int  # index among the metadata's requests
    start: int  # first row in the step's q/k/v
    num_rows: int
    bucket: int  # padded length of the window (>= context + num_rows)
    context: int = 0  # cached positions before the chunk


class Run(NamedTuple):
    """Consecutive requests left to the Triton kernels: requests ``first .. end - 1``, rows
    ``start .. stop - 1`` of the step."""

    first: int
    end: int
    start: int
    stop: int


class StepPlan(NamedTuple):
    segments: list[Segment]
    runs: list[Run]
    num_tokens: int  # rows of the step's q (every row, decode rows of a split step included)


def plan_segments(
    query_start: list[int],  # [num_reqs + 1] absolute first rows (the metadata's host list)
    seq_lens: list[int],  # [num_reqs]
    num_tokens: int,
    min_query_len: int = MIN_QUERY_LEN,
    allowed: set[int] | None = None,  # buckets whose graphs exist; None: any
    **bucket_kw,  # noqa: ANN003 - bucket_len's
) -> StepPlan | None:
    """Which requests go to SDPA and the runs of the rest; None when no request qualifies.
    A chunk of at least ``min_query_len`` rows qualifies when its window (cached prefix, rows,
    padding to the bucket) costs at most ``MAX_PAD_COST`` times its causal work, ``n^2 + 2 n
    ctx`` (in half (query, key) pairs); a chunk over a prefix only with ``WITH_CONTEXT``."""
    segments: list[Segment] = []
    runs: list[Run] = []
    run_first = 0
    for r, seq_len in enumerate(seq_lens):
        start, stop = query_start[r], query_start[r + 1]
        n = stop - start
        ctx = seq_len - n
        if n < min_query_len or ctx < 0 or (ctx and not WITH_CONTEXT):
            continue
        b = bucket_len(ctx + n, **bucket_kw)
        if b * b > MAX_PAD_COST * (n * n + 2 * n * ctx):
            continue
        if allowed is not None and b not in allowed:
            continue
        if run_first < r and query_start[run_first] < start:
            runs.append(Run(run_first, r, query_start[run_first], start))
        segments.append(Segment(r, start, n, b, ctx))
        run_first = r + 1
    if not segments:
        return None
    last = len(seq_lens)
    if run_first < last and query_start[run_first] < query_start[last]:
        runs.append(Run(run_first, last, query_start[run_first], query_start[last]))
    return StepPlan(segments, runs, num_tokens)


def packed_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``[num_tokens, (H + 2 Hk) * D]``: the one QKV row per token that q/k/v are views of (the
    model's layout), or None when they are not."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    row = (num_heads + 2 * num_kv_heads) * head_dim
    esize = q.element_size()
    for t in (q, k, v):
        if t.stride() != (row, head_dim, 1) or t.shape[0] != num_tokens:
            return None
    if k.data_ptr() - q.data_ptr() != num_heads * head_dim * esize:
        return None
    if v.data_ptr() - k.data_ptr() != num_kv_heads * head_dim * esize:
        return None
    if q.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None
    return q.as_strided((num_tokens, row), (row, 1))  # [num_tokens, row]


def split_rows(rows: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """q, k, v views ``[n, H, D]``, ``[n, Hk, D]`` x 2 of ``[n, (H + 2 Hk) * D]`` rows."""
    n = rows.shape[0]
    q = rows[:, : num_heads * head_dim].view(n, num_heads, head_dim)
    k = rows[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    v = rows[:, (num_heads + num_kv_heads) * head_dim :]
    return q, k.view(n, num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim)


def causal_sdpa(
    q: torch.Tensor,  # [n, H, D]
    k: torch.Tensor,  # [n, Hk, D]
    v: torch.Tensor,  # [n, Hk, D]
    scale: float,
) -> torch.Tensor:  # [n, H, D]
    """Causal GQA attention of one sequence through SDPA: cuDNN on CUDA, the math backend
    elsewhere (the CPU tests' stand-in: same call, same mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.CUDNN_ATTENTION if q.is_cuda else SDPBackend.MATH
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, D]
    with sdpa_kernel([backend]):
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                           enable_gqa=True)  # fmt: skip
    return o[0].transpose(0, 1)  # [n, H, D] (contiguous: cuDNN matches q's layout)


def attend_segment(
    seg: Segment,
    q: torch.Tensor,  # [num_tokens, H, D]
    k: torch.Tensor,  # [num_tokens, Hk, D]
    v: torch.Tensor,
    scale: float,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,  # [context, Hk, D] K and V
) -> torch.Tensor:  # [seg.bucket, H, D]; the segment's rows at context .. context + num_rows
    """One segment's attention over its window: in place when it has no prefix and the
    bucket's rows exist in the step's packed QKV rows, else through a copy in the same
    layout (prefix rows, the segment's rows, zeros)."""
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k.shape[1]
    rows = packed_rows(q, k, v)
    s, n, b, c = seg.start, seg.num_rows, seg.bucket, seg.context
    if not c and rows is not None and s + b <= rows.shape[0]:
        window = rows[s : s + b]  # [b, row]: the rows after the segment are padding
    else:
        row = (num_heads + 2 * num_kv_heads) * head_dim
        window = q.new_empty(b, row)  # [b, row], the packed layout: the same graph
        wq, wk, wv = split_rows(window, num_heads, num_kv_heads, head_dim)
        if c:
            assert prefix is not None, "a segment over a cached prefix needs its K/V"
            wq[:c].zero_()
            wk[:c].copy_(prefix[0])
            wv[:c].copy_(prefix[1])
        if rows is not None:
            window[c : c + n] = rows[s : s + n]
        else:
            wq[c : c + n].copy_(q[s : s + n])
            wk[c : c + n].copy_(k[s : s + n])
            wv[c : c + n].copy_(v[s : s + n])
        window[c + n :].zero_()
    return causal_sdpa(*split_rows(window, num_heads, num_kv_heads, head_dim), scale)


def cached_prefix(
    seg: Segment,
    k_cache: torch.Tensor,  # [num_pages, page_size, Hk, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The segment's cached K and V ``[context, Hk, D]``, gathered from its pages."""
    if not seg.context:
        return None
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    pages = block_table[seg.req, : -(-seg.context // page_size)]  # [num_pages] int32
    k = k_cache.index_select(0, pages).view(-1, num_kv_heads, head_dim)[: seg.context]
    v = v_cache.index_select(0, pages).view(-1, num_kv_heads, head_dim)[: seg.context]
    return k, v


class SdpaPrefill:
    """A Triton backend's SDPA strategy: the plan made once per step (the metadata object it
    was made for is remembered), the segments' attention per layer."""

    def __init__(self, min_query_len: int | None = None, enabled: bool | None = None) -> None:
        self.min_query_len = MIN_QUERY_LEN if min_query_len is None else min_query_len
        self.enabled = ENABLED if enabled is None else enabled
        self.ready: set[int] | None = None  # buckets built by warm_up; None: not warmed
        self.warmup_s: dict[int, float] = {}  # bucket -> seconds of its first call
        self._warmed: tuple[tuple, set[int]] | None = None  # (warm_up's args, its threads)
        self._step: tuple[object, list[int], StepPlan | None] | None = None
        self._runs: tuple | None = None  # (plan, its runs' metadata, the step's kernel)

    def disable(self, err: Exception) -> None:
        log.warning("SDPA prefill path disabled, the Triton kernels take over: %s", err)
        self.enabled = False

    def plan(self, q: torch.Tensor, meta, kv_quantized: bool) -> StepPlan | None:  # noqa: ANN001
        """This step's plan, or None (off, nothing long and fresh, a quantized cache, a dtype or
        head size cuDNN does not take, CUDA graph capture, speculative or cascade steps)."""
        if not self.enabled or kv_quantized or meta.max_query_len < self.min_query_len:
            return None
        if getattr(meta, "uniform_query_len", 0) > 1 or getattr(meta, "cascade", None):
            return None
        head_dim = q.shape[-1]
        if q.is_cuda:
            if q.dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 128:
                return None
            if torch.cuda.is_current_stream_capturing():
                return None
        if self._warmed is not None and threading.get_ident() not in self._warmed[1]:
            self._warm_this_thread()
        step = self._step
        if step is None or step[0] is not meta or step[1] != meta.seq_lens_cpu:
            p = plan_segments(meta.query_start_loc_cpu, meta.seq_lens_cpu, q.shape[0],
                              self.min_query_len, self.ready)  # fmt: skip
            self._step = step = (meta, list(meta.seq_lens_cpu), p)
        return step[2]

    def whole_step(self, plan: StepPlan) -> bool:
        """One segment that is every row of the step: a view of SDPA's output is the step's
        output (no copy)."""
        return len(plan.segments) == 1 and plan.segments[0].num_rows == plan.num_tokens

    def forward(
        self,
        plan: StepPlan,
        q: torch.Tensor,  # [num_tokens, H, D], rotated, K/V already stored
        k: torch.Tensor,  # [num_tokens, Hk, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_pages, page_size, Hk, D]
        v_cache: torch.Tensor,
        meta,  # noqa: ANN001 - the step's (or a split step's prefill part's) metadata
        scale: float,
        out: torch.Tensor | None = None,  # [num_tokens, H, D]: decode rows already written
        gather=None,  # noqa: ANN001 - () -> the step's gathered prefixes (prefix_gather.py)
    ) -> torch.Tensor:  # [num_tokens, H, D]
        """The segments through SDPA, the runs through the Triton kernels (``gather`` called
        when they take the per-head kernel, as the whole step would have)."""
        bt = meta.block_table
        if out is None and self.whole_step(plan):
            seg = plan.segments[0]
            o = attend_segment(seg, q, k, v, scale, cached_prefix(seg, k_cache, v_cache, bt))
            return o[seg.context : seg.context + seg.num_rows]  # [num_tokens, H, D]
        if out is None:
            out = torch.empty_like(q)
        for seg in plan.segments:
            pre = cached_prefix(seg, k_cache, v_cache, bt)
            o = attend_segment(seg, q, k, v, scale, pre)  # [bucket, H, D]
            out[seg.start : seg.start + seg.num_rows] = o[seg.context : seg.context + seg.num_rows]
        if plan.runs:
            from roofline.attention import sdpa_runs

            if self._runs is None or self._runs[0] is not plan:
                kernel = sdpa_runs.step_kernel(meta, q.shape[1], k.shape[1])
                self._runs = (plan, sdpa_runs.run_metadata(plan, meta), kernel)
            _, runs, kernel = self._runs
            prefix = gather() if gather is not None and not kernel.packed else None
            sdpa_runs.attend_runs(runs, kernel, q, k, v, k_cache, v_cache, scale, out, prefix)
        return out

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, max_rows: int) -> int:  # fmt: skip
        """Build the graph of every bucket from ``min_query_len`` to ``max_rows`` (one call
        each on zeros in the model's packed layout); from then on only these buckets are used.
        Returns the number built; a failure disables the strategy."""
        if not self.enabled or max_rows < self.min_query_len:
            return 0
        args = (num_heads, num_kv_heads, head_dim, dtype, device, max_rows)
        threads = set() if self._warmed is None else self._warmed[1]
        self._warmed = (args, threads | {threading.get_ident()})
        buckets = bucket_lengths(self.min_query_len, max_rows)
        row = (num_heads + 2 * num_kv_heads) * head_dim
        try:
            for b in buckets:
                rows = torch.zeros(b, row, dtype=dtype, device=device)  # [b, row]
                t0 = time.perf_counter()
                causal_sdpa(*split_rows(rows, num_heads, num_kv_heads, head_dim), head_dim**-0.5)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                self.warmup_s[b] = time.perf_counter() - t0
        except RuntimeError as e:
            self.disable(e)
            return 0
        self.ready = set(buckets)
        return len(buckets)

    def _warm_this_thread(self) -> None:
        """torch keeps cuDNN's attention graphs per thread: a step loop on another thread than
        the start-up's (``engine/core.py``'s ``ThreadCore``) builds its buckets once, here."""
        t0 = time.perf_counter()
        n = self.warm_up(*self._warmed[0])
        log.info("SDPA prefill: %d bucket graphs for a new thread in %.2f s", n,
                 time.perf_counter() - t0)  # fmt: skip


def warm_up_model(backend, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                  max_rows: int) -> int:  # noqa: ANN001 - an attention backend  # fmt: skip
    """The runner's start-up hook: ``SdpaPrefill.warm_up`` with the model's (local) head
    counts, when the backend has the strategy and it is on. Returns the buckets built."""
    from roofline.layers.attention import Attention

    sdpa = getattr(backend, "sdpa_prefill", None)
    if sdpa is None or not sdpa.enabled:
        return 0
    layer = next((m for m in model.modules() if isinstance(m, Attention)), None)
    if layer is None:
        return 0
    return sdpa.warm_up(layer.num_heads, layer.num_kv_heads, layer.head_dim, dtype, device,
                        max_rows)  # fmt: skip
