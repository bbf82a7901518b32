"""Cascade (shared-prefix) decode attention: the prefix's K/V read once for the whole group.

When many decode rows begin with the same cached pages (a common system prompt), plain paged
decode reads those pages once per row. Here a group's rows are split in two parts:

* ``_shared_prefix_kernel`` attends the query of *every* member row over the shared pages
  ``prefix_pages[:ceil(prefix_len / page_size)]``. One program holds ``BLOCK_M`` query rows of
  one KV head, flattened over (request, q-head of the GQA group), so a K/V tile is loaded once
  and multiplied by all of them: ``[BLOCK_M, d] x [d, BLOCK_N]`` on the tensor cores. The grid is
  (row blocks, KV heads, prefix splits); each program writes a partial output normalised by its
  own softmax sum and its log-sum-exp (base 2) into a slot after the suffix's.
* the suffix: ``decode_attention`` over each row's own positions ``suffix_start[r] ..
  seq_len - 1`` (``suffix_start = prefix_len`` for members, 0 for the rest), writing its split
  partials into the first slots.

``merge_partials`` (the split-K merge of ``decode_attention``) then combines all slots by
log-sum-exp. Non-member rows (``suffix_start == 0``) get ``lse = -inf`` in every prefix slot
and so attend over their whole context as usual. ``prefix_len`` lives on the device (a one-
element tensor) and the grid does not depend on it, so a CUDA graph captured once replays for
any prefix; the split length is derived from it inside the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, num_sms
from roofline.kernels.cascade_grouped import GroupedTuning, grouped_cascade_attention
from roofline.kernels.decode_attention import (
    LOG2E,
    _pick_config,
    choose_num_splits,
    decode_attention,
    merge_partials,
)

MAX_PREFIX_SPLITS = 16
MIN_PREFIX_TOKENS_PER_SPLIT = 256
PREFIX_TARGET_WAVES = 1
"""Programs per SM the prefix splits aim for: each program is MMA work, every split adds a
partial (fp32 [rows, head_dim]) to write and merge, and beside the suffix pass (``concurrent``)
fewer prefix programs leave the SMs to it. H100, B = 256, prefix 2,000, 64-row tiles: one split
(128 programs) 96.7 us for the whole cascade, two 124.9 us."""
CONFIG_OVERRIDE: tuple[int, int, int, int] | None = None
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) for every prefix launch (``scripts/gpu_cascade.py``
sweeps configs and runs the engine with the fastest); None: ``_prefix_config``."""


