"""Fused mixture-of-experts MLP: routing, token grouping by expert, and the two expert GEMMs.

A token's MoE output is ``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over its top-k experts
``e = ids[j]`` with routing weights ``w_j``. Expert weights are stacked: ``w13 [E, 2I, H]``
(gate rows then up rows of each expert) and ``w2 [E, H, I]``. A (token, slot) pair is one row of
work; ``P = num_tokens * top_k`` pairs in all, pair ``p`` belongs to token ``p // top_k``.

* ``route``: softmax over the router logits in fp32, top-k, optional renormalisation, one
  program per token (``route_ref`` is torch's softmax + topk).
* Grouped path (many pairs): ``moe_align`` sorts the pairs by expert on the device (no host
  sync, static sizes: CUDA-graph capturable) and pads each expert's run to ``block_m`` rows, so
  every ``block_m`` block of the sorted list belongs to one expert. One grouped GEMM launch
  computes gate and up of every block against its expert's ``w13`` and writes
  ``silu(gate) * up`` (both accumulated in one program, the activation fused in the epilogue);
  a second multiplies by ``w2`` and the routing weight; the top-k rows of each token are then
  summed. Programs past the padded end exit at once; experts with no token cost nothing.
* Decode path (few pairs): no sorting. The gate/up GEMV runs one program per (pair, column
  block) and reads only the selected experts' rows; the down GEMV runs one program per (token,
  column block) that loops over the token's k experts, so the routing weights and the top-k sum
  happen in its fp32 accumulator (one launch, one store).
* Quantized experts (int8 or fp8 e4m3 with per-channel scales, ``quantization/moe.py``): both
  paths load 1-byte weight tiles, widen them in registers (exact: int8 and e4m3 values are
  bf16 values) and apply each output channel's scale to the fp32 accumulator once after the K
  loop (``w = q s`` factors out of the sum): half the bytes of bf16 experts, no dequantized copy.
* Expert parallelism: an id equal to ``E`` marks a pair whose expert another rank holds; it
  gets its own sorted run, whose blocks read nothing and store zeros (``distributed/
  expert_parallel.py``).

``fused_moe_ref`` loops over experts in plain torch (HF transformers' order) and is the
definition both paths are tested against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from roofline.kernels import check_device, fused_moe_t, is_interpret
from roofline.kernels.mixed_gemm import _e4m3_to_bf16, _grouped_tile
from roofline.kernels.moe_align import moe_align
from roofline.kernels.moe_topk import pick_rank
from roofline.kernels.pdl import pdl_enabled, prefetch_l2
from roofline.quantization import formats

GEMV_MAX_TOKENS = 2
GEMV_MAX_PAIRS = 16
"""The decode GEMV path runs for at most this many tokens and pairs (tokens x top_k), the
grouped GEMM beyond: each pair reads its expert's rows itself, so once a batch's tokens share
experts (Mixtral at 8 tokens: 16 pairs over 7.2 distinct experts expected) reading each touched
expert once pays; below, the GEMV spreads one expert's read over more programs. Crossover to be
confirmed on the H100 (``scripts/gpu_moe.py`` times both paths at 1-8 tokens)."""


def route_ref(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    # logits: [T, E] -> (weights [T, top_k] in logits' dtype, ids [T, top_k] int64)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_offset: torch.Tensor | None = None,
    w2_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [T, k] -> [T, H]: a loop over the experts
    that received a token (a host sync: reference and CPU path only). Quantized experts (int8 /
    fp8 with per-channel scales ``[E, N]``, int4 with group scales and offsets) are dequantized
    to x's dtype one expert at a time; ids equal to ``E`` (``NOT_LOCAL``) are skipped."""
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    for expert in torch.unique(topk_ids).tolist():
        if expert == num_experts:  # NOT_LOCAL: another rank's expert
            continue
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert id {expert} out of range [0, {num_experts})")
        token_idx, slot = torch.where(topk_ids == expert)
        up_w, down_w = w13[expert], w2[expert]
        if w13_scale is not None and w2_scale is not None:
            o13 = None if w13_offset is None else w13_offset[expert]
            o2 = None if w2_offset is None else w2_offset[expert]
            up_w = dequantize_expert(up_w, w13_scale[expert], o13, x.dtype)
            down_w = dequantize_expert(down_w, w2_scale[expert], o2, x.dtype)
        h = F.linear(x[token_idx], up_w)  # [n, 2I]
        gate, up = h.chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down_w)  # [n, H]
        h = h * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


