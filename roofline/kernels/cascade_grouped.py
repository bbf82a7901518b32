"""Cascade decode attention in request groups, merged by the last program: no merge launch.

The same split as ``cascade_attention`` (each member row attends the shared prefix pages and its
own suffix; the two partial results merged by log-sum-exp), organised around *units* of
``GROUP_REQS`` consecutive requests x one KV head (``BLOCK_M = GROUP_REQS x GQA group`` query
rows):

* the prefix kernel: program ``(unit, split)`` multiplies the unit's ``BLOCK_M`` query rows by
  the shared K/V tiles of its slice of the prefix (``[BLOCK_M, d] x [d, BLOCK_N]`` on the tensor
  cores: the prefix is read once per unit, not once per row) and writes a partial (output
  normalised by its own softmax sum, fp32, and its log-sum-exp, base 2) into slot ``split``;
* the suffix kernel: program ``(request, KV head)`` attends the request's own positions
  ``suffix_start[r] .. seq_len - 1`` with the GQA group's query heads as the MMA's rows (plain
  decode's structure: one short loop per program, many programs in flight; a flattened loop over
  several requests per program measured 1.5 TB/s against this structure's 2.3 at 128 tokens)
  and writes its partial into the last slot;
* whichever program of a unit finishes last (an atomic counter per unit, ``last_program.py``)
  merges the unit's slots and writes the output.

The two kernels run side by side (the prefix pass is tensor-core work, the suffix pass memory
traffic): on one stream, the prefix kernel launched first lets the suffix kernel launch as soon
as it starts (programmatic dependent launch, ``GroupedTuning.chained``), or, without PDL, on two
streams. Rows that are not members (``suffix_start = 0``) attend their whole
context in the suffix pass; the prefix pass gives them ``lse = -inf`` (weight 0). ``prefix_len``
is read on the device and the grids depend only on the batch size, so a CUDA graph captured once
replays for any prefix. 1-byte (fp8 / int8) pages come with their scales: each K / V row is
dequantized in registers as it is loaded (``_paged_tile``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret, num_sms
from roofline.kernels.cascade_merge import _arrive
from roofline.kernels.decode_attention import LOG2E, PDL_ATTENTION, scale_args
from roofline.kernels.last_program import counters
from roofline.kernels.pdl import pdl_enabled


@dataclass(frozen=True)
class GroupedTuning:
    """Launch choices of the grouped cascade (``scripts/gpu_prefix.py`` and
    ``scripts/gpu_cascade_chain.py`` sweep them at the shared-prefix preset's decode shape). The
    defaults are the fastest on the H100 (B = 256, prefix 2,000, suffix 128, CUDA graphs): the
    preset's decode step 11.10 ms against 11.31 with two streams and 32-key x 5-stage suffix
    tiles (medians of four runs each, alternated in one process; the attention between the
    RoPE / store kernel and the next GEMM 70 us a layer against 77 in a profiled step)."""

    block_m: int = 64
    """Query rows per unit (requests x GQA group): the prefix tile's M."""
    prefix: tuple[int, int, int] = (64, 4, 5)
    """(BLOCK_N keys, num_warps, num_stages) of the prefix kernel (5 stages: two tiles in
    flight; fewer keep none, see docs/architecture.md; ``fit_stages`` cuts them for fp32)."""
    prefix_splits: int | None = None
    """Slices of the prefix, one program each per unit; None: ``choose_prefix_splits``."""
    suffix: tuple[int, int, int] = (32, 4, 4)
    """(BLOCK_N keys, num_warps, num_stages) of the suffix kernel (4 stages: less shared
    memory a program than 5, so more suffix programs share an SM; chained, the preset's
    decode step 11.10 against 11.19 ms with 5)."""
    merge_rows: int = 16
    """Rows the merging program combines at a time (every slot's loads issued together): the
    merge's registers count against the whole kernel's (the suffix kernel's occupancy is what
    keeps its loads in flight; the prefix kernel measured 251 -> 180 registers at 64 -> 32)."""
    concurrent: bool = True
    """The prefix kernel beside the suffix kernel (on a side stream, or chained by PDL:
    ``chained``), instead of one after the other."""
    chained: bool = True
    """Side by side on one stream: the prefix kernel, launched as a programmatic dependent
    of the kernel before it, lets the suffix kernel launch as soon as it starts (the suffix
    kernel does not wait for it: both read only what the kernels before the prefix kernel
    wrote, and the last program of a unit merges, as with two streams). No fork and join of
    streams: in the engine's graphs the side stream's prefix kernel started 12.7 us after the
    RoPE / store kernel, the chained one at once. Without PDL, the side stream."""
    prefix_maxnreg: int | None = None
    """Register cap per thread of the prefix kernel (ptxas; None: its choice): a cap lets more
    suffix programs share an SM with a prefix program."""
    suffix_maxnreg: int | None = None
    """Register cap of the suffix kernel (96: five 4-warp programs per SM instead of four)."""
    prefix_priority: bool = True
    """Side by side: the prefix pass on a high-priority stream, so the block scheduler places
    its programs before the suffix pass's waiting ones (graph kernel nodes keep their stream's
    priority): 93.1 against 95.9 us with the other defaults (in the engine the prefix kernel
    took 69-81 us per layer beside the suffix, against 52-56 alone)."""


@triton.jit
def _paged_tile(
    acc, m_i, l_i, q, k_head, v_head, pages_ptr, n0, end, stride_kp, stride_ks, stride_vp,
    stride_vs, offs_d, d_mask, scale_log2e, ks_head, vs_head, stride_sp, stride_ss,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    MASKED: tl.constexpr, FULL_D: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    """Fold keys ``n0 .. n0 + BLOCK_N`` (``< end`` when ``MASKED``), position ``t`` in page
    ``pages_ptr[t // PAGE_SIZE]`` (the shared pages, or a block-table row), into the softmax;
    ``FULL_D``: head_dim fills the tile's columns (no column mask). ``KV_QUANT``: 1-byte pages,
    each K / V row dequantized in its load layout (``value x scale`` rounded to q's dtype, as
    ``kv_cache.dequantize`` and ``prefill_attention`` do; scales ``[pages, page_size, heads]``
    from ``ks_head`` / ``vs_head``, the head's first)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions
    n_mask = offs_n < end
    if MASKED:
        pages = tl.load(pages_ptr + offs_n // PAGE_SIZE, mask=n_mask, other=0)
    else:
        pages = tl.load(pages_ptr + offs_n // PAGE_SIZE)
    pages = pages.to(tl.int64)
    rows = offs_n % PAGE_SIZE
    k_ptrs = k_head + (pages * stride_kp + rows * stride_ks)[:, None] + offs_d[None, :]
    v_ptrs = v_head + (pages * stride_vp + rows * stride_vs)[:, None] + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    if MASKED or not FULL_D:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    else:
        k = tl.load(k_ptrs)
    if KV_QUANT:
        s_off = pages * stride_sp + rows * stride_ss  # [BLOCK_N]
        k_s = tl.load(ks_head + s_off, mask=n_mask, other=0.0)
        k = (k.to(tl.float32) * k_s[:, None]).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e  # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED or not FULL_D:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
    if KV_QUANT:
        v_s = tl.load(vs_head + s_off, mask=n_mask, other=0.0)
        v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_reqs", "prefix_programs"])
def _grouped_prefix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_sp,
    stride_ss,
    prefix_pages_ptr,
    prefix_len_ptr,
    suffix_start_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    num_reqs,
    NUM_SLOTS: tl.constexpr,
    prefix_programs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    GROUP_REQS: tl.constexpr,
    MERGE_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    COUNT_SUFFIX: tl.constexpr,
    KV_QUANT: tl.constexpr = False,
    PDL: tl.constexpr = False,  # chained: wait for the kernel before, then let the suffix start
):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    unit = tl.program_id(0)  # group * NUM_KV_HEADS + kv_head
    split = tl.program_id(1)
    group_id = unit // NUM_KV_HEADS
    kv_head = unit % NUM_KV_HEADS
    unit_req0 = group_id * GROUP_REQS
    prefix_len = tl.load(prefix_len_ptr).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(prefix_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, prefix_len)

    offs_m = tl.arange(0, BLOCK_M)  # (request, q-head of the GQA group) of the unit
    req = unit_req0 + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    ok = (offs_m < GROUP_REQS * GROUP) & (req < num_reqs)
    member = ok & (tl.load(suffix_start_ptr + req, mask=ok, other=0) > 0)  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_ptrs = q_ptr + req.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=member[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    ks_head = k_scale_ptr + kv_head  # scales: head stride 1
    vs_head = v_scale_ptr + kv_head
    full_end = start + (end - start) // BLOCK_N * BLOCK_N  # whole tiles: no masks
    for n0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _paged_tile(acc, m_i, l_i, q, k_head, v_head, prefix_pages_ptr, n0, end,
                                     stride_kp, stride_ks, stride_vp, stride_vs, offs_d, d_mask,
                                     scale_log2e, ks_head, vs_head, stride_sp, stride_ss,
                                     PAGE_SIZE, BLOCK_N, PRECISION, False, HEAD_DIM == BLOCK_D,
                                     KV_QUANT)  # fmt: skip
    if full_end < end:  # the last, partial tile
        acc, m_i, l_i = _paged_tile(acc, m_i, l_i, q, k_head, v_head, prefix_pages_ptr,
                                     full_end, end, stride_kp, stride_ks, stride_vp, stride_vs,
                                     offs_d, d_mask, scale_log2e, ks_head, vs_head, stride_sp,
                                     stride_ss, PAGE_SIZE, BLOCK_N, PRECISION, True,
                                     HEAD_DIM == BLOCK_D, KV_QUANT)  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [BLOCK_M, BLOCK_D]
    row = (req.to(tl.int64) * NUM_HEADS + heads) * NUM_SLOTS + split  # [BLOCK_M]
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o,
             mask=ok[:, None] & d_mask[None, :])  # fmt: skip
    lse = tl.where(member & (l_i > 0.0), m_i + tl.log2(l_safe), float("-inf"))
    tl.store(part_lse_ptr + row, lse, mask=ok)
    _arrive(counter_ptr, unit, prefix_programs, part_out_ptr, part_lse_ptr, out_ptr, unit_req0,
            kv_head, num_reqs, NUM_SLOTS, stride_ot, stride_oh, NUM_HEADS, GROUP, HEAD_DIM,
            GROUP_REQS, MERGE_M, BLOCK_D, COUNT_SUFFIX)  # fmt: skip


@triton.jit(do_not_specialize=["stride_bt", "num_reqs", "prefix_programs"])
def _grouped_suffix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_sp,
    stride_ss,
    block_table_ptr,
    seq_lens_ptr,
    suffix_start_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    num_reqs,
    NUM_SLOTS: tl.constexpr,
    prefix_programs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    GROUP_REQS: tl.constexpr,
    MERGE_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    COUNT_SUFFIX: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent: wait, then trigger
    KV_QUANT: tl.constexpr = False,
    PDL_WAIT: tl.constexpr = True,  # False: after the chained prefix kernel (already waited)
):
    if PDL:  # q and this step's K/V rows come from the RoPE + store kernel just before
        if PDL_WAIT:
            tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    start = tl.load(suffix_start_ptr + req).to(tl.int32)  # after the shared prefix, or 0

    offs_h = tl.arange(0, BLOCK_H)  # query heads of this KV head's group
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    o_mask = h_mask[:, None] & d_mask[None, :]
    heads = kv_head * GROUP + offs_h
    q_ptrs = q_ptr + req.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=o_mask, other=0.0)  # [BLOCK_H, BLOCK_D]
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    ks_head = k_scale_ptr + kv_head
    vs_head = v_scale_ptr + kv_head
    for n0 in range(start, seq_len, BLOCK_N):  # (one masked loop: fewer registers than a
        # split into whole tiles and a tail, which measured 115 -> 128 at (64, 4, 3))
        acc, m_i, l_i = _paged_tile(acc, m_i, l_i, q, k_head, v_head, bt_row, n0, seq_len,
                                    stride_kp, stride_ks, stride_vp, stride_vs, offs_d, d_mask,
                                    scale_log2e, ks_head, vs_head, stride_sp, stride_ss,
                                    PAGE_SIZE, BLOCK_N, PRECISION, True, HEAD_DIM == BLOCK_D,
                                    KV_QUANT)  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    row = (req.to(tl.int64) * NUM_HEADS + heads) * NUM_SLOTS + NUM_SLOTS - 1  # the last slot
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
             mask=o_mask)  # fmt: skip
    lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # empty suffix: weight 0
    tl.store(part_lse_ptr + row, lse, mask=h_mask)
    group_id = req // GROUP_REQS
    _arrive(counter_ptr, group_id * NUM_KV_HEADS + kv_head, prefix_programs, part_out_ptr,
            part_lse_ptr, out_ptr, group_id * GROUP_REQS, kv_head, num_reqs, NUM_SLOTS, stride_ot,
            stride_oh, NUM_HEADS, GROUP, HEAD_DIM, GROUP_REQS, MERGE_M, BLOCK_D,
            COUNT_SUFFIX)  # fmt: skip


_SIDE_STREAMS: dict[tuple[int, bool], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, high_priority: bool) -> torch.cuda.Stream:
    """The prefix pass's stream; at high priority the block scheduler dispatches its programs
    before the suffix pass's waiting ones (graph kernel nodes keep their stream's priority)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, high_priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device, priority=-1 if high_priority else 0)
    return _SIDE_STREAMS[key]