@dataclass
class CascadeTuning:
    """Launch choices of the cascade kernels beside ``CONFIG_OVERRIDE`` (``scripts/gpu_presets.py``
    sweeps them at the shared-prefix preset's shape). CUDA graphs fix them at capture."""

    prefix_splits: int | None = None
    """Split count of the prefix pass (None: ``choose_prefix_splits``)."""
    prefix_config: tuple[int, int, int, int] | None = None
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefix pass (``CONFIG_OVERRIDE`` first;
    None: ``prefix_block_m`` / ``_prefix_config``)."""
    suffix_config: tuple[int, int, int] | None = None
    """(BLOCK_N, num_warps, num_stages) of the suffix pass (None: plain decode's)."""
    concurrent: bool = False
    """Run the prefix pass (tensor-core bound) on a side stream beside the suffix pass (memory
    bound), both writing partials, then the merge kernel; instead of the prefix pass first and
    the suffix kernel merging its slots. Off CUDA the same launches run in order."""
    grouped: GroupedTuning | None = None
    """Large batches (``grouped_applies``) run ``kernels/cascade_grouped.py`` with these
    choices instead of the passes above (which then serve the small batches only)."""


DEFAULT_TUNING = CascadeTuning(concurrent=True, suffix_config=(32, 4, 3), grouped=GroupedTuning())
"""Measured on an H100 (``scripts/gpu_presets.py``, B = 256, prefix 2,000, suffix 128, CUDA
graphs): the passes one after the other 132 us (the old default: 128-row tiles, 5 splits),
side by side with one 64-row-tile prefix split 96.7 us, with 32-key suffix tiles 95.8 us; plain
decode 354 us. Batches of 33 rows and more (8 KV heads) take the grouped kernels instead:
90-93 us against these passes' 97 in the same run (``scripts/gpu_shared_prefix.py``)."""
TUNING = DEFAULT_TUNING
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[index]


def cascade_attention_ref(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    prefix_pages: torch.Tensor,  # [>= ceil(prefix_len / page_size)] int32
    prefix_len: int,
    suffix_start: torch.Tensor,  # [num_reqs] int32: prefix_len (member) or 0
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_pages, page_size, num_kv_heads] fp32 (1-byte)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    """Plain-torch cascade in fp32: each member row's attention over the prefix pages and over
    its own suffix, merged by log-sum-exp; other rows over their whole context (a quantized
    cache dequantized to q's dtype first)."""
    if k_scale is not None:
        from roofline.quantization.kv_cache import dequantize

        k_cache = dequantize(k_cache, k_scale, q.dtype)
        v_cache = dequantize(v_cache, v_scale, q.dtype)
    num_reqs, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads

    def tokens(pages: torch.Tensor, cache: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        flat = cache[pages.long()].reshape(-1, num_kv_heads, head_dim)[lo:hi].float()
        return flat.repeat_interleave(group, dim=1)  # [hi - lo, H, D]

    def part(qi: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        scores = torch.einsum("hd,shd->hs", qi, k) * scale  # [H, S]
        lse = torch.logsumexp(scores, dim=-1)  # [H]
        return torch.einsum("hs,shd->hd", torch.exp(scores - lse[:, None]), v), lse

    num_prefix_pages = -(-prefix_len // page_size)
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        start = int(suffix_start[i])
        pages = block_table[i, : -(-seq_len // page_size)]
        qi = q[i].float()
        k_s, v_s = tokens(pages, k_cache, start, seq_len), tokens(pages, v_cache, start, seq_len)
        o_s, lse_s = part(qi, k_s, v_s)
        if start == 0:
            out[i] = o_s.to(q.dtype)
            continue
        shared = prefix_pages[:num_prefix_pages]
        o_p, lse_p = part(qi, tokens(shared, k_cache, 0, start), tokens(shared, v_cache, 0, start))
        lse = torch.logaddexp(lse_s, lse_p)  # [H]
        merged = o_s * torch.exp(lse_s - lse)[:, None] + o_p * torch.exp(lse_p - lse)[:, None]
        out[i] = merged.to(q.dtype)
    return out


def choose_prefix_splits(num_programs: int, max_prefix_len: int, num_sms_: int) -> int:
    """Splits of the shared prefix so (row blocks x KV heads x splits) holds about
    ``PREFIX_TARGET_WAVES`` programs per SM (rounded down: 128 programs on 132 SMs stay one
    split), none shorter than ``MIN_PREFIX_TOKENS_PER_SPLIT`` tokens of ``max_prefix_len`` (or
    ``TUNING.prefix_splits``)."""
    if TUNING.prefix_splits is not None:
        return TUNING.prefix_splits
    wanted = PREFIX_TARGET_WAVES * num_sms_ // max(num_programs, 1)  # 128 programs, 132 SMs: 1
    useful = triton.cdiv(max(max_prefix_len, 1), MIN_PREFIX_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_PREFIX_SPLITS))


@triton.jit(do_not_specialize=["num_reqs", "slot0", "num_slots", "num_prefix_splits"])
def _shared_prefix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    prefix_pages_ptr,
    prefix_len_ptr,
    suffix_start_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    num_reqs,
    slot0,
    num_slots,
    num_prefix_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    prefix_len = tl.load(prefix_len_ptr).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(prefix_len, num_prefix_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, prefix_len)

    offs_m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] flat (request, q-head)
    req = offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    in_batch = req < num_reqs
    member = tl.load(suffix_start_ptr + req, mask=in_batch, other=0) > 0  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_ptrs = q_ptr + req.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=member[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] prefix positions
        n_mask = offs_n < end
        pages = tl.load(prefix_pages_ptr + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = offs_n % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_off = pages * stride_kp + rows * stride_ks  # [BLOCK_N]
        k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e  # [BLOCK_M, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = pages * stride_vp + rows * stride_vs
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [BLOCK_M, BLOCK_D]
    # Slot slot0 + split of each row; non-members and empty splits get lse = -inf (weight 0).
    row = (req.to(tl.int64) * NUM_HEADS + heads) * num_slots + slot0 + split  # [BLOCK_M]
    o_mask = in_batch[:, None] & d_mask[None, :]
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=o_mask)
    lse = tl.where(member & (l_i > 0.0), m_i + tl.log2(l_safe), float("-inf"))
    tl.store(part_lse_ptr + row, lse, mask=in_batch)


def prefix_block_m(num_rows: int) -> int:
    """Query rows per prefix program for ``num_rows`` = requests x GQA group: 64 (H100, B =
    256 x G = 4: 64-row tiles, one split, beside the suffix pass 96.7 us for the cascade;
    128-row tiles 116.8 us)."""
    config = CONFIG_OVERRIDE or TUNING.prefix_config
    if config is not None:
        return config[0]
    return 64


def _prefix_config(head_dim: int, block_m: int) -> tuple[int, int, int]:
    """(BLOCK_N keys, num_warps, num_stages) of the prefix kernel for ``block_m`` query rows
    (H100 sweep in ``scripts/gpu_presets.py``: 64 x 64 tiles, 4 warps, 3 stages)."""
    config = CONFIG_OVERRIDE or TUNING.prefix_config
    if config is not None:
        return config[1:]
    block_n = 64 if head_dim <= 128 else 32
    return (block_n, 8, 2) if block_m >= 128 else (block_n, 4, 3)


def cascade_attention(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    prefix_pages: torch.Tensor,  # [max_prefix_pages] int32: the shared pages, in order
    prefix_len: torch.Tensor,  # [1] int32: shared tokens (a multiple of page_size)
    suffix_start: torch.Tensor,  # [num_reqs] int32: prefix_len for member rows, else 0
    scale: float,
    max_suffix_len: int,
    max_prefix_len: int,
    num_splits: int | None = None,
    prefix_splits: int | None = None,
    out: torch.Tensor | None = None,  # [num_reqs, num_heads, head_dim]
    block_m: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_pages, page_size, num_kv_heads] fp32 (1-byte)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    """Decode attention with the shared prefix computed once per group (module docstring).
    1-byte pages (``k_scale`` given) always take the grouped kernels, which read them.

    ``max_suffix_len`` (host int: the longest context a row attends outside the prefix, or an
    upper bound such as ``max_model_len`` under CUDA-graph capture) sizes the suffix splits;
    ``max_prefix_len`` (host int, an upper bound of ``prefix_len``) the prefix splits unless
    ``prefix_splits`` fixes them. No host sync: ``prefix_len`` is read on the device.
    """
    check_device(q, k_cache, v_cache)
    num_reqs, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    grouped = TUNING.grouped is not None and grouped_applies(num_reqs, num_kv_heads, q.device)
    if grouped or k_scale is not None:
        return grouped_cascade_attention(
            q, k_cache, v_cache, block_table, seq_lens, prefix_pages, prefix_len, suffix_start,
            scale, TUNING.grouped, out=out, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    group = num_heads // num_kv_heads
    block_m = block_m or prefix_block_m(num_reqs * group)
    row_blocks = triton.cdiv(num_reqs * group, block_m)
    sms = num_sms(q.device)
    if prefix_splits is None:
        prefix_splits = choose_prefix_splits(row_blocks * num_kv_heads, max_prefix_len, sms)
    if num_splits is None:
        num_splits = choose_suffix_splits(num_reqs, num_kv_heads, max_suffix_len, sms)
    # One suffix split (large batches): the suffix kernel merges the prefix's partials itself,
    # unless the two passes run side by side (then every slot goes through the merge kernel).
    concurrent = TUNING.concurrent
    fused = num_splits == 1 and not concurrent
    slot0 = 0 if fused else num_splits
    num_slots = slot0 + prefix_splits
    part_out = torch.empty(
        num_reqs, num_heads, num_slots, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(num_reqs, num_heads, num_slots, dtype=torch.float32, device=q.device)
    prefix_args = (
        q, k_cache, v_cache, prefix_pages, prefix_len, suffix_start, scale, part_out, part_lse,
        slot0, prefix_splits, block_m,
    )  # fmt: skip
    main = side = None
    if concurrent and q.is_cuda:  # the prefix pass on a side stream, after the main's queue
        main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared_prefix_partials(*prefix_args)
    else:
        shared_prefix_partials(*prefix_args)
    decode_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        scale,
        max_seq_len=max_suffix_len,
        num_splits=num_splits,
        out=out,
        ctx_start=suffix_start,
        partials=(part_out, part_lse),
        merge_prefix=fused,
        config=TUNING.suffix_config,
    )
    if main is not None:
        main.wait_stream(side)
    return out if fused else merge_partials(part_out, part_lse, out)


def shared_prefix_partials(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    prefix_pages: torch.Tensor,  # [max_prefix_pages] int32
    prefix_len: torch.Tensor,  # [1] int32
    suffix_start: torch.Tensor,  # [num_reqs] int32
    scale: float,
    part_out: torch.Tensor,  # [num_reqs, num_heads, num_slots, head_dim] fp32
    part_lse: torch.Tensor,  # [num_reqs, num_heads, num_slots] fp32
    slot0: int,
    prefix_splits: int,
    block_m: int,
) -> None:
    """The prefix pass alone: slots ``slot0 .. slot0 + prefix_splits - 1`` of the partials."""
    num_reqs, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_slots = part_out.shape[2]
    assert slot0 + prefix_splits <= num_slots and part_lse.shape == part_out.shape[:3]
    block_n, num_warps, num_stages = _prefix_config(head_dim, block_m)
    row_blocks = triton.cdiv(num_reqs * group, block_m)
    _shared_prefix_kernel[(row_blocks, num_kv_heads, prefix_splits)](
        q,
        k_cache,
        v_cache,
        prefix_pages,
        prefix_len,
        suffix_start,
        part_out,
        part_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_reqs,
        slot0,
        num_slots,
        prefix_splits,
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )


def grouped_applies(num_reqs: int, num_kv_heads: int, device: torch.device) -> bool:
    """Whether a batch runs the grouped kernels: when plain decode would give every (request,
    KV head) one program anyway (two programs per SM or more), so one suffix program per
    request loses no parallelism; smaller batches split their suffixes over more programs."""
    return num_reqs * num_kv_heads >= 2 * num_sms(device)


def choose_suffix_splits(num_reqs: int, num_kv_heads: int, max_suffix_len: int, sms: int) -> int:
    """Split count of the suffix pass: as plain decode would pick for the suffix length."""
    return choose_num_splits(num_reqs, num_kv_heads, max_suffix_len, sms, _pick_config(128)[0])


__all__ = [
    "DEFAULT_TUNING",
    "TUNING",
    "CascadeTuning",
    "cascade_attention",
    "cascade_attention_ref",
    "choose_prefix_splits",
    "grouped_applies",
    "prefix_block_m",
    "shared_prefix_partials",
    "choose_suffix_splits",
]
