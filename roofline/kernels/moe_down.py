"""The down projection of one token's experts with the experts split over programs: program
``(column block nb, slot j)`` reads expert ``ids[j]``'s ``BLOCK_N`` rows of ``w2`` and stores
its weighted rows; the last of the ``k`` programs of a column block to finish sums them.

``fused_moe``'s down GEMV runs one program per column block that loops over the token's ``k``
experts: ``H / BLOCK_N`` programs (256 for Qwen3-30B-A3B), each walking ``k`` short K loops
(768 columns: three steps) one after another, so few weight tiles are in flight; it measured
55-58% of the copy rate (H100, ``scripts/gpu_moe4.py``) where its gate/up GEMV reaches 88%.
Here the ``k`` experts of a column block run in ``k`` programs side by side. Each computes its
expert's rows exactly as the GEMV does (the fp32 sum over K, the per-channel scale of 8-bit
experts, rounded to the dtype, times the routing weight) and stores them in fp32 to a
``[k, H]`` workspace; the program that takes the last ticket of its column block's counter
(``last_program.py``) adds the ``k`` rows in slot order from zero (the GEMV's accumulation),
rounds, adds the residual as a separate add would and resets the counter. So the result is
the GEMV's, bit for bit, with no program waiting for another.

``moe_down_wide`` (``fused_moe.WIDE_DOWN``, default off) instead gives one program all ``k``
experts' rows of its column block as one tile: the k short K loops side by side without the
split's fp32 partials, arrival counter and last-program sum (its epilogue: a store, a barrier,
an atomic round trip and the k partials read back), the same per-expert roundings.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret
from roofline.kernels.last_program import counters

CONFIG = dict(BLOCK_N=8, BLOCK_K=256, NUM_STAGES=3, num_warps=4)
"""The GEMV's tiles (so each expert's sum is the GEMV's): 8 rows x 256 of K a step."""