def dequantize_expert(
    q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """One expert's ``[N, K]`` weight in ``dtype``: int8 / fp8 ``q * s`` per channel, int4
    (uint8 ``[N, K // 2]``) ``q * s + o`` per group (``quantization.formats``)."""
    if q.dtype == torch.uint8:
        if offsets is None:
            raise ValueError("int4 experts need offsets")
        return formats.dequantize_int4(q, scales, offsets, dtype)
    return (q.float() * scales.float()[:, None]).to(dtype)


@triton.jit
def _silu_mul(gate, up, OUT_DTYPE: tl.constexpr):
    """silu(gate) * up as the unfused ops round it: gate and up to the output dtype, the SiLU
    in fp32 rounded, then the product."""
    g = gate.to(OUT_DTYPE).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(OUT_DTYPE).to(tl.float32)
    return act * up.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _to_f32(w):
    """A weight tile in fp32. int8 by the magic-number trick, integer ops only (no conversion
    unit): ``q + 128`` OR-ed into the mantissa of fp32 ``2^23`` is ``2^23 + q + 128``, one
    subtraction leaves ``q`` exactly; other dtypes by conversion."""
    if w.dtype == tl.int8:
        bits = (w.to(tl.int32) + 128) | 0x4B000000
        f = bits.to(tl.float32, bitcast=True) - 8388736.0
    else:
        f = w.to(tl.float32)
    return f


@triton.jit
def _row_scaled_tile_of(q, dtype: tl.constexpr, FAST_FP8: tl.constexpr):
    """A loaded int8 / fp8 tile in the 16-bit ``dtype``, exactly, without conversion-unit
    instructions: fp8 e4m3 by ``mixed_gemm._e4m3_to_bf16``'s bit moves (bf16 only), int8
    through fp32 (ptxas widens it with byte permutes)."""
    if FAST_FP8 and q.dtype == tl.float8e4nv and dtype == tl.bfloat16:
        w = _e4m3_to_bf16(q)
    else:
        w = q.to(tl.float32).to(dtype)
    return w


@triton.jit
def _expert_dot(a, w, acc, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """``acc + a @ w``. WIDEN 0: w widened to a's dtype (bf16/fp16 tensor cores); WIDEN 1: both
    operands in fp32 (``_to_f32``) on TF32 tensor cores, exact for int8 / fp8 weights times
    16-bit activations (at most 8 significant bits each), fewer conversions per weight."""
    if WIDEN == 1:
        acc = tl.dot(a.to(tl.float32), _to_f32(w), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, _widen(w, a.dtype), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _widen(w, DTYPE: tl.constexpr):
    """A weight tile in the activation dtype: 16-bit tiles as they are, int8 / fp8 through fp32
    (every value exact in bf16/fp16/fp32)."""
    if w.dtype != DTYPE:
        w = w.to(tl.float32).to(DTYPE)
    return w


@triton.jit
def _int4_tile(rows, s_rows, o_rows, u, g, mask):
    """Bytes ``u`` of int4 rows (two weights each: element ``2u`` in the low nibble, ``2u + 1``
    in the high one) dequantized, ``q * s + offset`` in fp32, with the scale and offset of group
    ``g`` (every byte of the tile in that group): ``(w_lo, w_hi)``."""
    packed = tl.load(rows + u, mask=mask, other=0, eviction_policy="evict_first")
    scale = tl.load(s_rows + g, mask=mask, other=0.0).to(tl.float32)
    offset = tl.load(o_rows + g, mask=mask, other=0.0).to(tl.float32)
    w_lo = (packed & 0xF).to(tl.float32) * scale + offset
    w_hi = (packed >> 4).to(tl.float32) * scale + offset
    return w_lo, w_hi


@triton.jit
def top_k_of(prob, offs, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
             BLOCK_TOP: tl.constexpr):  # fmt: skip
    """The ``TOP_K`` largest of ``prob [BLOCK_E]`` (>= 0; ties to the lowest index, as
    torch.topk) as ``(weights [BLOCK_TOP] fp32, ids [BLOCK_TOP] int32)``, renormalised to sum 1
    when asked. One reduction a pass: each probability's bits (non-negative floats order as
    integers) above ``BLOCK_E - 1 - index`` in one int64 key."""
    bits = prob.to(tl.int32, bitcast=True).to(tl.int64)
    key = (bits << 32) | (BLOCK_E - 1 - offs).to(tl.int64)  # [BLOCK_E]
    slots = tl.arange(0, BLOCK_TOP)
    top_w = tl.zeros([BLOCK_TOP], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_TOP], dtype=tl.int32)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        idx = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        w = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        top_w = tl.where(slots == j, w, top_w)
        top_i = tl.where(slots == j, idx, top_i)
        total += w
        key = tl.where(offs == idx, -1, key)
    if RENORMALIZE:
        top_w = top_w / total
    return top_w, top_i


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
):  # fmt: skip
    """One token: fp32 softmax, ``TOP_K`` passes of argmax (ties to the lowest expert, as
    torch.topk), the weights renormalised in fp32 when asked and stored once in the weights'
    dtype (``route_ref``'s roundings)."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    logit = tl.load(logits_ptr + token * stride_l + offs, mask=mask, other=float("-inf"))
    logit = logit.to(tl.float32)
    prob = tl.exp(logit - tl.max(logit, axis=0))
    prob = prob / tl.sum(prob, axis=0)  # [BLOCK_E] softmax
    slots = tl.arange(0, BLOCK_TOP)
    top_w, top_i = top_k_of(prob, offs, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_TOP)
    out = token * TOP_K + slots
    tl.store(ids_ptr + out, top_i.to(tl.int64), mask=slots < TOP_K)
    tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_ref`` in one launch: (weights [T, top_k] in logits' dtype, ids [T, top_k])."""
    check_device(logits)
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {num_experts}]")
    weights = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        block_e = triton.next_power_of_2(num_experts)
        _route_kernel[(num_tokens,)](
            logits, weights, ids, num_experts, logits.stride(0),
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e,
            BLOCK_TOP=triton.next_power_of_2(top_k),
        )  # fmt: skip
    return weights, ids


