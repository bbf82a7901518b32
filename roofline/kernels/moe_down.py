"""The down projection of one token's experts in one program per column block: program ``nb``
loads ``BLOCK_N`` rows of each of the token's ``k`` experts (``ids``) as one ``[k, BLOCK_N,
BLOCK_K]`` tile a K step, so the k short K loops (768 columns for Qwen3-30B-A3B: six steps of
128) run side by side, each expert's rows summed over K in fp32, rounded to the dtype (the
per-channel scale of 8-bit experts first) and weighted as ``fused_moe``'s down GEMV does, then
the k rows summed (a tree; within an ulp of the GEMV's slot order) and the residual added as a
separate add would. Nothing is stored but the output.

The down GEMV it replaces at one token runs one program per column block looping over the k
experts one after another (few weight tiles in flight: 55-58% of the copy rate, H100,
``scripts/gpu_moe4.py``); the split down after it (a program per column block and expert, fp32
partials summed by the last of a block's k programs on an arrival counter) reached 13.16 us a
layer against a floor of 8.8; this kernel takes ~9.9 (H100, Qwen3-30B-A3B bf16,
``scripts/gpu_moe6.py``: 48 layers at batch 1, 3.041 -> 2.928 ms a step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret

WIDE_CONFIG = dict(BLOCK_N=8, BLOCK_K=128, NUM_STAGES=3, num_warps=4)
"""``moe_down_wide``'s tiles: 8 rows of each of the k experts x 128 of K a step (8 x 8 x 128
weights: 16 KiB of bf16 a stage; 256 programs for Qwen3-30B-A3B's 2048 rows; sm_90: 124
registers, no spills). H100: 2.928 ms a step against 2.950 with 4 rows x 256."""


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
    """``out = (residual +) sum_j w_j * down_{ids[j]}(act[j])`` for one token (``fused_moe``'s
    down GEMV to an ulp), the k experts' rows in one program's tile; ``config`` overrides
    ``WIDE_CONFIG``."""
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