def _pdl() -> bool:
    """PDL for the suffix kernel (``kernels.pdl``; ``ROOFLINE_PDL_ATTENTION=0`` turns it off
    with plain decode's)."""
    return PDL_ATTENTION and not is_interpret() and pdl_enabled()


def _cap(maxnreg: int | None) -> dict:
    return {} if maxnreg is None else {"maxnreg": maxnreg}


SMEM_BUDGET = 160 << 10
"""Shared memory the pipelined K/V tiles (and the prefix pass's query tile) may take: the
stages are cut to fit (an fp32 cache's tiles are twice a bf16 one's), leaving room for the
compiler's own buffers under the H100's 227 KiB."""


def fit_stages(num_stages: int, stage_bytes: int, fixed_bytes: int) -> int:
    """``num_stages``, or fewer so that ``fixed_bytes + (stages - 1) x stage_bytes`` (the
    pipeliner keeps ``stages - 1`` tiles in flight) stays within ``SMEM_BUDGET``; at least 1."""
    room = max(SMEM_BUDGET - fixed_bytes, 0) // max(stage_bytes, 1)
    return max(1, min(num_stages, room + 1))


MAX_PREFIX_SPLITS = 8


def choose_prefix_splits(num_units: int, num_sms_: int) -> int:
    """Prefix slices per unit so the prefix kernel has about one program per SM (B = 256 x 8
    KV heads: one slice of 64-row units, two of 128-row units; smaller batches more)."""
    return max(1, min(num_sms_ // max(num_units, 1), MAX_PREFIX_SPLITS))


def grouped_cascade_attention(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    prefix_pages: torch.Tensor,  # [max_prefix_pages] int32: the shared pages, in order
    prefix_len: torch.Tensor,  # [1] int32: shared tokens (a multiple of page_size)
    suffix_start: torch.Tensor,  # [num_reqs] int32: prefix_len for member rows, else 0
    scale: float,
    tuning: GroupedTuning | None = None,
    out: torch.Tensor | None = None,  # [num_reqs, num_heads, head_dim]
    passes: str = "both",
    k_scale: torch.Tensor | None = None,  # [num_pages, page_size, num_kv_heads] fp32 (1-byte)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    """Decode attention with the shared prefix computed once per unit (module docstring). No
    host sync; the grids depend on ``num_reqs`` and ``tuning`` only. ``passes`` = "prefix" or
    "suffix" launches that kernel alone, its units merged from its own slots (timing only: the
    output is not the attention)."""
    assert passes in ("both", "prefix", "suffix")
    check_device(q, k_cache, v_cache)
    t = tuning or GroupedTuning()
    num_reqs, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and v_cache.shape == k_cache.shape
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert (k_cache.dtype.itemsize > 1) == (k_scale is None), "1-byte pages come with scales"
    k_s, v_s, stride_sp, stride_ss = scale_args(k_cache, v_cache, k_scale, v_scale)
    scales = (k_s, v_s, stride_sp, stride_ss)
    if out is None:
        out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(max(t.block_m, group)))
    group_reqs = block_m // group  # whole requests per unit
    num_groups = triton.cdiv(num_reqs, group_reqs)
    splits = t.prefix_splits or choose_prefix_splits(num_groups * num_kv_heads, num_sms(q.device))
    num_slots = splits + 1
    part_out = torch.empty(
        num_reqs, num_heads, num_slots, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(num_reqs, num_heads, num_slots, dtype=torch.float32, device=q.device)
    counter = counters(q.device, num_groups * num_kv_heads, "cascade_grouped")
    prefix_programs = 0 if passes == "suffix" else splits  # a unit's count (_arrive)
    count_suffix = passes != "prefix"
    block_d = max(16, triton.next_power_of_2(head_dim))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    common = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
                  PAGE_SIZE=page_size, GROUP_REQS=group_reqs, BLOCK_D=block_d,
                  PRECISION=precision, COUNT_SUFFIX=count_suffix,
                  KV_QUANT=k_scale is not None)  # fmt: skip
    cache_strides = (
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
    )  # fmt: skip

    merge_m = min(t.merge_rows, block_m)

    # (1-byte pages: the tile as loaded plus its 16-bit copy for the MMA)
    size = k_cache.element_size() if k_scale is None else 1 + q.element_size()

    chained = t.concurrent and t.chained and passes == "both" and q.is_cuda and _pdl()

    def prefix_pass() -> None:
        block_n, num_warps, num_stages = t.prefix
        num_stages = fit_stages(num_stages, 2 * block_n * block_d * size, block_m * block_d * size)
        chain = {"PDL": True, "launch_pdl": True} if chained else {}
        _grouped_prefix_kernel[(num_groups * num_kv_heads, splits)](
            q, k_cache, v_cache, *scales, prefix_pages, prefix_len, suffix_start, out, part_out,
            part_lse, counter, scale * LOG2E, q.stride(0), q.stride(1), *cache_strides,
            out.stride(0), out.stride(1), num_reqs, num_slots, prefix_programs,
            NUM_SPLITS=splits, BLOCK_M=block_m, MERGE_M=merge_m, BLOCK_N=block_n,
            **chain,
            num_warps=num_warps, num_stages=num_stages, **_cap(t.prefix_maxnreg), **common,
        )  # fmt: skip

    main = side = None
    if passes == "suffix":
        pass
    elif chained:  # launched first, it lets the suffix kernel start beside it
        prefix_pass()
    elif t.concurrent and q.is_cuda and passes == "both":  # the prefix pass on a side stream
        main = torch.cuda.current_stream(q.device)
        side = _side_stream(q.device, t.prefix_priority)
        side.wait_stream(main)  # after the main stream's queue (q)
        with torch.cuda.stream(side):
            prefix_pass()
    else:
        prefix_pass()
    if passes == "prefix":
        return out
    block_n, num_warps, num_stages = t.suffix
    num_stages = fit_stages(num_stages, 2 * block_n * block_d * size, 0)
    # a programmatic dependent of the kernel before it on this stream (RoPE + store, the
    # prefix pass in turn, or the chained prefix pass, which lets it start at once: it does not
    # wait then); its launch overlaps that kernel's tail; the prefix pass on the side stream
    # (ordered by an event) keeps an ordinary launch
    pdl = {"PDL": True, "launch_pdl": True} if q.is_cuda and _pdl() else {}
    if chained:  # (the prefix kernel waited for the kernels before: do not wait for it)
        pdl["PDL_WAIT"] = False
    _grouped_suffix_kernel[(num_reqs, num_kv_heads)](
        q, k_cache, v_cache, *scales, block_table, seq_lens, suffix_start, out, part_out, part_lse,
        counter, scale * LOG2E, q.stride(0), q.stride(1), *cache_strides, block_table.stride(0),
        out.stride(0), out.stride(1), num_reqs, num_slots, prefix_programs, MERGE_M=merge_m,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, num_warps=num_warps,
        num_stages=num_stages, **_cap(t.suffix_maxnreg), **pdl, **common,
    )  # fmt: skip
    if main is not None:
        main.wait_stream(side)
    return out


__all__ = ["GroupedTuning", "choose_prefix_splits", "grouped_cascade_attention"]