@triton.jit
def _moe_down_split_kernel(
    act_ptr,  # [TOP_K, I] silu(gate) * up of each slot
    w_ptr,  # [E, H, I]
    s_ptr,  # [E, H] per-channel scales (QUANT), else unread
    ids_ptr,  # [TOP_K] int64
    weights_ptr,  # [TOP_K]
    res_ptr,  # [1, H] (read if RESIDUAL)
    out_ptr,  # [1, H]
    part_ptr,  # [TOP_K, H] fp32 workspace
    counter_ptr,  # [cdiv(H, BLOCK_N)] int32, zero between launches
    H,
    INTER,
    num_experts,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    QUANT: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    nb = tl.program_id(0)
    j = tl.program_id(1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    expert = tl.load(ids_ptr + j).to(tl.int64)
    local = expert < num_experts
    expert = tl.where(local, expert, 0)
    w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, INTER, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = offs_k < INTER - k0
        a = tl.load(act_ptr + j * stride_am + k0 + offs_k, mask=k_ok, other=0.0)
        w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :] & local,
                    other=0.0, eviction_policy="evict_first")  # fmt: skip
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    res = tl.sum(acc, axis=1)  # [BN]
    out_ty = out_ptr.dtype.element_ty
    if QUANT:
        res *= tl.load(s_ptr + expert * stride_se + offs_n, mask=n_ok & local, other=0.0).to(
            tl.float32
        )
    res = res.to(out_ty).to(tl.float32) * tl.load(weights_ptr + j).to(tl.float32)
    tl.store(part_ptr + j * H + offs_n, tl.where(local, res, 0.0), mask=n_ok)
    tl.debug_barrier()  # the CTA's rows before its release (last_program.py)
    arrived = tl.atomic_add(counter_ptr + nb, 1, sem="acq_rel", scope="gpu")
    if arrived == TOP_K - 1:  # the column block's last expert: sum the k rows in slot order
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for jj in tl.static_range(TOP_K):
            total += tl.load(part_ptr + jj * H + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
        result = total.to(out_ty)
        if RESIDUAL:
            r = tl.load(res_ptr + offs_n, mask=n_ok, other=0.0)
            result = (result.to(tl.float32) + r.to(tl.float32)).to(out_ty)
        tl.store(out_ptr + offs_n, result, mask=n_ok)
        tl.store(counter_ptr + nb, 0)  # ready for the next launch


def moe_down_split(
    act: torch.Tensor,  # [k, I] the token's silu(gate) * up rows, slot order
    w2: torch.Tensor,  # [E, H, I] 16-bit, int8 or fp8
    topk_weights: torch.Tensor,  # [1, k]
    topk_ids: torch.Tensor,  # [1, k] int64
    out: torch.Tensor,  # [1, H]
    residual: torch.Tensor | None = None,  # [1, H]
    w2_scale: torch.Tensor | None = None,  # [E, H] per-channel (int8 / fp8)
    config: dict | None = None,
) -> torch.Tensor:
    """``out = (residual +) sum_j w_j * down_{ids[j]}(act[j])`` for one token (the down GEMV of
    ``fused_moe``'s decode path, bit for bit), the experts split over programs."""
    check_device(act, w2, topk_weights, topk_ids, out)
    num_experts, hidden, inter = w2.shape
    top_k = topk_ids.shape[1]
    if topk_ids.shape[0] != 1 or act.shape != (top_k, inter) or out.shape != (1, hidden):
        raise ValueError("moe_down_split: one token, act [k, I], out [1, H]")
    if act.stride(1) != 1 or w2.stride(2) != 1:
        raise ValueError("moe_down_split: the last dims must be contiguous")
    quant = w2_scale is not None
    if quant and w2_scale.shape != (num_experts, hidden):
        raise ValueError("moe_down_split: per-channel scales [E, H]")
    cfg = dict(CONFIG, **(config or {}))
    if is_interpret():
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], triton.next_power_of_2(inter))
    blocks = triton.cdiv(hidden, cfg["BLOCK_N"])
    part = torch.empty(top_k, hidden, dtype=torch.float32, device=act.device)
    s2 = w2_scale.contiguous() if quant else w2
    res = out if residual is None else residual
    _moe_down_split_kernel[(blocks, top_k)](
        act, w2, s2, topk_ids.contiguous(), topk_weights.contiguous(), res, out, part,
        counters(act.device, blocks, "moe_down"), hidden, inter, num_experts, act.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), TOP_K=top_k, QUANT=quant,
        RESIDUAL=residual is not None, **cfg,
    )  # fmt: skip
    return out


WIDE_CONFIG = dict(BLOCK_N=4, BLOCK_K=256, NUM_STAGES=3, num_warps=4)
"""``moe_down_wide``'s tiles: 4 rows of each of the k experts x 256 of K a step (8 x 4 x 256
weights: 16 KiB of bf16 in flight a stage; 512 programs for Qwen3-30B-A3B's 2048 rows)."""


