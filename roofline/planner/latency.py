"""Latency and throughput estimates built on the step roofline: decode tok/s per batch size,
the batch where decode turns compute-bound, prefill time (TTFT) and time per output token.

A static batch of ``batch_size`` requests with ``prompt_len`` prompt tokens and ``output_len``
new tokens each is prefilled in steps of at most ``max_num_batched_tokens`` tokens, then decodes
``output_len - 1`` steps (the first token comes out of the prefill), step ``i`` attending to
``prompt_len + i`` tokens; TPOT is the mean of those steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from roofline.config import ModelConfig
from roofline.planner.hardware import GPUSpec
from roofline.planner.memory import KVLayout
from roofline.planner.roofline import BF16, Precision, StepCost, step_cost


@dataclass(frozen=True)
class DecodePoint:
    batch_size: int
    context_len: int
    cost: StepCost

    @property
    def step_time_s(self) -> float:
        return self.cost.time_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.cost.time_s

    @property
    def tokens_per_s_per_seq(self) -> float:
        return 1.0 / self.cost.time_s

    @property
    def kv_fraction_of_bytes(self) -> float:
        c = self.cost
        return (c.kv_read_bytes + c.kv_write_bytes) / c.bytes


def decode_point(
    model: ModelConfig,
    gpu: GPUSpec,
    batch_size: int,
    context_len: int,
    precision: Precision = BF16,
    tp: int = 1,
    kv_layout: KVLayout | None = None,
) -> DecodePoint:
    """One decode step of ``batch_size`` sequences, each attending to ``context_len`` tokens
    (``kv_layout``: an MLA cache, else the model's own heads)."""
    if batch_size <= 0 or context_len <= 0:
        raise ValueError("batch_size and context_len must be positive")
    cost = step_cost(
        model,
        gpu,
        batch_size,
        batch_size * context_len,
        precision=precision,
        tp=tp,
        kv_layout=kv_layout,
    )
    return DecodePoint(batch_size, context_len, cost)


def crossover_batch_size(
    model: ModelConfig,
    gpu: GPUSpec,
    context_len: int = 1,
    precision: Precision = BF16,
    tp: int = 1,
    kv_layout: KVLayout | None = None,
) -> float | None:
    """Batch size where decode compute time reaches memory time, or None when the per-token KV
    traffic alone outruns the per-token FLOPs (long contexts: decode never turns compute-bound).

    For a dense model both times are affine in the batch ``B``: ``mem(B) = m0 + B m1``,
    ``comp(B) = B c1``; the crossover is ``B* = m0 / (c1 - m1)``. Without KV this is the
    familiar ``peak / (2 x bandwidth / bytes_per_param)``. An MoE step's bytes are not affine
    (the experts a batch touches saturate): see :func:`_moe_crossover_batch_size`.
    """
    if model.num_experts:
        return _moe_crossover_batch_size(model, gpu, context_len, precision, tp, kv_layout)
    one = decode_point(model, gpu, 1, context_len, precision, tp, kv_layout).cost
    two = decode_point(model, gpu, 2, context_len, precision, tp, kv_layout).cost
    m1 = two.memory_time_s - one.memory_time_s
    c1 = two.compute_time_s - one.compute_time_s
    m0 = one.memory_time_s - m1
    c0 = one.compute_time_s - c1
    if c1 <= m1:
        return None
    return (m0 - c0) / (c1 - m1)


SATURATED_BATCH = 1 << 20
"""A batch that touches every expert of every MoE layer (the expected count rounds to all)."""


def _moe_crossover_batch_size(
    model: ModelConfig,
    gpu: GPUSpec,
    context_len: int,
    precision: Precision,
    tp: int,
    kv_layout: KVLayout | None,
) -> float | None:
    """The MoE crossover. ``gap(B) = comp(B) - mem(B)`` is convex in ``B``: the compute time is
    linear (each token runs its top-k experts) and the memory time concave (the expected
    experts read, ``planner.moe``, grow ever slower towards all of them). So ``gap`` crosses
    zero once, upwards, if and only if its slope is positive once every expert is read;
    doubling brackets the crossing, bisection narrows it to consecutive batches, and the
    fractional batch between them is interpolated."""

    def gap(batch: int) -> float:
        cost = decode_point(model, gpu, batch, context_len, precision, tp, kv_layout).cost
        return cost.compute_time_s - cost.memory_time_s

    if gap(2 * SATURATED_BATCH) <= gap(SATURATED_BATCH):
        return None
    lo, hi = 1, 1
    if gap(1) >= 0:
        return 1.0
    while gap(hi) < 0:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if gap(mid) < 0:
            lo = mid
        else:
            hi = mid
    g_lo, g_hi = gap(lo), gap(hi)
    return lo + -g_lo / (g_hi - g_lo)


def prefill_time_s(
    model: ModelConfig,
    gpu: GPUSpec,
    prompt_len: int,
    batch_size: int = 1,
    max_num_batched_tokens: int | None = None,
    precision: Precision = BF16,
    tp: int = 1,
    kv_layout: KVLayout | None = None,
) -> float:
    """Time to prefill ``batch_size`` prompts of ``prompt_len`` tokens, packed into steps of at
    most ``max_num_batched_tokens`` tokens (chunked prefill); the first token comes out of the
    last step."""
    if prompt_len <= 0 or batch_size <= 0:
        raise ValueError("prompt_len and batch_size must be positive")
    budget = max_num_batched_tokens or prompt_len * batch_size
    done = [0] * batch_size
    total_s = 0.0
    i = 0
    while i < batch_size:
        chunks: list[tuple[int, int]] = []
        left = budget
        while i < batch_size and left > 0:
            q = min(prompt_len - done[i], left)
            chunks.append((q, done[i]))
            done[i] += q
            left -= q
            if done[i] == prompt_len:
                i += 1
        total_s += step_cost(
            model, gpu, prefill_chunks=chunks, precision=precision, tp=tp, kv_layout=kv_layout
        ).time_s
    return total_s


@dataclass(frozen=True)
class LatencyEstimate:
    ttft_s: float
    tpot_s: float
    """Mean decode step time over the output."""
    e2e_s: float
    output_tokens_per_s: float
    """Whole batch, output tokens over end-to-end time."""


def estimate_latency(
    model: ModelConfig,
    gpu: GPUSpec,
    prompt_len: int,
    output_len: int,
    batch_size: int = 1,
    max_num_batched_tokens: int | None = None,
    precision: Precision = BF16,
    tp: int = 1,
    kv_layout: KVLayout | None = None,
) -> LatencyEstimate:
    """TTFT, TPOT and end-to-end time of a static batch (prefill all, then decode together)."""
    if output_len <= 0:
        raise ValueError("output_len must be positive")
    ttft = prefill_time_s(
        model, gpu, prompt_len, batch_size, max_num_batched_tokens, precision, tp, kv_layout
    )
    num_decode_steps = output_len - 1
    decode_s = sum(
        step_cost(
            model,
            gpu,
            batch_size,
            batch_size * (prompt_len + i),
            precision=precision,
            tp=tp,
            kv_layout=kv_layout,
        ).time_s
        for i in range(1, output_len)
    )
    tpot = decode_s / num_decode_steps if num_decode_steps else 0.0
    e2e = ttft + num_decode_steps * tpot
    return LatencyEstimate(
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        output_tokens_per_s=batch_size * output_len / e2e,
    )
