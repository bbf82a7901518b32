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
K sum (gate/up: before the SiLU; down: in the reduction, after the split sum), as the GEMVs do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret
from roofline.kernels.fused_moe import _silu_mul
from roofline.kernels.last_program import counters
from roofline.kernels.pdl import pdl_enabled, prefetch_l2

SPIN_LIMIT = 1 << 24
"""A reducer stops waiting after this many polls of the arrival counter (seconds: only a broken
launch gets there; its output is then wrong, never a hung GPU)."""
QUANT_CONFIG: dict = dict(BLOCK_K=256)
"""Overrides for int8 / fp8 experts (1-byte weights: twice the K a step for the same bytes)."""
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
    s13_ptr,  # [E, 2I] per-channel scales (QUANT), else unread
    s2_ptr,  # [E, H]
    ids_ptr,  # [TOP_K] int64
    weights_ptr,  # [TOP_K]
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
    QUANT: tl.constexpr,  # int8 / fp8 e4m3 weights, w = q * s per output channel
):
    j = tl.program_id(0)
    ib = tl.program_id(1)
    if PDL:  # the routing (ids, weights, x) comes from the previous launch
        tl.extra.cuda.gdc_wait()
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
            prefetch_l2(w2_ptr + expert * stride_e2 + rows_p * stride_n2 + ib * BLOCK_I)
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w13_ptr + expert * stride_e13 + rows_i[:, None] * stride_n13 + offs_k[None, :]
    u_ptrs = g_ptrs + INTER * stride_n13
    acc_g = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = offs_k < H - k0
        a = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = i_ok[:, None] & k_ok[None, :]
        wg = tl.load(g_ptrs + k0, mask=m, other=0.0, eviction_policy="evict_first")
        wu = tl.load(u_ptrs + k0, mask=m, other=0.0, eviction_policy="evict_first")
        acc_g += wg.to(tl.float32) * a
        acc_u += wu.to(tl.float32) * a
    out_ty = out_ptr.dtype.element_ty
    gate = tl.sum(acc_g, axis=1)  # [BI]
    up = tl.sum(acc_u, axis=1)
    if QUANT:  # the scales factor out of the K sums
        s_rows = s13_ptr + expert * (2 * INTER) + rows_i
        gate *= tl.load(s_rows, mask=i_ok, other=0.0).to(tl.float32)
        up *= tl.load(s_rows + INTER, mask=i_ok, other=0.0).to(tl.float32)
    act = _silu_mul(gate, up, out_ty)
    act = tl.where(i_ok, act.to(out_ty).to(tl.float32), 0.0)  # [BI] as the gate/up launch stores
    offs_h = tl.arange(0, BLOCK_H)
    w2_cols = w2_ptr + expert * stride_e2 + rows_i[None, :]  # [1, BI]
    part_row = part_ptr + (j * NUM_IB + ib) * H
    for h0 in tl.range(0, H, BLOCK_H, num_stages=NUM_STAGES):
        h_ok = offs_h < H - h0
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
                if QUANT:  # each output row's scale, after the split K sum
                    e_jj = tl.load(ids_ptr + jj).to(tl.int64)
                    s_ok = c_ok & (e_jj < num_experts)
                    e_jj = tl.where(e_jj < num_experts, e_jj, 0)
                    down *= tl.load(s2_ptr + e_jj * H + cols, mask=s_ok, other=0.0).to(tl.float32)
                down = down.to(out_ty).to(tl.float32)
                total += down * tl.load(weights_ptr + jj).to(tl.float32)
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


def takes(x: torch.Tensor, w13: torch.Tensor, num_tokens: int) -> bool:
    """Whether ``moe_experts`` serves this call: one token, 16-bit activations, experts in x's
    dtype or int8 / fp8 with per-channel scales."""
    return (
        num_tokens == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and (w13.dtype == x.dtype or w13.dtype in QUANT_DTYPES)
    )


def moe_experts(
    x: torch.Tensor,  # [1, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [1, k]
    topk_ids: torch.Tensor,  # [1, k] int64
    residual: torch.Tensor | None = None,  # [1, H]
    config: dict | None = None,
    w13_scale: torch.Tensor | None = None,  # [E, 2I] (int8 / fp8 experts)
    w2_scale: torch.Tensor | None = None,  # [E, H]
) -> torch.Tensor:  # [1, H]
    """``fused_moe`` (plus ``residual``) for one token in one launch (see the module
    docstring); int8 / fp8 experts with their per-channel scales."""
    check_device(x, w13, w2, topk_weights, topk_ids)
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if x.shape != (1, hidden) or topk_ids.shape[0] != 1 or w2.shape != (num_experts, hidden, inter):
        raise ValueError("moe_experts: one token, w13 [E, 2I, H] and w2 [E, H, I]")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("moe_experts: the last dims must be contiguous")
    quant = w13.dtype in QUANT_DTYPES
    if quant and (w13_scale is None or w2_scale is None):
        raise ValueError("moe_experts: int8 / fp8 experts need w13_scale and w2_scale")
    if quant and (
        w13_scale.shape != (num_experts, two_inter) or w2_scale.shape != (num_experts, hidden)
    ):
        raise ValueError("moe_experts: per-channel scales [E, 2I] and [E, H]")
    if not quant and w13.dtype != x.dtype:
        raise ValueError(f"moe_experts: 16-bit experts must be in x's dtype {x.dtype}")
    s13 = w13_scale.contiguous() if quant else w13
    s2 = w2_scale.contiguous() if quant else w2
    cfg = dict(CONFIG, **(QUANT_CONFIG if quant else {}), **(config or {}))
    if is_interpret():  # (no prefetch instruction to interpret)
        cfg.update(BLOCK_K=min(cfg["BLOCK_K"], triton.next_power_of_2(hidden)), PREFETCH_W2=False)
    num_ib = triton.cdiv(inter, cfg["BLOCK_I"])
    chunks = triton.cdiv(hidden, cfg["BLOCK_H"])
    reducers = 1 if is_interpret() else min(chunks, top_k * num_ib)
    pdl = PDL and not is_interpret() and pdl_enabled()
    part = torch.empty(top_k, num_ib, hidden, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    res = out if residual is None else residual
    _moe_experts_kernel[(top_k, num_ib)](
        x, w13, w2, s13, s2, topk_ids.contiguous(), topk_weights.contiguous(), res, out, part,
        counters(x.device, 2, "moe_experts"), hidden, inter, num_experts, w13.stride(0),
        w13.stride(1), w2.stride(0), w2.stride(1), TOP_K=top_k, NUM_IB=num_ib,
        BLOCK_IB=triton.next_power_of_2(num_ib), REDUCERS=reducers,
        RESIDUAL=residual is not None, SPIN_LIMIT=SPIN_LIMIT, PDL=pdl, QUANT=quant, **cfg,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out
