"""One token's MoE routing on the device, shared by the router kernel (its last program routes)
and the gate/up GEMV (``fused_moe``'s ``ROUTE``: each program picks its own expert,
``pick_rank``): the fp32
softmax of the router logits, then the top-k by rank (``top_k_by_rank``: each expert's rank
among the probabilities from one ``[E, E]`` comparison, ties to the lowest expert), as
``fused_moe.route`` does."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def top_k_by_rank(prob, offs, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_E: tl.constexpr):  # fmt: skip
    """``fused_moe.top_k_of`` in one pass: each probability's rank (how many keys exceed its
    key; the key is the probability's bits above the reversed index, so ties go to the lowest
    expert) from one ``[BLOCK_E, BLOCK_E]`` comparison. Returns ``(rank, weight)`` per expert
    ``[BLOCK_E]``: rank < TOP_K marks the chosen ones, weight their (renormalised) probability;
    the caller stores each at its rank."""
    bits = prob.to(tl.int32, bitcast=True).to(tl.int64)
    key = (bits << 32) | (BLOCK_E - 1 - offs).to(tl.int64)  # [BLOCK_E], all distinct
    beats = tl.expand_dims(key, 0) > tl.expand_dims(key, 1)  # [i, j]: key j beats key i
    rank = tl.sum(beats.to(tl.int32), axis=1)  # [BLOCK_E]
    chosen = rank < TOP_K
    weight = prob
    if RENORMALIZE:
        weight = prob / tl.sum(tl.where(chosen, prob, 0.0), axis=0)
    return rank, weight


@triton.jit
def route_logits(logits_ptr, E, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                 BLOCK_E: tl.constexpr):  # fmt: skip
    """``fused_moe.route`` of one token's logits ``[E]`` (``.cg``: another kernel or program
    wrote them): fp32 softmax, then ``top_k_by_rank``. Returns ``(experts, rank, weight)``
    ``[BLOCK_E]``: rank < TOP_K marks the chosen experts."""
    offs = tl.arange(0, BLOCK_E)
    logit = tl.load(logits_ptr + offs, mask=offs < E, other=float("-inf"), cache_modifier=".cg")
    logit = logit.to(tl.float32)
    prob = tl.exp(logit - tl.max(logit, axis=0))
    prob = prob / tl.sum(prob, axis=0)  # [BLOCK_E] softmax
    rank, weight = top_k_by_rank(prob, offs, TOP_K, RENORMALIZE, BLOCK_E)
    return offs, rank, weight


@triton.jit
def pick_rank(logits_ptr, E, rank_wanted, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
              BLOCK_E: tl.constexpr, COPIES: tl.constexpr):  # fmt: skip
    """The expert of rank ``rank_wanted`` (< TOP_K) among one token's logits and its
    (renormalised) weight, ``route_logits``'s choice by TOP_K max passes over the keys instead
    of the ``[E, E]`` ranks (one key a value live, not E: the gate/up GEMV routes with it and
    keeps its registers), every warp routing its own copy of the logits: a ``[COPIES,
    BLOCK_E]`` tile (COPIES = the program's warps; with ``E`` a multiple of 16 the compiler
    gives each warp one row, BLOCK_E // 32 values a thread), so each reduction of the softmax
    and the passes stays within a warp (shuffles, no shared memory or barrier) and only the
    final pick crosses warps. sm_90 PTX at 128 experts, top 8, in the gate/up GEMV: 6 barriers
    over the plain GEMV where one copy a program took 36, 72 registers either way; H100,
    Qwen3-30B-A3B batch 1: -40 us a step (``scripts/gpu_moe6.py``). The probabilities' sums
    may round otherwise than ``route_logits``'s (another summation order): weights within an
    ulp, the same experts but at exact near-ties."""
    offs = tl.arange(0, BLOCK_E)
    copies = tl.arange(0, COPIES)
    ptrs = logits_ptr + offs[None, :] + 0 * copies[:, None]  # [COPIES, BLOCK_E]
    logit = tl.load(ptrs, mask=(offs < E)[None, :], other=float("-inf"), cache_modifier=".cg")
    logit = logit.to(tl.float32)
    prob = tl.exp(logit - tl.max(logit, axis=1)[:, None])
    prob = prob / tl.sum(prob, axis=1)[:, None]  # [COPIES, BLOCK_E] softmax, one a warp
    bits = prob.to(tl.int32, bitcast=True).to(tl.int64)
    key = (bits << 32) | (BLOCK_E - 1 - offs[None, :]).to(tl.int64)  # all distinct in a row
    expert = tl.zeros([COPIES], dtype=tl.int64)
    for rank in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)  # [COPIES]
        expert = tl.where(rank == rank_wanted, BLOCK_E - 1 - (best & 0xFFFFFFFF), expert)
        key = tl.where(key == best[:, None], -1, key)  # chosen: out of the next passes
    mine = offs[None, :] == expert[:, None]
    weight = tl.sum(tl.where(mine, prob, 0.0), axis=1)  # [COPIES]
    if RENORMALIZE:
        weight = weight / tl.sum(tl.where(key == -1, prob, 0.0), axis=1)
    return tl.max(expert, axis=0), tl.max(weight, axis=0)  # the copies agree
