"""Varlen causal flash attention over the paged KV cache (prefill, chunked prefill, extend).

One ragged batch: request ``i`` owns query rows ``query_start_loc[i] : query_start_loc[i + 1]``,
which are the *last* ``query_len_i`` positions of a sequence of ``seq_lens[i]`` tokens whose K/V
(new tokens included) are already in the paged cache. Each query row attends causally to every
cached position up to its own, so the same kernel serves a fresh prompt (context 0), a chunk of a
long prompt, a prefix-cache hit and a decode row (query length 1) in a mixed step.

Work split: the query rows of request ``i`` form ``cdiv(query_len_i, BLOCK_M)`` tiles; tile ``j``
of request ``i`` gets flat index ``query_start_loc[i] // BLOCK_M + i + j``, an upper bound on
packed tile indices that needs no host sync; each program finds its request by binary search over
``query_start_loc``, so a step with one long prompt and many decode rows launches
``num_tokens // BLOCK_M + num_reqs`` tiles per head rather than ``num_reqs * max_tiles``. Tiles
run last-first so the longest causal rows start early. Per tile: keys in ``BLOCK_N`` blocks
gathered through the block table, ``tl.dot`` on tensor cores, fp32 online softmax (base 2); key
blocks entirely left of the tile's first row skip the causal mask. Query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``. Quantized pages (fp8 / int8 with per-token, per-head
scales) are dequantized in registers, in the layout the 1-byte tile was loaded in: ``(value x
scale)`` rounded to q's dtype, what ``dequantize`` (and so the reference) computes, each key
row's scale loaded once for the row. With the scales on the score and probability columns
instead (``decode_attention``'s way), Triton loaded them into the MMA layout, replicated over
the tile's rows: 472 scalar copies a loop trip, 180 bytes of spills, and a 2,048-token chunk
over 8,192 cached fp8 tokens ran 1,956 us against 898 over bf16 pages; now 1,255 (H100,
``scripts/gpu_kvf16.py``, the rest of the gap being the descriptor kernel that 16-bit pages
take).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret
from roofline.kernels.decode_attention import _dequant_rows, scale_args
from roofline.kernels.prefix_gather import GatheredPrefix
from roofline.quantization.kv_cache import dequantize

LOG2E = 1.4426950408889634
# "base": every key gathered from the pages; "tma" / "tma_ws": the step's own keys through
# tensor descriptors (prefill_attention_tma.py; "_ws" warp-specialised), when the caller passes
# them. "_hf": heads fastest in the launch order (all heads' longest tiles first, the query heads
# of one KV head side by side in L2) instead of tiles fastest. Chosen from the H100 sweep of
# scripts/gpu_kernels.py.
VARIANTS = ("base", "base_hf", "tma", "tma_hf", "tma_ws", "tma_ws_hf")
# H100, 8192-token causal prompt, 32/8 heads, d 128 (scripts/gpu_kernels.py): base 355-358
# TFLOP/s, base_hf 342, tma 406, tma_ws 409, tma_hf 462 (all 128 x 128 tiles, 8 warps, 3
# stages); the whole Llama-3.1-8B prefill at 74.2% (base) / 78.8% (tma_hf) of the matmul rate
# in one run, torch SDPA in its place 79.4%.
DEFAULT_VARIANT = "tma_hf"
QUANT_TILES: tuple[int, int, int, int] | None = None
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) of the paged kernel over 1-byte pages where
``_pick_config`` gives 128-row tiles (sweeps); None: ``_pick_config``'s. H100 (2,048 over 8,192
cached, fp8): (128, 64, 4, 2) 1,201 us but spilling 324 bytes, ``_pick_config``'s (128, 128, 8, 3)
1,255, other tiles 1,446-1,545."""
TMA_TILES: tuple[int, int, int, int] | None = None
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) of the descriptor kernels where ``_pick_config``
gives long chunks 128-row tiles (head_dim 128, 16-bit); None: ``_pick_config``'s."""


