"""A one-token sparse MoE block in one launch: ``h + experts(rms_norm(h))`` with the router,
the top-k routing, the gate/up GEMV with SiLU-and-mul, and the down GEMV with the routing
weights, the top-k sum and the residual add.

At one token the block's three launches (``kernels.moe_router``, then ``fused_moe``'s gate/up
and down GEMVs) each pay a ramp-up and a tail, and the second and third cannot start reading
their weights before the first has chosen the experts. Here every program takes a ticket from
an atomic counter when it starts, and the ticket, not the program id, gives its role:

* tickets ``[0, R)``: router programs (``kernels.moe_router``'s prologue and GEMV on
  ``ROUTER_N`` experts each); the last to finish (a second counter) routes (``top_k_of``)
  and raises the ``ready`` flag;
* tickets ``[R, R + G)``: gate/up programs, one (pair, column block) each: they wait for
  ``ready``, then store ``silu(gate) * up`` and count themselves done;
* the rest: down programs, one column block of H each: they wait for ``ready``, pull their
  experts' rows into L2, wait until every gate/up program is done, and store the block's
  output rows.

A program only ever waits for programs with smaller tickets, which started before it (tickets
follow the order programs start), so the waits cannot deadlock whatever the hardware
schedules; a wait gives up after ``MAX_POLLS`` polls rather than hang. Every producer stores,
passes a CTA barrier and releases with a GPU-scope atomic; every consumer acquires, passes a
barrier and reads with ``.cg`` (L2), the ``last_program`` pattern. The last down program resets
the counters for the next launch (CUDA-graph replays). The roundings are
``moe_router`` + ``fused_moe``'s (each expert's output rounded, weighted, summed in fp32,
rounded, added to the residual); int8 / fp8 experts widen their 1-byte tiles in registers and
scale each output channel after the K sum, as ``fused_moe``'s GEMV does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret
from roofline.kernels.fused_moe import GEMV_CONFIG, _silu_mul, top_k_of
from roofline.kernels.gemv import _mul_rn
from roofline.kernels.last_program import counters
from roofline.kernels.pdl import pdl_enabled, prefetch_l2

ROUTER_N = 2
"""Experts per router program (64 programs for 128 experts, as ``moe_router`` on the H100)."""
MAX_POLLS = 1 << 16
"""Polls of a flag (~0.1 us apart) before a program gives up waiting: never reached unless
something is wrong, where a wrong step is better than a hung GPU."""


@triton.jit
def _nap(x, COMPILED: tl.constexpr):
    """A short sleep between polls (PTX ``nanosleep``) so waiting programs leave the issue
    slots and the counter's L2 line to the others; ``x`` passes through."""
    if COMPILED:
        x = tl.inline_asm_elementwise(
            "nanosleep.u32 64; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip
    return x


@triton.jit
def _wait_for(ptr, target, MAX: tl.constexpr, COMPILED: tl.constexpr):
    """Spin (volatile loads, a nap between them) until the counter at ``ptr`` reaches
    ``target``, then a GPU-scope fence (the acquire half of the producer's release) and a CTA
    barrier."""
    seen = tl.load(ptr, volatile=True)
    polls = 0
    while (seen < target) & (polls < MAX):
        seen = _nap(tl.load(ptr, volatile=True), COMPILED)
        polls += 1
    if COMPILED:  # acquire: the flag's release is ordered before every read that follows
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [seen],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    tl.debug_barrier()


@triton.jit
def _moe_block_kernel(
    h_ptr, norm_w_ptr, router_ptr, w13_ptr, w2_ptr, s13_ptr, s2_ptr, out_ptr,
    xn_ptr, logits_ptr, ids_ptr, weights_ptr, act_ptr, cnt_ptr,
    E, H, INTER, inv_h, eps, stride_re, stride_we, stride_wn, stride_2e, stride_2n,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROUTER_PROGS: tl.constexpr,
    GATE_PROGS: tl.constexpr, ROUTER_N: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_TOP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr, COMPILED: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, MAX: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """Counters at ``cnt_ptr``: 0 ticket, 1 router programs done, 2 routing ready, 3 gate/up
    programs done, 4 down programs done (all zero between launches)."""
    if PDL:
        tl.extra.cuda.gdc_wait()  # h: the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()
    ticket = tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")
    dtype = h_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    if ticket < ROUTER_PROGS:  # ---- router: rms_norm(h) @ router[rows]^T
        sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            xk = tl.load(h_ptr + k0 + offs_k, mask=offs_k < H - k0, other=0.0).to(tl.float32)
            sq += _mul_rn(xk, xk, COMPILED)
        rstd = tl.rsqrt(tl.sum(sq, axis=0) * inv_h + eps)
        offs_r = ticket * ROUTER_N + tl.arange(0, ROUTER_N)
        rows = tl.minimum(offs_r, E - 1).to(tl.int64)
        racc = tl.zeros((ROUTER_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = offs_k < H - k0
            x = tl.load(h_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            nw = tl.load(norm_w_ptr + k0 + offs_k, mask=k_ok, other=0.0)
            normed = (x * rstd).to(dtype).to(tl.float32)  # rms_norm's roundings
            xn = (normed * nw.to(tl.float32)).to(dtype)
            if ticket == 0:
                tl.store(xn_ptr + k0 + offs_k, xn, mask=k_ok)
            rw = tl.load(router_ptr + rows[:, None] * stride_re + (k0 + offs_k)[None, :],
                        mask=k_ok[None, :], other=0.0)  # fmt: skip
            racc += rw.to(tl.float32) * xn.to(tl.float32)[None, :]
        logit = tl.sum(racc, axis=1)
        tl.store(logits_ptr + offs_r, logit.to(dtype), mask=offs_r < E)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if arrived == ROUTER_PROGS - 1:  # the last router program routes
            offs = tl.arange(0, BLOCK_E)
            lg = tl.load(logits_ptr + offs, mask=offs < E, other=float("-inf"),
                         cache_modifier=".cg").to(tl.float32)  # fmt: skip
            prob = tl.exp(lg - tl.max(lg, axis=0))
            prob = prob / tl.sum(prob, axis=0)
            top_w, top_i = top_k_of(prob, offs, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_TOP)
            slots = tl.arange(0, BLOCK_TOP)
            tl.store(ids_ptr + slots, top_i.to(tl.int64), mask=slots < TOP_K)
            tl.store(weights_ptr + slots, top_w.to(dtype), mask=slots < TOP_K)
            tl.debug_barrier()
            tl.atomic_xchg(cnt_ptr + 2, 1, sem="release", scope="gpu")
    elif ticket < ROUTER_PROGS + GATE_PROGS:  # ---- gate/up of one (pair, column block)
        g = ticket - ROUTER_PROGS
        col_blocks = tl.cdiv(INTER, BLOCK_N)
        pair = g // col_blocks
        offs_n = (g % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < INTER
        _wait_for(cnt_ptr + 2, 1, MAX, COMPILED)
        expert = tl.load(ids_ptr + pair, cache_modifier=".cg")
        w_rows = w13_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
            k_ok = offs_k < H - k0
            a = tl.load(xn_ptr + k0 + offs_k, mask=k_ok, other=0.0, cache_modifier=".cg")
            a = a.to(tl.float32)[None, :]
            mask = n_ok[:, None] & k_ok[None, :]
            w_ptrs = w_rows + (k0 + offs_k)[None, :]
            w = tl.load(w_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * a
            w = tl.load(
                w_ptrs + INTER * stride_wn, mask=mask, other=0.0, eviction_policy="evict_first"
            )
            acc_up += w.to(tl.float32) * a
        res, res_up = tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)
        if QUANT:  # w = q * s per output channel: s factors out of the K sum
            s_row = s13_ptr + expert * 2 * INTER + offs_n
            res *= tl.load(s_row, mask=n_ok, other=0.0).to(tl.float32)
            res_up *= tl.load(s_row + INTER, mask=n_ok, other=0.0).to(tl.float32)
        act = _silu_mul(res, res_up, dtype)
        tl.store(act_ptr + pair * INTER + offs_n, act.to(dtype), mask=n_ok)
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + 3, 1, sem="release", scope="gpu")
    else:  # ---- down of one column block of H, over the token's TOP_K experts
        d = ticket - ROUTER_PROGS - GATE_PROGS
        offs_n = d * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        rows_n = tl.minimum(offs_n, H - 1).to(tl.int64)
        _wait_for(cnt_ptr + 2, 1, MAX, COMPILED)
        row_bytes = INTER * w2_ptr.dtype.element_ty.primitive_bitwidth // 8
        offs_l = tl.minimum(tl.arange(0, PREFETCH_LINES) * 128, row_bytes - 1)  # [LINES]
        if COMPILED:  # the experts' rows of this block into L2 while gate/up runs
            for j in tl.static_range(TOP_K):
                e = tl.load(ids_ptr + j, cache_modifier=".cg")
                base = (w2_ptr + e * stride_2e + rows_n[:, None] * stride_2n).to(
                    tl.pointer_type(tl.int8)
                )
                prefetch_l2(base + offs_l[None, :])
        _wait_for(cnt_ptr + 3, GATE_PROGS, MAX, COMPILED)
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + j, cache_modifier=".cg")
            w_rows = w2_ptr + e * stride_2e + rows_n[:, None] * stride_2n
            dacc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in tl.range(0, INTER, BLOCK_K, num_stages=NUM_STAGES):
                k_ok = offs_k < INTER - k0
                da = tl.load(act_ptr + j * INTER + k0 + offs_k, mask=k_ok, other=0.0,
                            cache_modifier=".cg")  # fmt: skip
                dw = tl.load(w_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                            other=0.0, eviction_policy="evict_first")  # fmt: skip
                dacc += dw.to(tl.float32) * da.to(tl.float32)[None, :]
            res = tl.sum(dacc, axis=1)
            if QUANT:
                res *= tl.load(s2_ptr + e * H + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            res = res.to(dtype).to(tl.float32)  # the expert's output, rounded
            total += res * tl.load(weights_ptr + j, cache_modifier=".cg").to(tl.float32)
        r = tl.load(h_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        result = (total.to(dtype).to(tl.float32) + r).to(dtype)
        tl.store(out_ptr + offs_n, result, mask=n_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + 4, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - ROUTER_PROGS - GATE_PROGS - 1:  # the last: reset
            for c in tl.static_range(5):
                tl.atomic_xchg(cnt_ptr + c, 0, sem="relaxed", scope="gpu")


def moe_block(
    h: torch.Tensor,  # [1, H] residual stream
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    router: torch.Tensor,  # [E, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    top_k: int,
    renormalize: bool,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [1, H]
    """``h + fused_moe(rms_norm(h), ...)`` for one token in one launch: 16-bit experts, or
    int8 / fp8 with per-channel scales ``w13_scale [E, 2I]``, ``w2_scale [E, H]``."""
    check_device(h, norm_weight, router, w13, w2)
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if h.shape != (1, hidden) or not h.is_contiguous():
        raise ValueError(f"moe_block: h must be [1, {hidden}] contiguous, got {tuple(h.shape)}")
    quant = w13_scale is not None
    if not (h.dtype == norm_weight.dtype == router.dtype) or w13.dtype != w2.dtype:
        raise ValueError("moe_block: h, the norm and the router must share a dtype")
    if quant != (w2_scale is not None) or (not quant and w13.dtype != h.dtype):
        raise ValueError("moe_block: 16-bit experts in h's dtype, or 8-bit ones with both scales")
    if quant and (
        w13.dtype not in (torch.int8, torch.float8_e4m3fn)
        or tuple(w13_scale.shape) != tuple(w13.shape[:2])
        or tuple(w2_scale.shape) != tuple(w2.shape[:2])
        or not (w13_scale.is_contiguous() and w2_scale.is_contiguous())
    ):
        raise ValueError("moe_block: 8-bit experts need contiguous per-channel scales [E, N]")
    if tuple(w2.shape) != (num_experts, hidden, inter) or not 0 < top_k <= num_experts:
        raise ValueError(f"moe_block: w2 {tuple(w2.shape)} vs w13 {tuple(w13.shape)}")
    dev, dtype = h.device, h.dtype
    xn = torch.empty(hidden, dtype=dtype, device=dev)
    logits = torch.empty(num_experts, dtype=dtype, device=dev)
    ids = torch.empty(top_k, dtype=torch.int64, device=dev)
    weights = torch.empty(top_k, dtype=dtype, device=dev)
    act = torch.empty(top_k, inter, dtype=dtype, device=dev)
    out = torch.empty_like(h)
    block_n, block_k = GEMV_CONFIG["BLOCK_N"], GEMV_CONFIG["BLOCK_K"] * (2 if quant else 1)
    if is_interpret():
        block_k = min(block_k, triton.next_power_of_2(max(hidden, inter)))
    router_progs = triton.cdiv(num_experts, ROUTER_N)
    gate_progs = top_k * triton.cdiv(inter, block_n)
    down_progs = triton.cdiv(hidden, block_n)
    compiled = not is_interpret()
    pdl = compiled and pdl_enabled()
    meta: dict = {"launch_pdl": True} if pdl else {}
    _moe_block_kernel[(router_progs + gate_progs + down_progs,)](
        h, norm_weight, router, w13, w2, w13_scale if quant else w13,
        w2_scale if quant else w2, out, xn, logits, ids, weights, act,
        counters(dev, 5, "moe_block"), num_experts, hidden, inter, 1.0 / hidden, eps,
        router.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1),
        TOP_K=top_k, RENORMALIZE=renormalize, ROUTER_PROGS=router_progs, GATE_PROGS=gate_progs,
        ROUTER_N=ROUTER_N, BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        BLOCK_TOP=triton.next_power_of_2(top_k), BLOCK_N=block_n, BLOCK_K=block_k,
        NUM_STAGES=GEMV_CONFIG["NUM_STAGES"], PDL=pdl, COMPILED=compiled,
        PREFETCH_LINES=triton.next_power_of_2(triton.cdiv(inter * w2.element_size(), 128)),
        MAX=MAX_POLLS, QUANT=quant,
        num_warps=GEMV_CONFIG["num_warps"], **meta,
    )  # fmt: skip
    return out
