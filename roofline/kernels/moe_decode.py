"""One token's routed experts in one launch: gate/up, SiLU, down, the routing weights, the top-k
sum and the residual add, for 16-bit experts at batch 1.

``fused_moe``'s decode path runs two GEMV launches (gate/up over (pair, column block) programs,
then down over column blocks looping over the k experts); between them the GPU drains and
refills. Here program ``(slot j, intermediate block ib)`` computes ``BLOCK_I`` columns of
``act = silu(x W_gate^T) * (x W_up^T)`` of expert ``ids[j]`` (rounded to the model dtype as the
separate launch stores it) and at once multiplies them by the matching ``BLOCK_I`` columns of
that expert's down weight (``w2[e, :, ib*BLOCK_I : ...]``, rows of ``2 BLOCK_I`` bytes): a
split-K partial of the expert's down output, ``[H]`` in fp32, stored to a workspace
``[k, NUM_IB, H]``. So every weight byte of the token is read by one launch and no program waits
for another's activations.

The partials are summed by the last ``REDUCERS`` programs to arrive (tickets from an atomic
counter; every other program exits): each waits until all programs have arrived (all are
resident or done by then: at most ``REDUCERS`` programs wait, the rest exit), then reduces
``BLOCK_H`` output columns: per slot the ``NUM_IB`` partials in order (the expert's down output
in fp32), rounded to the dtype, times the slot's routing weight, summed over the slots in
order, rounded, plus the residual rounded as a separate add (``fused_moe``'s down GEMV's
roundings; the K sum of the down projection is split, so its fp32 order differs). The last
reducer to finish zeroes the counters for the next launch. Under the interpreter (programs run
one after another) one reducer, the last program, does all the columns. Under PDL (``PDL``)
the kernel waits for the routing before its first read and lets the next launch start once its
partials are stored: the next layer's GEMV prefetches its weights while the partials are summed
(the reducers are resident by then, so the dependents' programs never block them).

Not-local ids (``num_experts``, expert parallelism) read nothing and add zero. int8 / fp8 e4m3
experts with per-channel scales (``quantization/moe.py``'s ``PerChannelMoEMethod``) load their
1-byte tiles, widen them exactly in registers and apply each output channel's scale after its
K sum (gate/up: before the SiLU; down: in the reduction, after the split sum), as the GEMVs do;
int4 experts (two a byte, group scales and offsets) dequantize each tile in fp32 through
``mixed_gemm._grouped_tile`` (K steps and intermediate blocks within one group), as the int4
GEMV does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret
from roofline.kernels.fused_moe import _silu_mul
from roofline.kernels.last_program import counters
from roofline.kernels.mixed_gemm import _grouped_tile
from roofline.kernels.moe_router import route_logits
from roofline.kernels.pdl import pdl_enabled, prefetch_l2

SPIN_LIMIT = 1 << 22
"""A reducer stops waiting after this many polls of the arrival counter (seconds: only a broken
launch gets there; its output is then wrong, never a hung GPU)."""
QUANT_CONFIG: dict = dict(BLOCK_K=256)
"""Overrides for int8 / fp8 experts (1-byte weights: twice the K a step for the same bytes)."""
INT4_CONFIG: dict = dict(BLOCK_I=64, BLOCK_K=128, BLOCK_H=64)
"""Overrides for int4 experts: 64 intermediate columns a program (a down row's block is 32
bytes, one sector), K steps of 128 (64 bytes a row, within a group of 128)."""
ROUTE = False
"""With ``fused_moe.ONE_LAUNCH`` at one token: the router kernel stores only its logits
(``moe_router.moe_router_logits``: no atomic, no routing program) and every program of the
experts' launch routes them itself (``moe_router.route_logits``: the same softmax and top-k,
so the same experts and weights); ``layers.fused_decode.moe_norm_add`` takes it."""
PDL = False
"""Launch as a programmatic dependent (waits for the routing first) and let the next launch
start once the partials are stored (its weight prefetch then overlaps the reduction)."""
CONFIG = dict(BLOCK_I=32, BLOCK_K=128, BLOCK_H=128, NUM_STAGES=3, PREFETCH_W2=False, num_warps=8)
"""Tiles: 32 intermediate columns a program (8 x 24 = 192 programs for Qwen3-30B-A3B; the down
rows it reads are 64 bytes), 128 of K a gate/up step, 128 output rows a down step.
``PREFETCH_W2``: each program asks for its down rows in L2 before its gate/up loop."""


@triton.jit
def _moe_experts_kernel(
    x_ptr,  # [1, H] the normalised row
    w13_ptr,  # [E, 2I, H]
    w2_ptr,  # [E, H, I]
    s13_ptr,  # [E, 2I] per-channel scales (QUANT 1) / [E, 2I, H // GROUP13] (QUANT 2)
    s2_ptr,  # [E, H] / [E, H, I // GROUP2]
    o13_ptr,  # int4 offsets, as the scales (QUANT 2), else unread
    o2_ptr,
    ids_ptr,  # [TOP_K] int64 (unread if ROUTE)
    weights_ptr,  # [TOP_K] (unread if ROUTE)
    logits_ptr,  # [E] the router's logits (ROUTE), else unread
    res_ptr,  # [1, H] (read if RESIDUAL)
    out_ptr,  # [1, H]
    part_ptr,  # [TOP_K, NUM_IB, H] fp32 workspace
    counter_ptr,  # [2] int32 (arrivals, reducers done), zero between launches
    H,
    INTER,
    num_experts,
    stride_e13,
    stride_n13,
    stride_e2,
    stride_n2,
    stride_se13,  # the scales' expert and row strides
    stride_sn13,
    stride_se2,
    stride_sn2,
    TOP_K: tl.constexpr,
    NUM_IB: tl.constexpr,
    BLOCK_IB: tl.constexpr,  # next power of two >= NUM_IB
    REDUCERS: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_W2: tl.constexpr,
    QUANT: tl.constexpr,  # 1: int8 / fp8 e4m3, w = q s per output channel; 2: int4 groups
    GROUP13: tl.constexpr,  # int4 group sizes along H (w13) and I (w2)
    GROUP2: tl.constexpr,
    ROUTE: tl.constexpr,  # route the logits here (every program alike) instead of reading ids
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    j = tl.program_id(0)
    ib = tl.program_id(1)
    if PDL:  # the routing (ids, weights, x) comes from the previous launch
        tl.extra.cuda.gdc_wait()
    if ROUTE:
        offs_e, rank, route_w = route_logits(logits_ptr, num_experts, TOP_K, RENORMALIZE, BLOCK_E)
        expert = tl.sum(tl.where(rank == j, offs_e, 0), axis=0).to(tl.int64)
    else:
        expert = tl.load(ids_ptr + j).to(tl.int64)
    local = expert < num_experts
    expert = tl.where(local, expert, 0)
    offs_i = ib * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = (offs_i < INTER) & local
    rows_i = tl.minimum(offs_i, INTER - 1).to(tl.int64)
    if PREFETCH_W2:  # this program's down rows into L2 while gate/up streams from DRAM
        offs_p = tl.arange(0, 256)
        for p0 in range(0, H, 256):
            rows_p = tl.minimum(p0 + offs_p, H - 1).to(tl.int64)
            col = ib * BLOCK_I // 2 if QUANT == 2 else ib * BLOCK_I  # (int4: two a byte)
            prefetch_l2(w2_ptr + expert * stride_e2 + rows_p * stride_n2 + col)
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w13_ptr + expert * stride_e13 + rows_i[:, None] * stride_n13 + offs_k[None, :]
    u_ptrs = g_ptrs + INTER * stride_n13
    acc_g = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
    offs_u = tl.arange(0, BLOCK_K // 2)  # int4: the step's bytes a row
    q_rows = w13_ptr + expert * stride_e13 + rows_i[:, None] * stride_n13  # [BI, 1]
    s13_e = s13_ptr + expert * stride_se13
    o13_e = o13_ptr + expert * stride_se13
    for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = offs_k < H - k0
        a = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        if QUANT == 2:  # whole tiles (BLOCK_K divides H), dequantized in fp32 (the GEMV's)
            q_ptrs = q_rows + (k0 // 2 + offs_u)[None, :]
            wg = _grouped_tile(q_ptrs, s13_e, o13_e, rows_i, k0, stride_sn13, tl.float32, 1,
                               GROUP13, BLOCK_I, BLOCK_K)  # fmt: skip
            wu = _grouped_tile(q_ptrs + INTER * stride_n13, s13_e, o13_e, rows_i + INTER, k0,
                               stride_sn13, tl.float32, 1, GROUP13, BLOCK_I, BLOCK_K)  # fmt: skip
        else:
            m = i_ok[:, None] & k_ok[None, :]
            wg = tl.load(g_ptrs + k0, mask=m, other=0.0, eviction_policy="evict_first")
            wu = tl.load(u_ptrs + k0, mask=m, other=0.0, eviction_policy="evict_first")
        acc_g += wg.to(tl.float32) * a
        acc_u += wu.to(tl.float32) * a
    out_ty = out_ptr.dtype.element_ty
    gate = tl.sum(acc_g, axis=1)  # [BI]
    up = tl.sum(acc_u, axis=1)
    if QUANT == 1:  # the scales factor out of the K sums
        s_rows = s13_e + rows_i
        gate *= tl.load(s_rows, mask=i_ok, other=0.0).to(tl.float32)
        up *= tl.load(s_rows + INTER, mask=i_ok, other=0.0).to(tl.float32)
    act = _silu_mul(gate, up, out_ty)
    act = tl.where(i_ok, act.to(out_ty).to(tl.float32), 0.0)  # [BI] as the gate/up launch stores
    offs_h = tl.arange(0, BLOCK_H)
    w2_cols = w2_ptr + expert * stride_e2 + rows_i[None, :]  # [1, BI]
    part_row = part_ptr + (j * NUM_IB + ib) * H
    offs_ub = ib * BLOCK_I // 2 + tl.arange(0, BLOCK_I // 2)  # int4: the block's bytes a row
    for h0 in tl.range(0, H, BLOCK_H, num_stages=NUM_STAGES):
        h_ok = offs_h < H - h0
        if QUANT == 2:  # rows clamped (never stored), I whole blocks within a group
            rows_h = tl.minimum(h0 + offs_h, H - 1).to(tl.int64)
            q_ptrs = w2_ptr + expert * stride_e2 + rows_h[:, None] * stride_n2 + offs_ub[None, :]
            w = _grouped_tile(q_ptrs, s2_ptr + expert * stride_se2, o2_ptr + expert * stride_se2,
                              rows_h, ib * BLOCK_I, stride_sn2, tl.float32, 1, GROUP2, BLOCK_H,
                              BLOCK_I)  # fmt: skip  # [BH, BI]
        else:
            w_ptrs = w2_cols + (h0 + offs_h).to(tl.int64)[:, None] * stride_n2  # [BH, BI]
            w = tl.load(w_ptrs, mask=h_ok[:, None] & i_ok[None, :], other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
        tl.store(part_row + h0 + offs_h, tl.sum(w.to(tl.float32) * act[None, :], axis=1),
                 mask=h_ok)  # fmt: skip
    if PDL:  # the next launch may start (and prefetch) while the partials are reduced
        tl.extra.cuda.gdc_launch_dependents()
    tl.debug_barrier()  # the CTA's partials before its release (last_program.py)
    programs = TOP_K * NUM_IB
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    first = programs - REDUCERS
    if ticket >= first:  # one of the last to arrive: wait for the rest, then reduce
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins = 0
        while (seen < programs) & (spins < SPIN_LIMIT):  # a watchdog, never a hang
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        offs_ib = tl.arange(0, BLOCK_IB)
        ib_ok = offs_ib < NUM_IB
        for c0 in range((ticket - first) * BLOCK_H, H, REDUCERS * BLOCK_H):
            cols = c0 + offs_h
            c_ok = cols < H
            total = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for jj in tl.static_range(TOP_K):
                tile_ptrs = part_ptr + (jj * NUM_IB + offs_ib)[:, None] * H + cols[None, :]
                tile = tl.load(tile_ptrs, mask=ib_ok[:, None] & c_ok[None, :], other=0.0,
                               cache_modifier=".cg")  # fmt: skip  # [BLOCK_IB, BH]
                down = tl.sum(tile, axis=0)  # expert jj's output (before its scales)
                if ROUTE:
                    w_jj = tl.sum(tl.where(rank == jj, route_w, 0.0), axis=0).to(out_ty)
                else:
                    w_jj = tl.load(weights_ptr + jj)
                if QUANT == 1:  # each output row's scale, after the split K sum
                    if ROUTE:
                        e_jj = tl.sum(tl.where(rank == jj, offs_e, 0), axis=0).to(tl.int64)
                    else:
                        e_jj = tl.load(ids_ptr + jj).to(tl.int64)
                    s_ok = c_ok & (e_jj < num_experts)
                    e_jj = tl.where(e_jj < num_experts, e_jj, 0)
                    s_jj = s2_ptr + e_jj * stride_se2 + cols
                    down *= tl.load(s_jj, mask=s_ok, other=0.0).to(tl.float32)
                down = down.to(out_ty).to(tl.float32)
                total += down * w_jj.to(tl.float32)
            result = total.to(out_ty)
            if RESIDUAL:
                r = tl.load(res_ptr + cols, mask=c_ok, other=0.0)
                result = (result.to(tl.float32) + r.to(tl.float32)).to(out_ty)
            tl.store(out_ptr + cols, result, mask=c_ok)
        done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if done == REDUCERS - 1:  # every reducer is past its wait: ready for the next launch
            tl.store(counter_ptr, 0)
            tl.store(counter_ptr + 1, 0)


QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
MAX_INTER = 2048
"""Widest expert (intermediate columns) taken: the workspace holds ``k * I / BLOCK_I`` partial
rows and each reducer sums ``I / BLOCK_I`` of them a slot (Mixtral's 14336 keeps the GEMVs)."""


def layout_of(w13: torch.Tensor) -> int:
    """``fused_moe.ExpertLayout.quant`` of a stack: 0 16-bit, 1 int8 / fp8, 2 int4 (uint8)."""
    return 2 if w13.dtype == torch.uint8 else 1 if w13.dtype in QUANT_DTYPES else 0


def takes(x: torch.Tensor, w13: torch.Tensor, num_tokens: int) -> bool:
    """Whether ``moe_experts`` serves this call: one token, 16-bit activations, experts in x's
    dtype, int8 / fp8 with per-channel scales or int4 (uint8 stacks) with groups."""
    return (
        num_tokens == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and (w13.dtype == x.dtype or w13.dtype in QUANT_DTYPES or w13.dtype == torch.uint8)
        and w13.shape[1] // 2 <= MAX_INTER
    )


def _scales(
    quant: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scales: tuple[torch.Tensor | None, ...],
    hidden: int,
    inter: int,
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], tuple[int, int]]:
    """(s13, s2, o13, o2) pointers, (expert, row) strides of both scales, int4 group sizes."""
    w13_scale, w2_scale, w13_offset, w2_offset = scales
    num_experts, two_inter = w13.shape[:2]
    if quant == 0:
        return (w13, w2, w13, w2), (0, 0, 0, 0), (0, 0)
    if w13_scale is None or w2_scale is None:
        raise ValueError("moe_experts: quantized experts need w13_scale and w2_scale")
    if quant == 1:
        if w13_scale.shape != (num_experts, two_inter) or w2_scale.shape != (num_experts, hidden):
            raise ValueError("moe_experts: per-channel scales [E, 2I] and [E, H]")
        s13, s2 = w13_scale.contiguous(), w2_scale.contiguous()
        return (s13, s2, s13, s2), (s13.stride(0), 1, s2.stride(0), 1), (0, 0)
    if w13_offset is None or w2_offset is None:
        raise ValueError("moe_experts: int4 experts need w13_offset and w2_offset")
    for t in (w13_scale, w2_scale, w13_offset, w2_offset):
        if t.dim() != 3 or not t.is_contiguous():
            raise ValueError("moe_experts: int4 scales and offsets [E, N, K // group], contiguous")
    group13, group2 = hidden // w13_scale.shape[2], inter // w2_scale.shape[2]
    strides = (w13_scale.stride(0), w13_scale.stride(1), w2_scale.stride(0), w2_scale.stride(1))
    return (w13_scale, w2_scale, w13_offset, w2_offset), strides, (group13, group2)