@triton.jit
def _moe_down_wide_kernel(
    act_ptr,  # [TOP_K, I] silu(gate) * up of each slot
    w_ptr,  # [E, H, I]
    s_ptr,  # [E, H] per-channel scales (QUANT), else unread
    ids_ptr,  # [TOP_K] int64
    weights_ptr,  # [TOP_K]
    res_ptr,  # [1, H] (read if RESIDUAL)
    out_ptr,  # [1, H]
    H,
    INTER,
    num_experts,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    TOP_K: tl.constexpr,
    BLOCK_J: tl.constexpr,  # TOP_K rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    QUANT: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    nb = tl.program_id(0)
    offs_j = tl.arange(0, BLOCK_J)
    j_ok = offs_j < TOP_K
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    expert = tl.load(ids_ptr + offs_j, mask=j_ok, other=num_experts).to(tl.int64)  # [BJ]
    local = (expert < num_experts) & j_ok
    expert = tl.where(local, expert, 0)
    rows = expert[:, None] * stride_we + offs_n[None, :].to(tl.int64) * stride_wn  # [BJ, BN]
    w_rows = w_ptr + rows[:, :, None]  # [BJ, BN, 1]
    row_ok = (local[:, None] & n_ok[None, :])[:, :, None]
    a_rows = act_ptr + offs_j[:, None, None] * stride_am  # [BJ, 1, 1]
    acc = tl.zeros((BLOCK_J, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, INTER, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (offs_k < INTER - k0)[None, None, :]
        a = tl.load(a_rows + (k0 + offs_k)[None, None, :], mask=j_ok[:, None, None] & k_ok,
                    other=0.0)  # fmt: skip  # [BJ, 1, BK]
        w = tl.load(w_rows + (k0 + offs_k)[None, None, :], mask=row_ok & k_ok, other=0.0,
                    eviction_policy="evict_first")  # fmt: skip  # [BJ, BN, BK]
        acc += w.to(tl.float32) * a.to(tl.float32)
    res = tl.sum(acc, axis=2)  # [BJ, BN]
    out_ty = out_ptr.dtype.element_ty
    mask = local[:, None] & n_ok[None, :]
    if QUANT:
        s = tl.load(s_ptr + expert[:, None] * stride_se + offs_n[None, :], mask=mask, other=0.0)
        res *= s.to(tl.float32)
    weight = tl.load(weights_ptr + offs_j, mask=j_ok, other=0.0).to(tl.float32)  # [BJ]
    res = res.to(out_ty).to(tl.float32) * weight[:, None]  # each expert's output, weighted
    total = tl.sum(tl.where(mask, res, 0.0), axis=0)  # [BN]
    result = total.to(out_ty)
    if RESIDUAL:
        r = tl.load(res_ptr + offs_n, mask=n_ok, other=0.0)
        result = (result.to(tl.float32) + r.to(tl.float32)).to(out_ty)
    tl.store(out_ptr + offs_n, result, mask=n_ok)


def moe_down_wide(
    act: torch.Tensor,  # [k, I] the token's silu(gate) * up rows, slot order
    w2: torch.Tensor,  # [E, H, I] 16-bit, int8 or fp8
    topk_weights: torch.Tensor,  # [1, k]
    topk_ids: torch.Tensor,  # [1, k] int64
    out: torch.Tensor,  # [1, H]
    residual: torch.Tensor | None = None,  # [1, H]
    w2_scale: torch.Tensor | None = None,  # [E, H] per-channel (int8 / fp8)
    config: dict | None = None,
) -> torch.Tensor:
    """``moe_down_split``'s result for one token (each expert's rows rounded to the dtype and
    weighted, as there; their sum in a tree, not in slot order: within an ulp of it) from one
    program per ``BLOCK_N`` output rows that loads the rows of all k experts as one
    ``[k, BLOCK_N, BLOCK_K]`` tile a K step: the k short K loops (768 columns for Qwen3-30B-A3B)
    run side by side in one program, and nothing is stored but the output: no fp32 partials,
    no arrival counter, no last program."""
    check_device(act, w2, topk_weights, topk_ids, out)
    num_experts, hidden, inter = w2.shape
    top_k = topk_ids.shape[1]
    if topk_ids.shape[0] != 1 or act.shape != (top_k, inter) or out.shape != (1, hidden):
        raise ValueError("moe_down_wide: one token, act [k, I], out [1, H]")
    if act.stride(1) != 1 or w2.stride(2) != 1:
        raise ValueError("moe_down_wide: the last dims must be contiguous")
    quant = w2_scale is not None
    if quant and w2_scale.shape != (num_experts, hidden):
        raise ValueError("moe_down_wide: per-channel scales [E, H]")
    cfg = dict(WIDE_CONFIG, **(config or {}))
    if is_interpret():
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], triton.next_power_of_2(inter))
    s2 = w2_scale.contiguous() if quant else w2
    res = out if residual is None else residual
    _moe_down_wide_kernel[(triton.cdiv(hidden, cfg["BLOCK_N"]),)](
        act, w2, s2, topk_ids.contiguous(), topk_weights.contiguous(), res, out, hidden, inter,
        num_experts, act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), TOP_K=top_k,
        BLOCK_J=triton.next_power_of_2(top_k), QUANT=quant, RESIDUAL=residual is not None,
        **cfg,
    )  # fmt: skip
    return out
