"""The roofline model of one engine step: the single implementation the planner, the simulator
and ``roofline bench`` all use.

A step computes ``num_decode_tokens`` decode tokens (each attending to its context) and zero or
more prefill chunks ``(num_new_tokens, num_cached_tokens)``. Its time is

    max(bytes / HBM bandwidth, block GEMM FLOPs / GEMM peak + (LM head + attention) FLOPs /
        16-bit peak)
    + tensor-parallel all-reduce time + a fixed per-step overhead,

where bytes = every weight once (linear layers, norms, LM head; only the embedding rows the step
looks up) + the KV the step reads (its whole context, new tokens included, as paged attention
reads them back after writing) + the KV it writes. FLOPs = 2 x linear parameters per token,
``4 x heads x head_dim`` per (query, key) pair per layer for attention (causal within a
prefill chunk) and the LM head only for tokens that sample. An MoE layer reads the experts its
tokens are expected to touch (``planner.moe``) and computes with the top-k of each token.
Activation traffic between kernels is left out: it is small next to the weights and KV a
decode step reads, and the prefill steps where it grows are compute-bound. All quantities are
per tensor-parallel rank. For a dense model everything is linear in the batch at a fixed
context, which :func:`crossover_batch_size` uses to solve for where decode turns
compute-bound (an MoE model's weight bytes are not: it searches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from roofline.config import ModelConfig
from roofline.planner.hardware import GPUSpec, canonical_dtype
from roofline.planner.memory import (
    KVLayout,
    kv_bytes_per_token,
    other_bytes_per_param,
    param_counts,
    weight_bytes,
)
from roofline.planner.moe import experts_read
from roofline.planner.parallel import allreduce_time_per_step_s


@dataclass(frozen=True)
class Precision:
    """Storage precision of weights and KV, and the dtype GEMMs run in."""

    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    compute_dtype: str | None = None
    """None: fp8 weights run fp8 GEMMs (W8A8), fp32 runs TF32, int8/int4 weights are
    dequantized into bf16 GEMMs (weight-only)."""
    quant_group_size: int = 128
    """Weights per fp16 scale for int4."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_dtype", canonical_dtype(self.weight_dtype))
        object.__setattr__(self, "kv_dtype", canonical_dtype(self.kv_dtype))
        if self.compute_dtype is not None:
            object.__setattr__(self, "compute_dtype", canonical_dtype(self.compute_dtype))

    @property
    def gemm_dtype(self) -> str:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return {"fp8": "fp8", "fp32": "fp32"}.get(self.weight_dtype, "bf16")


BF16 = Precision()