def moe_experts(
    x: torch.Tensor,  # [1, H]
    w13: torch.Tensor,  # [E, 2I, H] (int4: uint8 [E, 2I, H // 2])
    w2: torch.Tensor,  # [E, H, I] (int4: uint8 [E, H, I // 2])
    topk_weights: torch.Tensor | None,  # [1, k] (None with ``logits``)
    topk_ids: torch.Tensor | None,  # [1, k] int64
    residual: torch.Tensor | None = None,  # [1, H]
    config: dict | None = None,
    w13_scale: torch.Tensor | None = None,  # [E, 2I] (8-bit) / [E, 2I, H // group] (int4)
    w2_scale: torch.Tensor | None = None,  # [E, H] / [E, H, I // group]
    w13_offset: torch.Tensor | None = None,  # int4: as the scales
    w2_offset: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,  # [E]: route here (``top_k``, ``renormalize``)
    top_k: int = 0,
    renormalize: bool = True,
) -> torch.Tensor:  # [1, H]
    """``fused_moe`` (plus ``residual``) for one token in one launch (see the module
    docstring); int8 / fp8 experts with per-channel scales, int4 with group scales and
    offsets. With ``logits`` (``moe_router.moe_router_logits``) every program routes them itself
    (softmax, top ``top_k``), so the router needs no routing program of its own."""
    route = logits is not None
    if route:
        if logits.shape != (w13.shape[0],) or not 0 < top_k <= w13.shape[0]:
            raise ValueError("moe_experts: logits [E] and 0 < top_k <= E")
        topk_weights = torch.empty(1, top_k, dtype=x.dtype, device=x.device)  # (unread)
        topk_ids = torch.empty(1, top_k, dtype=torch.int64, device=x.device)
    assert topk_weights is not None and topk_ids is not None
    check_device(x, w13, w2, topk_weights, topk_ids)
    quant = 2 if w13.dtype == torch.uint8 else 1 if w13.dtype in QUANT_DTYPES else 0
    packed = 2 if quant == 2 else 1
    num_experts, two_inter, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * packed
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if x.shape != (1, hidden) or topk_ids.shape[0] != 1 or w2.shape != (
        num_experts, hidden, inter // packed
    ):  # fmt: skip
        raise ValueError("moe_experts: one token, w13 [E, 2I, H] and w2 [E, H, I]")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("moe_experts: the last dims must be contiguous")
    if quant == 0 and w13.dtype != x.dtype:
        raise ValueError(f"moe_experts: 16-bit experts must be in x's dtype {x.dtype}")
    ptrs, strides, (group13, group2) = _scales(
        quant, w13, w2, (w13_scale, w2_scale, w13_offset, w2_offset), hidden, inter
    )
    cfg = dict(CONFIG) | {0: {}, 1: QUANT_CONFIG, 2: INT4_CONFIG}[quant] | (config or {})
    if is_interpret():  # (no prefetch instruction to interpret)
        cfg.update(BLOCK_K=min(cfg["BLOCK_K"], triton.next_power_of_2(hidden)), PREFETCH_W2=False)
    if quant == 2:  # whole tiles within one group: K steps dividing H, I blocks dividing I
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], hidden & -hidden, group13)
        cfg["BLOCK_I"] = min(cfg["BLOCK_I"], inter & -inter, group2)
    num_ib = triton.cdiv(inter, cfg["BLOCK_I"])
    chunks = triton.cdiv(hidden, cfg["BLOCK_H"])
    reducers = 1 if is_interpret() else min(chunks, top_k * num_ib)
    pdl = PDL and not is_interpret() and pdl_enabled()
    part = torch.empty(top_k, num_ib, hidden, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    res = out if residual is None else residual
    _moe_experts_kernel[(top_k, num_ib)](
        x, w13, w2, *ptrs, topk_ids.contiguous(), topk_weights.contiguous(),
        logits if route else topk_weights, res, out, part,
        counters(x.device, 2, "moe_experts"), hidden, inter, num_experts, w13.stride(0),
        w13.stride(1), w2.stride(0), w2.stride(1), *strides, TOP_K=top_k, NUM_IB=num_ib,
        BLOCK_IB=triton.next_power_of_2(num_ib), REDUCERS=reducers,
        RESIDUAL=residual is not None, SPIN_LIMIT=SPIN_LIMIT, PDL=pdl, QUANT=quant,
        GROUP13=group13, GROUP2=group2, ROUTE=route, RENORMALIZE=renormalize,
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)), **cfg,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out
