"""Prefill attention with the query heads of one KV head packed into one tile: short chunks over
long cached contexts.

``prefill_attention`` gives each (query tile, query head) a program. Many short chunks over a
long cached context (256 requests of 64 new tokens after a 2,000-token shared prompt: the
shared-prefix preset's admission steps) make that program count large and each program reads
its whole context: the GQA group's query heads read the same K/V once per head, and a 64-token
chunk fills half of a 128-row tile. Here a program owns ``BLOCK_Q`` consecutive query tokens of
one request and *all* ``GROUP`` query heads of one KV head: ``BLOCK_M = BLOCK_Q x GROUP`` rows
(row ``m``: token ``m // GROUP``, head ``kv_head x GROUP + m % GROUP``), so each K/V tile is
loaded once for the group and multiplied by full tiles (``[BLOCK_M, d] x [d, BLOCK_N]``), with
the causal mask per row from its token's position. The key loop is ``prefill_attention``'s own
(``_attend_block``: pages through the block table, online softmax base 2, quantized pages read
in registers). Tiles are enumerated as there (``query_start_loc[i] // BLOCK_Q + i`` and a
binary search), so the grid needs no host sync.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret
from roofline.kernels.decode_attention import LOG2E, scale_args
from roofline.kernels.prefill_attention import _attend_block

MAX_QUERY_LEN = 256
"""Chunks of at most this many tokens are *short*: the packed tiles pay for them (a longer
chunk fills ``prefill_attention``'s per-head tiles anyway, and its descriptor variant reads the
chunk's own keys as whole boxes)."""
MIN_SHORT_FRACTION = 0.5
"""A step takes this kernel when at least this share of its query tokens are in short chunks
(the preset's first admission step: one 2,064-token prompt beside 96 chunks of 64 tokens, 75%
short; an 8k prompt: none)."""

ENABLED = os.environ.get("ROOFLINE_GQA_PREFILL", "1") != "0"
"""``ROOFLINE_GQA_PREFILL=0`` keeps every prefill step on ``prefill_attention``."""
IN_GRAPHS = os.environ.get("ROOFLINE_GQA_PREFILL_GRAPHS", "0") == "1"
"""Mixed-step graph buckets take the packed kernel too (read when they are captured; off: the
buckets keep the per-head tiles measured for them, until a measurement says otherwise)."""


def in_graph_bucket(num_heads: int, num_kv_heads: int) -> bool:
    """Whether a mixed-step graph bucket's prefill part runs here (``IN_GRAPHS``)."""
    return ENABLED and IN_GRAPHS and num_heads // num_kv_heads >= 2


def applies(num_heads: int, num_kv_heads: int, query_lens: list[int]) -> bool:
    """Whether a prefill step's attention should run here: grouped query heads and mostly
    short chunks."""
    if num_heads // num_kv_heads < 2:
        return False
    total = short = 0
    for n in query_lens:
        total += n
        if n <= MAX_QUERY_LEN:
            short += n
    return total > 0 and short >= MIN_SHORT_FRACTION * total


class StepChoice:
    """The backends' choice for an eager prefill step, made once per step (the metadata object
    it was made for is remembered) and never under CUDA-graph capture (graph buckets keep their
    measured tiles)."""

    def __init__(self) -> None:
        self._step: tuple[object, bool] | None = None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, meta) -> bool:
        if not ENABLED or meta.max_query_len <= 1:
            return False
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        step = self._step
        if step is None or step[0] is not meta:
            use = applies(q.shape[1], k_cache.shape[2], meta.query_lens_cpu)
            self._step = step = (meta, use)
        return step[1]


