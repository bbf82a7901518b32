"""The grouped expert GEMM of ``kernels.fused_moe`` with the weight as the MMA's left operand.

A decode batch gives each touched expert a few rows (Qwen3-30B-A3B: 16 tokens put ~1 row on
each of ~80 experts, 256 tokens ~16 on each of 128), so the grouped GEMM is a weight read: its
tiles must stream ``[BLOCK_N, BLOCK_K]`` weight blocks at the copy rate while the rows of x are
few. ``fused_moe``'s first grouped kernel computes ``x_rows @ W^T`` with the weight tile as the
right operand ``[BLOCK_K, BLOCK_N]`` (K along the tile's rows): at 16 rows it needs every
register (ptxas: 255 and spills for the 8-bit tiles, 1.9 KB of spills for int4, whose scale and
offset tiles it loads per element), which is why 8-bit experts ran at a third of the copy rate
and int4 collapsed.

Here program ``(block of sorted pairs, column block)`` computes ``out^T [BLOCK_N, BLOCK_M] =
W_e[BLOCK_N rows, K] @ x_rows^T``, as ``kernels.mixed_gemm`` does for dense layers: the weight
rows are the MMA's M side (64 fill a Hopper warpgroup MMA), the block's token rows its N side
(16 and up), and a quantized weight is widened in registers by ``mixed_gemm``'s tile helpers
(int8 and fp8 without the conversion unit, per-channel scales applied to the accumulator after
the K loop; int4 nibbles split in registers with their group scale and offset, one FMA per
weight) before ``tl.dot``. The K loop is software-pipelined (``NUM_STAGES`` tiles in flight).
Gate/up accumulate both halves in one program and store ``silu(gate) * up``; down multiplies
by the routing weight; blocks of the expert-parallel ``NOT_LOCAL`` sentinel read nothing (down
stores zeros), blocks past the padded end exit at once: ``fused_moe``'s grouped contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.kernels import is_interpret
from roofline.kernels.mixed_gemm import (
    KIND_FP8,
    KIND_INT4,
    KIND_INT8,
    _grouped_tile,
    _row_scaled_tile,
)

WEIGHT_16BIT = -1
"""``WKIND`` of 16-bit experts (the others are ``mixed_gemm``'s kind codes)."""


@triton.jit
def _silu_mul_t(gate, up, OUT_DTYPE: tl.constexpr):
    """silu(gate) * up with the unfused ops' roundings (``fused_moe._silu_mul``)."""
    g = gate.to(OUT_DTYPE).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(OUT_DTYPE).to(tl.float32)
    return act * up.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _weight_tile(q_ptrs, s_ptr, o_ptr, rows_n, k0, stride_s, dtype: tl.constexpr,
                 WKIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, FAST_FP8: tl.constexpr):  # fmt: skip
    """A ``[BLOCK_N, BLOCK_K]`` weight tile in x's dtype (per-channel scales not applied)."""
    if WKIND == -1:
        w = tl.load(q_ptrs)
    elif WKIND == 1:  # int4 with group scales and offsets
        w = _grouped_tile(q_ptrs, s_ptr, o_ptr, rows_n, k0, stride_s, dtype, WKIND, GROUP,
                          BLOCK_N, BLOCK_K)  # fmt: skip
    else:  # int8 / fp8, one scale per row
        w = _row_scaled_tile(q_ptrs, dtype, WKIND, FAST_FP8)
    return w


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_t_kernel(
    a_ptr, q_ptr, s_ptr, o_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    weights_ptr, N, K, num_pairs, num_experts, a_rows_div, stride_am, stride_qe, stride_qn,
    stride_se, stride_s, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    WKIND: tl.constexpr, GROUP: tl.constexpr, FAST_FP8: tl.constexpr,
):  # fmt: skip
    """``out^T`` tile ``(pid_n, pid_m)``. Rows of ``a`` are ``pair // a_rows_div`` (the token
    for gate/up, the pair for down); the output row is the pair. ``q [E, N(, +N), K]`` (int4:
    bytes ``K // 2``); per-channel scales ``s [E, N(, +N)]`` (``stride_s`` unused) or int4
    group scales and offsets ``[E, N(, +N), K // GROUP]`` (``stride_s`` = groups a row). K is a
    multiple of BLOCK_K (the launcher checks)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # [BM]
    row_ok = pair < num_pairs
    a_row = tl.where(row_ok, pair // a_rows_div, 0)  # padding rows read row 0, never stored
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    out_ty = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + pair[None, :] * stride_om + offs_n[:, None]  # [BN, BM]
    out_mask = row_ok[None, :] & n_ok[:, None]
    if expert >= num_experts:  # pairs routed to another rank's experts
        if MUL_WEIGHT:
            tl.store(out_ptrs, tl.zeros((BLOCK_N, BLOCK_M), dtype=out_ty), mask=out_mask)
        return
    q_base = q_ptr + expert * stride_qe
    s_base = s_ptr + expert * stride_se
    o_base = o_ptr + expert * stride_se
    offs_k = tl.arange(0, BLOCK_K)
    if WKIND == 1:  # int4: BLOCK_K // 2 bytes a row per step
        q_ptrs = q_base + rows_n[:, None] * stride_qn + tl.arange(0, BLOCK_K // 2)[None, :]
        q_step = BLOCK_K // 2
    else:
        q_ptrs = q_base + rows_n[:, None] * stride_qn + offs_k[None, :]  # [BN, BK]
        q_step = BLOCK_K
    up_q = N * stride_qn
    x_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs)  # [BM, BK]
        w = _weight_tile(q_ptrs, s_base, o_base, rows_n, k0, stride_s, x.dtype, WKIND, GROUP,
                         BLOCK_N, BLOCK_K, FAST_FP8)  # fmt: skip
        acc = tl.dot(w, tl.trans(x), acc)  # [BN, BM]
        if SILU_MUL:
            w_up = _weight_tile(q_ptrs + up_q, s_base, o_base, rows_n + N, k0, stride_s, x.dtype,
                                WKIND, GROUP, BLOCK_N, BLOCK_K, FAST_FP8)  # fmt: skip
            acc_up = tl.dot(w_up, tl.trans(x), acc_up)
        q_ptrs += q_step
        x_ptrs += BLOCK_K
    if WKIND == 0 or WKIND == 2:  # w = q * s per output channel: s factors out of the K sum
        acc *= tl.load(s_base + rows_n).to(tl.float32)[:, None]
        if SILU_MUL:
            acc_up *= tl.load(s_base + N + rows_n).to(tl.float32)[:, None]
    if SILU_MUL:
        acc = _silu_mul_t(acc, acc_up, out_ty)
    if MUL_WEIGHT:
        acc = acc.to(out_ty).to(tl.float32)  # the down projection's output, then the weight
        acc *= tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptrs, acc.to(out_ty), mask=out_mask)


def weight_kind(w: torch.Tensor) -> int:
    """``WKIND`` of an expert stack by its dtype."""
    if w.dtype == torch.uint8:
        return KIND_INT4
    if w.dtype == torch.int8:
        return KIND_INT8
    if w.dtype == torch.float8_e4m3fn:
        return KIND_FP8
    return WEIGHT_16BIT


def takes(x: torch.Tensor, k13: int, k2: int, block_k: int) -> bool:
    """Whether the weight-left kernel runs this call: 16-bit x (tensor cores) and both K dims
    whole tiles."""
    return x.dtype in (torch.bfloat16, torch.float16) and k13 % block_k == 0 and k2 % block_k == 0


def launch(
    a: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    o: torch.Tensor,
    out: torch.Tensor,
    align,
    weights: torch.Tensor,
    n: int,
    k: int,
    num_pairs: int,
    num_experts: int,
    a_rows_div: int,
    silu_mul: bool,
    group: int,
    cfg: dict[str, int],
) -> None:
    """One grouped GEMM (gate/up with ``silu_mul``, else down) over ``align``'s sorted pairs."""
    wkind = weight_kind(q)
    num_blocks = align.block_expert_ids.numel()
    grid = (num_blocks, triton.cdiv(n, cfg["BLOCK_N"]))
    stride_s = s.stride(1) if wkind == KIND_INT4 else 1
    _moe_gemm_t_kernel[grid](
        a, q, s, o, out, align.sorted_pair_ids, align.block_expert_ids, align.num_padded,
        weights, n, k, num_pairs, num_experts, a_rows_div, a.stride(0), q.stride(0),
        q.stride(1), s.stride(0), stride_s, out.stride(0),
        SILU_MUL=silu_mul, MUL_WEIGHT=not silu_mul, WKIND=wkind, GROUP=group,
        FAST_FP8=not is_interpret(), **cfg,
    )  # fmt: skip