@dataclass(frozen=True)
class StepCost:
    """Bytes, FLOPs and the time of one step on one rank."""

    num_tokens: int
    weight_bytes: float
    embedding_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    linear_flops: float
    attention_flops: float
    memory_time_s: float
    compute_time_s: float
    comm_time_s: float = 0.0
    overhead_s: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.embedding_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops

    @property
    def time_s(self) -> float:
        return max(self.memory_time_s, self.compute_time_s) + self.comm_time_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_time_s > self.memory_time_s else "memory"

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte of HBM traffic."""
        return self.flops / self.bytes if self.bytes else 0.0


def linear_flops_per_token(model: ModelConfig, include_lm_head: bool = False) -> float:
    """2 x the linear-layer parameters of all blocks (plus the LM head when asked); an MoE
    token runs its ``num_experts_per_tok`` experts only."""
    pc = param_counts(model, model.num_experts_per_tok or None)
    return 2.0 * (pc.linear + (pc.lm_head if include_lm_head else 0))


def attention_flops_per_pair(model: ModelConfig, kv_layout: KVLayout | None = None) -> float:
    """FLOPs of one (query token, key token) pair over all layers: QK^T and PV, 2 each per MAC.
    For MLA (weights absorbed) a head scores against the latent plus the RoPE key and reads the
    latent as its value."""
    heads = model.num_attention_heads
    if kv_layout is not None and kv_layout.is_mla:
        width = 2 * kv_layout.kv_lora_rank + kv_layout.qk_rope_head_dim
        return 2.0 * heads * width * kv_layout.num_layers
    return 4.0 * heads * model.head_dim * model.num_hidden_layers


def prefill_attention_pairs(num_new_tokens: int, num_cached_tokens: int = 0) -> int:
    """Causal (query, key) pairs of a chunk: each new token sees the cache and the chunk up to
    itself, ``q * p + q (q + 1) / 2``."""
    q = num_new_tokens
    return q * num_cached_tokens + q * (q + 1) // 2


def prefill_flops(
    model: ModelConfig,
    num_new_tokens: int,
    num_cached_tokens: int = 0,
    num_sampled_tokens: int = 1,
    kv_layout: KVLayout | None = None,
) -> float:
    """FLOPs of prefilling ``num_new_tokens`` after ``num_cached_tokens`` cached ones: linear
    layers for every token, causal attention, LM head for the tokens that sample."""
    pairs = prefill_attention_pairs(num_new_tokens, num_cached_tokens)
    head = 2.0 * model.vocab_size * model.hidden_size * num_sampled_tokens
    return (
        linear_flops_per_token(model) * num_new_tokens
        + attention_flops_per_pair(model, kv_layout) * pairs
        + head
    )


def decode_flops(
    model: ModelConfig, batch_size: int, context_len_sum: int, kv_layout: KVLayout | None = None
) -> float:
    """FLOPs of one decode step: every token runs the blocks and the LM head, and attends to
    its context (``context_len_sum`` keys in all)."""
    return (
        linear_flops_per_token(model, include_lm_head=True) * batch_size
        + attention_flops_per_pair(model, kv_layout) * context_len_sum
    )


def step_weight_bytes(
    model: ModelConfig, precision: Precision = BF16, tp: int = 1, num_tokens: int | None = None
) -> float:
    """Weights one step reads on a rank: all blocks, norms and the LM head (not the embedding
    table, of which only looked-up rows are read). MoE: per MoE layer only the experts that
    ``num_tokens`` tokens are expected to touch (``planner.moe``; all when None)."""
    experts = experts_read(model, num_tokens)
    wb = weight_bytes(model, precision.weight_dtype, precision.quant_group_size, tp, experts)
    return wb.linear + wb.other + wb.lm_head_read


def decode_bytes_per_step(
    model: ModelConfig,
    batch_size: int,
    context_len_sum: int,
    precision: Precision = BF16,
    tp: int = 1,
    kv_layout: KVLayout | None = None,
) -> float:
    """HBM bytes of one decode step of ``batch_size`` tokens whose contexts (new token
    included) add up to ``context_len_sum``."""
    return step_cost(
        model,
        None,
        batch_size,
        context_len_sum,
        precision=precision,
        tp=tp,
        kv_layout=kv_layout,
    ).bytes


def step_cost(
    model: ModelConfig,
    gpu: GPUSpec | None,
    num_decode_tokens: int = 0,
    decode_context_lens: int | Sequence[int] = 0,
    num_prefill_tokens: int = 0,
    prefill_chunks: Sequence[tuple[int, int]] | None = None,
    *,
    precision: Precision = BF16,
    tp: int = 1,
    kv_layout: KVLayout | None = None,
    overhead_s: float = 0.0,
    decode_shared_tokens: int = 0,
) -> StepCost:
    """Bytes, FLOPs and time of one mixed step.

    ``decode_context_lens``: the context of each decode token (new token included), or their
    sum. ``prefill_chunks``: ``(num_new_tokens, num_cached_tokens)`` per prefilling request;
    when omitted, ``num_prefill_tokens`` is one fresh prompt. Every decode token and every
    chunk samples once. ``gpu`` None gives bytes and FLOPs with zero times.
    ``decode_shared_tokens``: decode context tokens whose KV another decode token of the step
    also reads (pages shared through the prefix cache): read once, they leave the KV bytes and
    keep their attention FLOPs.
    """
    if isinstance(decode_context_lens, int):
        ctx_sum = decode_context_lens
    else:
        if num_decode_tokens and len(decode_context_lens) != num_decode_tokens:
            raise ValueError("decode_context_lens must have one entry per decode token")
        num_decode_tokens = len(decode_context_lens)
        ctx_sum = sum(decode_context_lens)
    if num_decode_tokens < 0 or ctx_sum < 0 or num_prefill_tokens < 0:
        raise ValueError("token counts must be non-negative")
    if num_decode_tokens and ctx_sum < num_decode_tokens:
        raise ValueError("each decode token's context includes itself, so sum >= count")
    if not 0 <= decode_shared_tokens <= max(0, ctx_sum - num_decode_tokens):
        raise ValueError("decode_shared_tokens must lie in [0, context sum - decode tokens]")
    if prefill_chunks is None:
        prefill_chunks = [(num_prefill_tokens, 0)] if num_prefill_tokens else []
    elif num_prefill_tokens and num_prefill_tokens != sum(q for q, _ in prefill_chunks):
        raise ValueError("num_prefill_tokens disagrees with prefill_chunks")
    num_prefill = sum(q for q, _ in prefill_chunks)
    num_tokens = num_decode_tokens + num_prefill
    layout = kv_layout or KVLayout.from_model(model)
    kv_tok = kv_bytes_per_token(layout, precision.kv_dtype, tp)

    pairs = ctx_sum + sum(prefill_attention_pairs(q, p) for q, p in prefill_chunks)
    kv_read_tokens = ctx_sum - decode_shared_tokens + sum(q + p for q, p in prefill_chunks)
    num_sampled = num_decode_tokens + len(prefill_chunks)
    head_flops = 2.0 * model.vocab_size * model.hidden_size * num_sampled
    body = linear_flops_per_token(model) * num_tokens / tp
    linear = body + head_flops / tp
    attention = attention_flops_per_pair(model, kv_layout) * pairs / tp
    weights = step_weight_bytes(model, precision, tp, num_tokens) if num_tokens else 0.0
    embedding = num_tokens * model.hidden_size * other_bytes_per_param(precision.weight_dtype)
    kv_read, kv_write = kv_read_tokens * kv_tok, num_tokens * kv_tok

    if gpu is None:
        mem_t = comp_t = comm_t = 0.0
    else:
        mem_t = (weights + embedding + kv_read + kv_write) / gpu.hbm_bandwidth_bytes_per_s
        # the LM head and attention stay 16-bit whatever the block weights are
        sixteen = gpu.peak_flops_per_s("fp32" if precision.gemm_dtype == "fp32" else "bf16")
        comp_t = (
            body / gpu.peak_flops_per_s(precision.gemm_dtype)
            + (linear - body + attention) / sixteen
        )
        comm_t = allreduce_time_per_step_s(model, gpu, tp, num_tokens) if num_tokens else 0.0
    return StepCost(
        num_tokens=num_tokens,
        weight_bytes=weights,
        embedding_bytes=embedding,
        kv_read_bytes=kv_read,
        kv_write_bytes=kv_write,
        linear_flops=linear,
        attention_flops=attention,
        memory_time_s=mem_t,
        compute_time_s=comp_t,
        comm_time_s=comm_t,
        overhead_s=overhead_s if num_tokens else 0.0,
    )


def step_time(
    model: ModelConfig,
    gpu: GPUSpec,
    num_decode_tokens: int = 0,
    decode_context_lens: int | Sequence[int] = 0,
    num_prefill_tokens: int = 0,
    prefill_chunks: Sequence[tuple[int, int]] | None = None,
    **kwargs: object,
) -> float:
    """Roofline seconds of one step (see :func:`step_cost` for the arguments)."""
    return step_cost(
        model,
        gpu,
        num_decode_tokens,
        decode_context_lens,
        num_prefill_tokens,
        prefill_chunks,
        **kwargs,  # type: ignore[arg-type]
    ).time_s