@triton.jit(do_not_specialize=["num_reqs", "num_tiles", "search_steps", "stride_bt"])
def _prefill_gqa_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2e,
    stride_sp,
    stride_ss,
    num_reqs,
    num_tiles,
    search_steps,
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    tile = num_tiles - 1 - tl.program_id(0)  # the last tiles (longest causal rows) first
    kv_head = tl.program_id(1)
    # The request whose first tile index (qsl[i] // BLOCK_Q + i) is the last <= tile.
    lo = num_reqs * 0
    hi = num_reqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        right = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    req = lo
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_tok = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q  # first query token of the tile
    if (first_tok < 0) | (first_tok >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    tok_in = first_tok + offs_m // GROUP  # [BLOCK_M] token within the request
    heads = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    m_mask = (offs_m < BLOCK_Q * GROUP) & (tok_in < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx_len + tok_in  # [BLOCK_M] absolute positions
    tok = (q_start + tok_in).to(tl.int64)
    q_ptrs = q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    kv = kv_head.to(tl.int64)
    k_head = k_cache_ptr + kv * stride_kh
    v_head = v_cache_ptr + kv * stride_vh
    ks_head = k_scale_ptr + kv  # scales: head stride 1
    vs_head = v_scale_ptr + kv
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys < full_end precede every token of the tile: no causal mask there.
    kv_end = tl.minimum(seq_len, ctx_len + first_tok + BLOCK_Q)
    full_end = (ctx_len + first_tok + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, bt_row, n0, kv_end, q_pos,
            stride_kp, stride_ks, stride_vp, stride_vs, stride_sp, stride_ss, offs_d, d_mask,
            scale_log2e, PAGE_SIZE, BLOCK_N, False, PRECISION, KV_QUANT,
        )  # fmt: skip
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, bt_row, n0, kv_end, q_pos,
            stride_kp, stride_ks, stride_vp, stride_vs, stride_sp, stride_ss, offs_d, d_mask,
            scale_log2e, PAGE_SIZE, BLOCK_N, True, PRECISION, KV_QUANT,
        )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [BLOCK_M, BLOCK_D]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


CONFIG: tuple[int, int, int, int] | None = None
"""(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) for every launch (sweeps); None:
``_pick_config``."""


def _pick_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). H100, bf16, d 128 (``gpu_shared_prefix.py``):
    64 x 64 tiles of 4 warps, 3 stages: 845 us for 127 chunks of 64 over 2,000 cached tokens
    (128 x 64 / 8 warps 905, 128 x 128 833; per-head tiles 1,479) and 98 us for 40 fresh
    prompts of 20..250 (128 x 64 106, 128 x 128 121; per-head 126)."""
    if CONFIG is not None:
        return CONFIG
    if is_interpret():
        return 16, 16, 4, 1
    if dtype == torch.float32 or head_dim > 128:
        return 64, 32, 4, 2
    return 64, 64, 4, 3


def prefill_attention_gqa(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # [num_pages, page_size, num_kv_heads] fp32
    v_scale: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``prefill_attention``'s contract (causal attention of each request's last
    ``query_len`` positions over its paged context), GQA-packed tiles (module docstring)."""
    check_device(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and v_cache.shape == k_cache.shape
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    num_reqs = query_start_loc.shape[0] - 1
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = config or _pick_config(q.dtype, head_dim)
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group  # tokens per tile (rows past block_q x group are padding)
    num_tiles = num_tokens // block_q + num_reqs  # upper bound on sum(cdiv(query_len, block_q))
    search_steps = max(1, (num_reqs - 1).bit_length() + 1)
    k_s, v_s, stride_sp, stride_ss = scale_args(k_cache, v_cache, k_scale, v_scale)
    _prefill_gqa_kernel[(num_tiles, num_kv_heads)](
        q, k_cache, v_cache, k_s, v_s, block_table, query_start_loc, seq_lens, out,
        scale * LOG2E, stride_sp, stride_ss, num_reqs, num_tiles, search_steps,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_QUANT=k_scale is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


__all__ = [
    "ENABLED",
    "IN_GRAPHS",
    "MAX_QUERY_LEN",
    "StepChoice",
    "applies",
    "in_graph_bucket",
    "prefill_attention_gqa",
]