@triton.jit
def _sum_topk_kernel(
    per_pair_ptr, res_ptr, out_ptr, H, stride_p, stride_r, stride_o,
    TOP_K: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Token ``t``'s output: its ``TOP_K`` weighted expert rows summed in fp32 (in slot order),
    rounded, plus the residual rounded as a separate add would."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = per_pair_ptr + (token * TOP_K + j) * stride_p
        acc += tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    result = acc.to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        r = tl.load(res_ptr + token * stride_r + offs, mask=mask, other=0.0)
        result = (result.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_o + offs, result, mask=mask)


def _sum_topk(
    per_pair: torch.Tensor, top_k: int, residual: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """out [T, H] = (residual +) the sum over each token's k rows of ``per_pair [T k, H]``."""
    num_tokens, hidden = out.shape
    block = min(1024, triton.next_power_of_2(hidden))
    res = out if residual is None else residual
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, block))](
        per_pair, res, out, hidden, per_pair.stride(0), res.stride(0), out.stride(0),
        TOP_K=top_k, RESIDUAL=residual is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, o_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    weights_ptr, N, K, num_pairs, num_experts, a_rows_div, stride_am, stride_we, stride_wn,
    stride_se, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
    QUANT: tl.constexpr, GROUP: tl.constexpr, WIDEN: tl.constexpr,
):  # fmt: skip
    """Rows of block ``pid_m`` of the sorted pairs times their expert's weight [N(, +N), K]^T.
    A row of ``a`` is ``pair // a_rows_div`` (the token for gate/up, the pair for down); the
    output row is the pair. SILU_MUL: accumulate gate (rows n) and up (rows N + n) together and
    store silu(gate) * up [., N]. QUANT 1: the weight is int8/fp8, widened to ``a``'s dtype
    tile by tile, its per-channel scale ``s [E, N(, +N)]`` applied to the accumulator; QUANT 2:
    int4 with group scales and offsets ``[E, N(, +N), K // GROUP]``, dequantized per tile. A block
    of the not-local sentinel expert (``num_experts``) reads no weight: the down GEMM stores
    zeros for its pairs, the gate/up GEMM nothing."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # [BLOCK_M]
    row_ok = pair < num_pairs
    a_row = tl.where(row_ok, pair // a_rows_div, 0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    out_ty = out_ptr.dtype.element_ty
    if expert >= num_experts:  # pairs routed to another rank's experts
        if MUL_WEIGHT:
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ty)
            out_ptrs = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
            tl.store(out_ptrs, zeros, mask=row_ok[:, None] & n_ok[None, :])
        return
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_rows = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn  # [1, BN]
    w_ptrs = w_rows + offs_k[:, None]  # [BK, BN] (16/8-bit: elements)
    s_rows = s_ptr + expert * stride_se + offs_n[None, :] * stride_sn  # [1, BN]
    o_rows = o_ptr + expert * stride_se + offs_n[None, :] * stride_sn
    up = N * stride_sn
    offs_u = tl.arange(0, BLOCK_K // 2)  # int4: the step's bytes per row
    a_base = a_ptr + a_row[:, None] * stride_am  # [BLOCK_M, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if QUANT == 2:  # int4: BLOCK_K elements = BLOCK_K / 2 bytes, all in group k0 / GROUP
            u = k0 // 2 + offs_u  # [BK / 2] byte columns
            u_ok = offs_u < (K - k0) // 2
            a_mask = row_ok[:, None] & u_ok[None, :]
            a_lo = tl.load(a_base + 2 * u[None, :], mask=a_mask, other=0.0)  # [BM, BK / 2]
            a_hi = tl.load(a_base + 2 * u[None, :] + 1, mask=a_mask, other=0.0)
            w_mask = u_ok[:, None] & n_ok[None, :]
            g = k0 // GROUP
            w_lo, w_hi = _int4_tile(w_rows, s_rows, o_rows, u[:, None], g, w_mask)
            acc = tl.dot(a_lo, w_lo.to(a_lo.dtype), acc, input_precision=PRECISION)
            acc = tl.dot(a_hi, w_hi.to(a_hi.dtype), acc, input_precision=PRECISION)
            if SILU_MUL:
                w_lo, w_hi = _int4_tile(w_rows + N * stride_wn, s_rows + up, o_rows + up,
                                        u[:, None], g, w_mask)  # fmt: skip
                acc_up = tl.dot(a_lo, w_lo.to(a_lo.dtype), acc_up, input_precision=PRECISION)
                acc_up = tl.dot(a_hi, w_hi.to(a_hi.dtype), acc_up, input_precision=PRECISION)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            acc = _expert_dot(a, w, acc, PRECISION, WIDEN)
            if SILU_MUL:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
                acc_up = _expert_dot(a, w_up, acc_up, PRECISION, WIDEN)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if QUANT == 1:  # w = q * s per output channel: s factors out of the K sum
        s_ptrs = s_ptr + expert * stride_se + offs_n
        acc *= tl.load(s_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up *= tl.load(s_ptrs + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        acc = _silu_mul(acc, acc_up, out_ty)
    if MUL_WEIGHT:
        acc = acc.to(out_ty).to(tl.float32)  # the down projection's output, then the weight
        acc *= tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_gemv_kernel(
    a_ptr, w_ptr, s_ptr, o_ptr, out_ptr, ids_ptr, weights_ptr, res_ptr,
    N, K, num_experts, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    stride_rm,
    PAIRS_PER_PROGRAM: tl.constexpr, A_PER_PAIR: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
    WIDEN: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, LINE_BYTES: tl.constexpr, FAST_FP8: tl.constexpr,
    LATE_TRIGGER: tl.constexpr, logits_ptr=None, ROUTE: tl.constexpr = False,
    RENORMALIZE: tl.constexpr = False, BLOCK_E: tl.constexpr = 16,
    ROUTE_COPIES: tl.constexpr = 1,
):  # fmt: skip
    """Program (row, column block). Gate/up (SILU_MUL, PAIRS_PER_PROGRAM 1): row = pair, input
    row = its token. Down (MUL_WEIGHT, PAIRS_PER_PROGRAM k): row = token, looping over its k
    pairs (input row = pair), weighted and summed in fp32. Products accumulate elementwise in a
    [BLOCK_N, BLOCK_K] fp32 tile, reduced over K once after the loop; the K loop is pipelined
    (``NUM_STAGES`` weight tiles in flight), the weight read once (``evict_first``). A pair of
    the not-local sentinel expert (``num_experts``) reads nothing and adds zero. QUANT 1: an
    int8/fp8 weight with per-channel scales ``s [E, N(, +N)]``, applied after the K sum;
    QUANT 2: int4 with group scales and offsets (``stride_sn`` the groups a row), dequantized
    a ``[BLOCK_N, BLOCK_K]`` tile at a time by ``mixed_gemm._grouped_tile`` (K whole tiles;
    a not-local pair reads expert 0's rows and adds zero). RESIDUAL (down): the stored
    row is ``residual + out`` rounded as a separate add would.

    PDL (launched as a programmatic dependent, one token): the gate/up launch waits for its
    predecessor (the routing) and only then lets the down launch start, so when the down
    programs start the routing has completed: they read the expert ids and pull their weight
    rows into L2 (``PREFETCH_LINES`` 128-byte lines a row) while gate/up finishes, then wait.

    ROUTE (gate/up, one token: row = slot): the program routes the router's ``logits [E]``
    itself (``moe_topk.pick_rank``, one copy of the logits a warp: ``ROUTE_COPIES`` = the
    program's warps) and takes the expert of rank ``row``; the column block 0 programs store
    the ids and weights (``ids_ptr``, ``weights_ptr``) the down launch reads."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if PDL:
        if MUL_WEIGHT and PREFETCH_LINES > 1:  # down: the ids are final; weights never change
            offs_l = tl.arange(0, PREFETCH_LINES) * LINE_BYTES  # [LINES] byte offsets
            row_bytes = K * w_ptr.dtype.element_ty.primitive_bitwidth // 8
            if QUANT == 2:  # two weights a byte
                row_bytes = K // 2
            offs_l = tl.minimum(offs_l, row_bytes - 1)
            rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
            for j in tl.static_range(PAIRS_PER_PROGRAM):
                e = tl.load(ids_ptr + row * PAIRS_PER_PROGRAM + j).to(tl.int64)
                e = tl.where(e < num_experts, e, 0)
                base = (w_ptr + e * stride_we + rows_n[:, None] * stride_wn).to(
                    tl.pointer_type(tl.int8)
                )
                prefetch_l2(base + offs_l[None, :])  # [BN, LINES]
            tl.extra.cuda.gdc_wait()
        else:  # gate/up: wait for the routing (then let the down launch start)
            tl.extra.cuda.gdc_wait()
        if not LATE_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    if ROUTE:  # one token: this program's slot is the expert of rank `row`
        routed, w_row = pick_rank(logits_ptr, num_experts, row, A_PER_PAIR, RENORMALIZE,
                                  BLOCK_E, ROUTE_COPIES)  # fmt: skip
        routed = routed.to(tl.int64)
        if tl.program_id(1) == 0:
            tl.store(ids_ptr + row, routed)
            tl.store(weights_ptr + row, w_row.to(weights_ptr.dtype.element_ty))
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    out_ty = out_ptr.dtype.element_ty
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)  # int4: clamped rows, never stored
    offs_u = tl.arange(0, BLOCK_K // 2)  # int4: the step's bytes a row
    for j in tl.static_range(PAIRS_PER_PROGRAM):
        pair = row * PAIRS_PER_PROGRAM + j
        if ROUTE:
            expert = routed
        else:
            expert = tl.load(ids_ptr + pair).to(tl.int64)
        local = expert < num_experts
        expert = tl.where(local, expert, 0)
        a_row = pair // A_PER_PAIR
        w_base = w_ptr + expert * stride_we
        s_base = s_ptr + expert * stride_se
        o_base = o_ptr + expert * stride_se
        w_rows = w_base + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k_ok = offs_k < K - k0
            w_mask = n_ok[:, None] & k_ok[None, :] & local
            if QUANT == 2:  # int4: K whole BLOCK_K tiles (the launcher picks BLOCK_K | K)
                a = tl.load(a_ptr + a_row * stride_am + k0 + offs_k).to(tl.float32)[None, :]
                q_ptrs = w_base + rows_n[:, None] * stride_wn + (k0 // 2 + offs_u)[None, :]
                # the dequantized tile stays fp32 (no rounding to x's dtype: two conversions
                # a weight fewer; the sum differs from the reference by that rounding only)
                w = _grouped_tile(q_ptrs, s_base, o_base, rows_n, k0, stride_sn, tl.float32, 1,
                                  GROUP, BLOCK_N, BLOCK_K)  # fmt: skip  # [BN, BK]
                acc += w * a
                if SILU_MUL:
                    q_up = q_ptrs + N * stride_wn
                    w = _grouped_tile(q_up, s_base, o_base, rows_n + N, k0, stride_sn,
                                      tl.float32, 1, GROUP, BLOCK_N, BLOCK_K)  # fmt: skip
                    acc_up += w * a
            else:
                a = tl.load(a_ptr + a_row * stride_am + k0 + offs_k, mask=k_ok, other=0.0)
                a = a.to(tl.float32)[None, :]
                w_ptrs = w_rows + (k0 + offs_k)[None, :]
                w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
                if WIDEN == 2:  # mixed_gemm's widening: no conversion instructions
                    acc += _row_scaled_tile_of(w, out_ty, FAST_FP8).to(tl.float32) * a
                elif WIDEN == 1:
                    acc += _to_f32(w) * a
                else:
                    acc += w.to(tl.float32) * a
                if SILU_MUL:
                    w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0,
                                   eviction_policy="evict_first")  # fmt: skip
                    if WIDEN == 2:
                        acc_up += _row_scaled_tile_of(w_up, out_ty, FAST_FP8).to(tl.float32) * a
                    elif WIDEN == 1:
                        acc_up += _to_f32(w_up) * a
                    else:
                        acc_up += w_up.to(tl.float32) * a
        res = tl.sum(acc, axis=1)  # [BLOCK_N]
        res_up = tl.sum(acc_up, axis=1)
        if QUANT == 1:
            s_ptrs = s_ptr + expert * stride_se + offs_n
            res *= tl.load(s_ptrs, mask=n_ok & local, other=0.0).to(tl.float32)
            if SILU_MUL:
                res_up *= tl.load(s_ptrs + N, mask=n_ok & local, other=0.0).to(tl.float32)
        if SILU_MUL:
            res = _silu_mul(res, res_up, out_ty)
        if MUL_WEIGHT:
            res = res.to(out_ty).to(tl.float32) * tl.load(weights_ptr + pair).to(tl.float32)
        total += tl.where(local, res, 0.0)
    if PDL and LATE_TRIGGER:  # the next launch starts as this program's sums are done
        tl.extra.cuda.gdc_launch_dependents()
    result = total.to(out_ty)
    if RESIDUAL:  # the MoE output rounded, then the add rounded: the separate add's bits
        r = tl.load(res_ptr + row * stride_rm + offs_n, mask=n_ok, other=0.0)
        result = (result.to(tl.float32) + r.to(tl.float32)).to(out_ty)
    tl.store(out_ptr + row * stride_om + offs_n, result, mask=n_ok)


DECODE_PDL = False
"""The one-token MoE launches (``kernels.moe_router`` and both expert GEMVs) as programmatic
dependents when PDL is on. Off: H100, Qwen3-30B-A3B 48 layers, batch-1 decode 196.9 tok/s with
them as dependents, 237.7 without (the attention and skinny GEMMs keep PDL; every kernel
without it: 226.1). The MoE block alone (8 blocks chained) gains 1-3 us a block from PDL with
``LATE_TRIGGER``, not measured in the model yet."""
LATE_TRIGGER = False
"""Under PDL, when the one-token MoE launches let their successor start: False right after
their wait (the router: before it), True only once their sums are done (the router: after
its wait). Early triggers start the next launches' programs (and their prefetches) sooner,
but fill the SMs with waiting programs several launches ahead; benchmarks compare."""
DOWN_PREFETCH = True
"""Under PDL at one token, the down GEMV's programs pull their whole weight rows into L2 before
they wait for gate/up (False: PDL without the prefetch; benchmarks compare)."""
WIDE_DOWN = {0: True, 1: False}
"""Per expert layout (16-bit, int8/fp8), one token: the down projection by
``kernels.moe_down`` (one program per 8 output rows with all k experts' rows as one tile)
instead of the down GEMV (one program per column block looping over the experts). H100,
Qwen3-30B-A3B bf16, 48 layers at batch 1: the down GEMV 14.76 us a layer, the split down that
preceded this kernel 13.37 (programs per (column block, expert), fp32 partials summed by the
last of a block: ``scripts/gpu_moe4.py``), this one 3.041 -> 2.928 ms a step against the split
down (~9.9 us a layer; 4-row tiles 2.950; ``scripts/gpu_moe6.py``). 8-bit experts: not
measured, so off."""
GEMV_DOWN: dict[str, int] = {}
"""Overrides of the 16-bit down GEMV's tiles (one program per token and column block, looping
over the token's k experts; ``scripts/gpu_moe4.py`` sweeps them)."""
GEMV_CONFIG = dict(BLOCK_N=8, BLOCK_K=256, NUM_STAGES=3, num_warps=4)
"""The decode GEMV's tiles: 8 output rows x 256 K per step (4 KiB of bf16 weights), three steps
in flight; the gemv kernel's M = 1 configs on the H100 are of this shape (``kernels.gemv``)."""
GEMV_CONFIG_8BIT = dict(BLOCK_K=512, WIDEN=0)
"""Quantized experts: twice the K per step, the same 4 KiB of weights in flight per tile; WIDEN
1 widens int8 by the magic-number trick (``_to_f32``), 2 both 8-bit kinds as ``mixed_gemm``
does (fp8 by bit moves into bf16)."""
GEMV_CONFIG_INT4 = dict(BLOCK_N=8, BLOCK_K=256, NUM_STAGES=4)
"""int4 experts: 256 weights (128 bytes) of 8 rows a step, widened by ``mixed_gemm``'s group
tile (the nibbles through the mantissa of 1.0f, one FMA with the group's scale and offset).
H100, the MoE block at one token: 34.4 us (8 rows) vs 44.8 (16 rows), 48.5 (16 x 128)."""
GEMV_DOWN_8BIT: dict[str, int] = {}
"""Overrides of the quantized down GEMV only (one program per token and column block, looping
over the token's k experts: fewer programs than the gate/up GEMV, so smaller ``BLOCK_N`` may
pay)."""
GEMM_CONFIG_8BIT: dict[str, int] = dict(BLOCK_K=128, WIDEN=0)
"""Overrides of ``_gemm_config`` for quantized experts (``WIDEN`` 1: TF32 tensor cores on fp32
operands, see ``_expert_dot``; ``BLOCK_K``, ``num_stages``, ... as ``scripts/gpu_moe2.py``
sweeps them)."""


def warm_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    quant: dict[str, torch.Tensor] | None = None,
) -> None:
    """Compile every kernel variant ``fused_moe`` can pick for these weights (the GEMV path and
    each grouped tile config), so no step compiles mid-run. Runs once per weight shape/dtype.
    ``quant``: the scales (and int4 offsets) of quantized experts, as ``fused_moe`` takes them."""
    num_experts, hidden = w13.shape[0], x.shape[1]  # (int4 stacks hold H / 2 bytes a row)
    key = (tuple(w13.shape), tuple(w2.shape), w13.dtype, x.dtype, top_k, x.device)
    if key in _WARMED:
        return
    _WARMED.add(key)
    counts = {1, GEMV_MAX_TOKENS + 1}  # the GEMV; the grouped GEMM at its smallest tiles
    for per_expert in (32, 64, 128):  # one token count per larger BLOCK_M
        counts.add(-(-per_expert * num_experts // top_k))
    for pairs in (2048, 4096):  # moe_align's larger one-launch sizes
        counts.add(pairs // top_k)
    for num_tokens in sorted(counts):
        xs = torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
        ids = torch.arange(num_tokens * top_k, device=x.device).view(num_tokens, top_k)
        weights = torch.ones(num_tokens, top_k, dtype=x.dtype, device=x.device)
        fused_moe(xs, w13, w2, weights, ids % num_experts, **(quant or {}))


_WARMED: set[tuple] = set()


def _gemm_config(num_pairs: int, num_experts: int, silu_mul: bool) -> dict[str, int]:
    """Tiles by the mean rows per expert (BLOCK_M never far above it: padding rows are waste).
    Small blocks are weight reads: a deeper pipeline. The gate/up GEMM keeps two accumulators
    (gate and up), so its BLOCK_N stays at 64 to fit the registers."""
    per_expert = num_pairs / num_experts
    if per_expert <= 48:
        block_m = 16 if per_expert <= 16 else 32
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    block_m = 64 if per_expert <= 96 else 128
    block_n = 64 if silu_mul else 128
    warps = 8 if block_m * block_n >= 128 * 64 else 4
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, num_warps=warps, num_stages=3)


WEIGHT_LEFT = {0: 32.0, 1: 0.0, 2: float("inf")}
"""Per expert layout (``ExpertLayout.quant``): the grouped GEMM takes ``kernels.fused_moe_t``'s
weight-left kernel up to this many mean rows per expert (beyond, or for fp32 x, the first
grouped kernel). H100, Qwen3-30B-A3B layer (``scripts/gpu_moe3.py``), % of copy at 16 / 256
tokens, weight-left vs first: bf16 92 / 86 vs 88 / 82; int8 58 / 57 vs 76 / 73; fp8 59 / 53
vs 77 / 72; int4 33 / 30 vs 18 / 11. So 16-bit experts up to 32 rows per expert (larger
batches not measured yet), int8 / fp8 never, int4 always."""


def _gemm_t_config(
    num_pairs: int, num_experts: int, quant: int, hidden: int, inter: int
) -> dict[str, int] | None:
    """Tiles of the weight-left grouped GEMM (None: the first grouped kernel runs). BLOCK_M
    (the block's token rows, the MMA's N side) by the mean rows per expert; 64 weight rows
    (one warpgroup MMA's M); 128 of K where both K dims allow (smaller under the interpreter's
    test shapes)."""
    per_expert = num_pairs / num_experts
    if per_expert > WEIGHT_LEFT[quant]:
        return None
    block_m = (
        16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 96 else 128
    )
    block_k = next((b for b in (128, 64, 32, 16) if hidden % b == 0 and inter % b == 0), 0)
    if not block_k:
        return None
    warps = 4 if block_m <= 32 else 8
    cfg = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, NUM_STAGES=3, num_warps=warps)
    return cfg | GEMM_T_OVERRIDES


GEMM_T_OVERRIDES: dict[str, int] = {}
"""Overrides of the weight-left kernel's tiles (``BLOCK_N``, ``NUM_STAGES``, ``num_warps``; the
sweep of ``scripts/gpu_moe3.py``)."""


class ExpertLayout(NamedTuple):
    """How ``fused_moe``'s expert stacks are stored (see ``_layout``)."""

    quant: int
    """0: 16-bit in x's dtype; 1: int8 / fp8 with per-channel scales; 2: int4 with groups."""
    group13: int
    """Group size along H of w13 (int4), else 0."""
    group2: int
    """Group size along I of w2 (int4), else 0."""


def _layout(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    scales: tuple[torch.Tensor | None, ...],
) -> ExpertLayout:
    """Check the stacks against x and each other (int4 stacks hold two elements per byte)."""
    w13_scale, w2_scale, w13_offset, w2_offset = scales
    packed = 2 if w13.dtype == torch.uint8 else 1
    num_experts, two_inter, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * packed
    inter = two_inter // 2
    if x.dim() != 2 or x.shape[1] != hidden or two_inter % 2:
        raise ValueError(f"x {tuple(x.shape)} does not match w13 {tuple(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hidden, inter // packed) or w2.dtype != w13.dtype:
        raise ValueError(f"w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}")
    if ids.shape[0] != x.shape[0]:
        raise ValueError("one row of top-k ids per token")
    for t in (x, w13, w2):
        if t.stride(-1) != 1:
            raise ValueError("fused_moe needs the last dim of x and the weights contiguous")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("quantized experts need both w13_scale and w2_scale")
    if w13_scale is None or w2_scale is None:
        if w13.dtype != x.dtype:
            raise ValueError(f"16-bit experts must be in x's dtype {x.dtype}, got {w13.dtype}")
        return ExpertLayout(0, 0, 0)
    if packed == 1:
        if w13.dtype not in QUANT_DTYPES:
            raise ValueError(f"quantized experts must be int8, fp8 e4m3 or int4, got {w13.dtype}")
        for scale, w in ((w13_scale, w13), (w2_scale, w2)):
            if tuple(scale.shape) != tuple(w.shape[:2]) or not scale.is_contiguous():
                raise ValueError(
                    f"per-channel expert scales must be [E, N] = {tuple(w.shape[:2])} and "
                    f"contiguous, got {tuple(scale.shape)}"
                )
        return ExpertLayout(1, 0, 0)
    groups = []
    for scale, offset, w, k in (
        (w13_scale, w13_offset, w13, hidden),
        (w2_scale, w2_offset, w2, inter),
    ):
        if offset is None or scale.dim() != 3 or tuple(scale.shape[:2]) != tuple(w.shape[:2]):
            raise ValueError("int4 experts need scales and offsets [E, N, K // group]")
        if offset.shape != scale.shape or not (scale.is_contiguous() and offset.is_contiguous()):
            raise ValueError("int4 expert offsets must match their scales (contiguous)")
        if k % scale.shape[2] or k // scale.shape[2] not in (32, 64, 128):
            raise ValueError(f"int4 experts need groups of 32, 64 or 128 dividing K = {k}")
        groups.append(k // scale.shape[2])
    return ExpertLayout(2, groups[0], groups[1])


QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
"""Expert weight dtypes the kernels widen in registers (with per-channel scales); uint8
stacks are int4 (two per byte)."""


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    force_path: str | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_offset: torch.Tensor | None = None,
    w2_offset: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    route_logits: tuple[torch.Tensor, bool] | None = None,
) -> torch.Tensor:
    """``fused_moe_ref`` on Triton: x [T, H] -> [T, H] (``residual + `` it, rounded as a separate
    add, when ``residual [T, H]`` is given: fused into the down GEMV's store on the decode
    path). The decode GEMV path for at most
    GEMV_MAX_TOKENS tokens and GEMV_MAX_PAIRS pairs, else sorting + grouped GEMM
    (``force_path`` "gemv"/"grouped" for tests and benchmarks). No host sync: the path
    depends on shapes only.

    Quantized experts: ``w13``/``w2`` int8 or fp8 e4m3 with per-channel scales ``w13_scale
    [E, 2I]`` and ``w2_scale [E, H]`` (``w = q * s``), or int4 (uint8 ``[E, N, K // 2]``, low
    nibble first) with group scales and offsets ``[E, N, K // group]`` (``w = q * s + o``). An
    id equal to ``E`` (``NOT_LOCAL``: the pair's expert lives on another expert-parallel rank)
    contributes nothing and reads nothing.

    ``route_logits = (logits [E], renormalize)`` (one token, the GEMV path): the gate/up
    launch routes the router's logits itself and writes ``topk_weights`` / ``topk_ids`` (then
    output buffers, contiguous) for the down launch: no routing kernel or routing program
    before the experts (``moe_router.router_logits``)."""
    check_device(x, w13, w2, topk_weights, topk_ids)
    layout = _layout(x, w13, w2, topk_ids, (w13_scale, w2_scale, w13_offset, w2_offset))
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape[0], w13.shape[1], x.shape[1]
    inter = two_inter // 2
    num_pairs = num_tokens * top_k
    out = torch.empty_like(x)
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} must be x's shape {tuple(x.shape)}")
    if num_tokens == 0:
        return out
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    route: dict = {}
    if route_logits is not None:
        logits, renormalize = route_logits
        if num_tokens != 1 or force_path == "grouped" or ids is not topk_ids:
            raise ValueError("route_logits: one token, the GEMV path, contiguous id buffers")
        if weights is not topk_weights or logits.shape != (num_experts,):
            raise ValueError(f"route_logits: logits [{num_experts}], contiguous weight buffer")
        route = dict(logits_ptr=logits, ROUTE=True, RENORMALIZE=renormalize,
                     BLOCK_E=max(16, triton.next_power_of_2(num_experts)))  # fmt: skip
    s13 = w13 if w13_scale is None else w13_scale  # a placeholder pointer when unquantized
    s2 = w2 if w2_scale is None else w2_scale
    o13 = s13 if w13_offset is None else w13_offset
    o2 = s2 if w2_offset is None else w2_offset
    sn13, sn2 = (s13.stride(1), s2.stride(1)) if layout.quant == 2 else (1, 1)
    small = num_tokens <= GEMV_MAX_TOKENS and num_pairs <= GEMV_MAX_PAIRS
    path = force_path or ("gemv" if small else "grouped")
    if route and path != "gemv":
        raise ValueError(f"route_logits needs the GEMV path (top_k <= {GEMV_MAX_PAIRS})")
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # silu(gate) * up
    if path == "gemv":
        cfg = dict(GEMV_CONFIG)
        cfg["WIDEN"] = 0
        if layout.quant:  # keep ~4 KiB of weights per tile step
            cfg.update(GEMV_CONFIG_8BIT)
        if layout.quant == 2:
            cfg.update(GEMV_CONFIG_INT4)
        if is_interpret():  # small shapes: smaller tiles keep the interpreter quick
            cfg.update(BLOCK_K=min(cfg["BLOCK_K"], triton.next_power_of_2(max(hidden, inter))))
        cfg2 = dict(cfg, **(GEMV_DOWN_8BIT if layout.quant else GEMV_DOWN))
        if layout.quant == 2:  # whole int4 tiles: BLOCK_K a power of two dividing each K
            cfg["BLOCK_K"] = min(cfg["BLOCK_K"], hidden & -hidden)
            cfg2["BLOCK_K"] = min(cfg2["BLOCK_K"], inter & -inter)
        # PDL at one token: the down launch prefetches its rows while gate/up runs
        pdl = num_tokens == 1 and not is_interpret() and pdl_enabled() and DECODE_PDL
        meta: dict = dict(PDL=pdl, LINE_BYTES=128, FAST_FP8=not is_interpret(),
                          LATE_TRIGGER=LATE_TRIGGER)  # fmt: skip
        meta |= dict(launch_pdl=True) if pdl else {}
        if route:  # one copy of the logits a warp
            route["ROUTE_COPIES"] = cfg["num_warps"]
        res = out if residual is None else residual
        _moe_gemv_kernel[(num_pairs, triton.cdiv(inter, cfg["BLOCK_N"]))](
            x, w13, s13, o13, act, ids, weights, res, inter, hidden, num_experts,
            x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), sn13, act.stride(0),
            res.stride(0), PAIRS_PER_PROGRAM=1, A_PER_PAIR=top_k, SILU_MUL=True,
            MUL_WEIGHT=False, QUANT=layout.quant, GROUP=layout.group13, RESIDUAL=False,
            PREFETCH_LINES=1, **cfg, **meta, **route,
        )  # fmt: skip
        if num_tokens == 1 and layout.quant < 2 and WIDE_DOWN[layout.quant]:
            from roofline.kernels.moe_down import moe_down_wide

            return moe_down_wide(act, w2, weights, ids, out, residual, w2_scale)
        row_bytes = w2.shape[2] * w2.element_size()
        _moe_gemv_kernel[(num_tokens, triton.cdiv(hidden, cfg2["BLOCK_N"]))](
            act, w2, s2, o2, out, ids, weights, res, hidden, inter, num_experts,
            act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), sn2, out.stride(0),
            res.stride(0), PAIRS_PER_PROGRAM=top_k, A_PER_PAIR=1, SILU_MUL=False,
            MUL_WEIGHT=True, QUANT=layout.quant, GROUP=layout.group2,
            RESIDUAL=residual is not None,
            PREFETCH_LINES=triton.next_power_of_2(triton.cdiv(row_bytes, 128))
            if pdl and DOWN_PREFETCH and not route  # routed: the ids are gate/up's output
            else 1,
            **cfg2, **meta,
        )  # fmt: skip
        return out
    if path != "grouped":
        raise ValueError(f"unknown fused_moe path {path!r}")
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    cfg_t = _gemm_t_config(num_pairs, num_experts, layout.quant, hidden, inter)
    if cfg_t is not None and fused_moe_t.takes(x, hidden, inter, cfg_t["BLOCK_K"]):
        align = moe_align(ids, num_experts + 1, cfg_t["BLOCK_M"])  # + the NOT_LOCAL runs
        fused_moe_t.launch(x, w13, s13, o13, act, align, weights, inter, hidden, num_pairs,
                           num_experts, top_k, True, layout.group13, cfg_t)  # fmt: skip
        fused_moe_t.launch(act, w2, s2, o2, per_pair, align, weights, hidden, inter, num_pairs,
                           num_experts, 1, False, layout.group2, cfg_t)  # fmt: skip
        return _sum_topk(per_pair, top_k, residual, out)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 must not round via TF32
    cfgs = {s: _gemm_config(num_pairs, num_experts, s) | dict(WIDEN=0) for s in (True, False)}
    for cfg in cfgs.values():
        if layout.quant:
            cfg.update(GEMM_CONFIG_8BIT)
        if layout.quant == 2:  # a K step within one group (and at least 16 bytes for the dot)
            cfg["BLOCK_K"] = max(32, min(cfg["BLOCK_K"], layout.group13, layout.group2))
    block_m = cfgs[True]["BLOCK_M"]  # both GEMMs read the same alignment
    align = moe_align(ids, num_experts + 1, block_m)  # + the NOT_LOCAL sentinel's runs
    num_blocks = align.block_expert_ids.numel()
    for a, w, sc, off, sn, group, dst, n, k, div, silu in (
        (x, w13, s13, o13, sn13, layout.group13, act, inter, hidden, top_k, True),
        (act, w2, s2, o2, sn2, layout.group2, per_pair, hidden, inter, 1, False),
    ):
        cfg = cfgs[silu]
        grid = (num_blocks, triton.cdiv(n, cfg["BLOCK_N"]))
        _moe_gemm_kernel[grid](
            a, w, sc, off, dst, align.sorted_pair_ids, align.block_expert_ids, align.num_padded,
            weights, n, k, num_pairs, num_experts, div, a.stride(0), w.stride(0), w.stride(1),
            sc.stride(0), sn, dst.stride(0),
            SILU_MUL=silu, MUL_WEIGHT=not silu, PRECISION=precision, QUANT=layout.quant,
            GROUP=group, **cfg,
        )  # fmt: skip
    return _sum_topk(per_pair, top_k, residual, out)