def prefill_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_pages, page_size, num_kv_heads] fp32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Plain-torch paged causal attention, one request at a time, in fp32 (a quantized cache
    is dequantized first)."""
    if k_scale is not None:
        k_cache, v_cache = (
            dequantize(k_cache, k_scale, q.dtype),
            dequantize(v_cache, v_scale, q.dtype),
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + page_size - 1) // page_size
        pages = block_table[i, :num_blocks].long()  # [num_blocks]
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # [S, Hk, D]
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # [S, Hk, D]
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)  # [S, H, D]
        qi = q[q_start:q_end].float()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", qi, k) * scale  # [H, L, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [L]
        k_pos = torch.arange(seq_len, device=q.device)  # [S]
        visible = k_pos[None, :] <= q_pos[:, None]  # [L, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [H, L, S]
        out[q_start:q_end] = torch.einsum("hls,shd->lhd", probs, v).to(q.dtype)
    return out


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    k_head,
    v_head,
    ks_head,
    vs_head,
    bt_row,
    n0,
    kv_end,
    q_pos,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    stride_sp,
    stride_ss,
    offs_d,
    d_mask,
    scale_log2e,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Fold keys ``n0 .. n0 + BLOCK_N`` (gathered through the block table) into the softmax."""
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    n_mask = offs_n < kv_end
    pages = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    rows = offs_n % PAGE_SIZE
    k_off = pages * stride_kp + rows * stride_ks  # [BLOCK_N] int64
    # K rows as stored (head_dim contiguous), transposed in registers/shared memory: measured
    # ~12% faster on H200 than gathering K^T directly.
    k = tl.load(  # [BLOCK_N, BLOCK_D]
        k_head + k_off[:, None] + offs_d[None, :],
        mask=n_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if KV_QUANT:  # 1-byte K dequantized in registers, in its load layout
        s_off = pages * stride_sp + rows * stride_ss  # [BLOCK_N]
        k = _dequant_rows(k, ks_head + s_off, n_mask, q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    s = s * scale_log2e
    if CAUSAL_MASK:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_off = pages * stride_vp + rows * stride_vs
    v = tl.load(  # [BLOCK_N, BLOCK_D]
        v_head + v_off[:, None] + offs_d[None, :],
        mask=n_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if KV_QUANT:  # V dequantized the same way
        v = _dequant_rows(v, vs_head + s_off, n_mask, q.dtype)
    # Rescale, then accumulate into acc inside the MMA (no second [BLOCK_M, BLOCK_D] tile).
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


# The batch's shape changes every step: left specialized, each new combination of "== 1" or
# "% 16 == 0" among these would compile the kernel again in the middle of serving.
@triton.jit(do_not_specialize=["num_reqs", "num_tiles", "search_steps", "stride_bt"])
def _prefill_kernel(
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    HEADS_FAST: tl.constexpr,  # grid (heads, tiles) rather than (tiles, heads)
):
    if HEADS_FAST:
        tile = num_tiles - 1 - tl.program_id(1)  # last tiles (longest causal rows) first
        head = tl.program_id(0)
    else:
        tile = num_tiles - 1 - tl.program_id(0)
        head = tl.program_id(1)

    # Binary search: the request whose first tile index (qsl[i] // BLOCK_M + i) is the last <= tile.
    lo = num_reqs * 0
    hi = num_reqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        mid_first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        right = mid_first_tile <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    req = lo
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_row = (tile - (q_start // BLOCK_M + req)) * BLOCK_M  # first query row of this tile
    # first_row < 0: a tile before the first request's, when that request starts past row 0
    # (attention/split_backend.py gives the decode rows at the front to the decode kernel)
    if (first_row < 0) | (first_row >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    offs_m = first_row + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows within the request
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx_len + offs_m  # [BLOCK_M] absolute positions
    tok = (q_start + offs_m).to(tl.int64)  # [BLOCK_M] rows of q / out
    q_ptrs = q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    kv_head = (head // GROUP).to(tl.int64)
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    ks_head = k_scale_ptr + kv_head  # scales: head stride 1
    vs_head = v_scale_ptr + kv_head
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys < full_end precede every row of the tile: no causal mask there.
    kv_end = tl.minimum(seq_len, ctx_len + first_row + BLOCK_M)
    full_end = (ctx_len + first_row + 1) // BLOCK_N * BLOCK_N
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
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _pick_config(
    dtype: torch.dtype, head_dim: int, max_query_len: int
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for an H100-class GPU.

    head_dim 128, bf16: 128 x 128 tiles, 8 warps, 3 stages measured best on H200 (~380 TFLOP/s on
    an 8k causal prompt; 128 x 64 gave ~340, 4 warps ~190).
    """
    if is_interpret():
        return 16, 16, 4, 1
    if dtype == torch.float32:
        block_m, block_n, warps, stages = (64, 32, 4, 2) if head_dim <= 128 else (32, 32, 4, 1)
    elif head_dim <= 64:
        block_m, block_n, warps, stages = 128, 64, 4, 3
    elif head_dim <= 128:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 4, 2
    # Short queries (decode rows, small chunks): smaller tiles waste less of the tensor core.
    block_m = min(block_m, max(16, triton.next_power_of_2(max_query_len)))
    if block_m <= 32:
        warps = 4
    return block_m, block_n, warps, stages


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_pages, page_size, num_kv_heads] fp32 (quantized)
    v_scale: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: the step's keys
    v_new: torch.Tensor | None = None,  # (already in the cache too), for the "tma" variants
    variant: str | None = None,
    prefix: GatheredPrefix | None = None,  # long chunks' prefixes, gathered (prefix_gather.py)
    has_prefix: bool = True,  # False: no request has cached context (fresh prompts only)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of a ragged batch of query rows over their paged K/V; returns ``out``.
    With ``k_new``/``v_new`` (this step's rows, as stored; the caller decides when they pay)
    and a "tma" variant (default ``DEFAULT_VARIANT``), the step's own keys are read from them
    through tensor descriptors
    and only the cached prefix from the pages, or, for the requests ``prefix`` gathered, from
    its contiguous rows; ``has_prefix=False`` (the caller knows every context is empty) leaves
    the descriptor kernels' prefix code out. The tile/launch overrides exist for sweeps."""
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
    variant = variant or DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"prefill_attention: variant {variant!r} not in {VARIANTS}")
    cfg_m, cfg_n, cfg_warps, cfg_stages = _pick_config(q.dtype, head_dim, max_query_len)
    if QUANT_TILES is not None and k_scale is not None and cfg_m == 128:
        cfg_m, cfg_n, cfg_warps, cfg_stages = QUANT_TILES
    if TMA_TILES is not None and variant.startswith("tma") and cfg_m == 128 and head_dim == 128:
        cfg_m, cfg_n, cfg_warps, cfg_stages = TMA_TILES  # long chunks, 16-bit
    block_m = block_m or cfg_m
    block_n = block_n or cfg_n
    num_warps = num_warps or cfg_warps
    num_stages = num_stages or cfg_stages
    if variant.startswith("tma") and k_scale is None:
        from roofline.kernels import prefill_attention_tma as tma

        if tma.tma_applies(q, k_new, v_new):
            return tma.prefill_attention_tma(
                q, k_new, v_new, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                scale * LOG2E, out, block_m, block_n, num_warps, num_stages,
                warp_spec=variant.startswith("tma_ws"), heads_fast=variant.endswith("_hf"),
                prefix=prefix, has_prefix=has_prefix,
            )  # fmt: skip
    num_tiles = num_tokens // block_m + num_reqs  # upper bound on sum(cdiv(query_len, block_m))
    search_steps = max(1, (num_reqs - 1).bit_length() + 1)
    k_s, v_s, stride_sp, stride_ss = scale_args(k_cache, v_cache, k_scale, v_scale)
    heads_fast = variant == "base_hf"  # the paged kernel measured slower heads-fastest
    grid = (num_heads, num_tiles) if heads_fast else (num_tiles, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_s,
        v_s,
        block_table,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2E,
        stride_sp,
        stride_ss,
        num_reqs,
        num_tiles,
        search_steps,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_QUANT=k_scale is not None,
        HEADS_FAST=heads_fast,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


_CONTEXT_MEMO: list = [None, True]  # (the step's metadata, its answer): asked once per layer


def has_cached_context(meta) -> bool:  # noqa: ANN001 - an AttentionMetadata
    """Whether a request of the step (the prefill part of a split step) attends cached
    positions before its chunk, from the host lists; True where they are not known (graph
    buckets). False lets the descriptor kernels leave their prefix code out."""
    if _CONTEXT_MEMO[0] is not meta:
        known = bool(meta.query_lens_cpu) and len(meta.seq_lens_cpu) == len(meta.query_lens_cpu)
        fresh = known and sum(meta.seq_lens_cpu) == sum(meta.query_lens_cpu)
        _CONTEXT_MEMO[:] = [meta, not fresh]
    return _CONTEXT_MEMO[1]


def causal_attention_flops(
    seq_lens: list[int], query_lens: list[int], num_heads: int, head_dim: int
) -> int:
    """Useful matmul FLOPs of causal attention: 4 * head_dim per visible (query, key) pair."""
    pairs = 0
    for seq_len, q_len in zip(seq_lens, query_lens, strict=True):
        ctx = seq_len - q_len
        pairs += q_len * ctx + q_len * (q_len + 1) // 2
    return 4 * head_dim * num_heads * pairs
