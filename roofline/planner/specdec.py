"""Speculative decoding arithmetic (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding").

A draft model proposes ``k`` tokens; the target verifies them in one step, accepts a prefix and
always adds one token of its own (the bonus or the correction). With a per-token acceptance rate
``alpha`` (independent across positions) the expected tokens per target step are
``(1 - alpha^(k+1)) / (1 - alpha)``, and with a draft step costing ``c`` target steps the
wall-time speedup is that divided by ``1 + k c``. The roofline variant prices the draft steps
and the (k + 1)-token verification with :func:`step_cost` instead of a fixed ratio, which shows
the speedup fading as a large batch turns the verification compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from roofline.config import ModelConfig
from roofline.planner.hardware import GPUSpec
from roofline.planner.roofline import BF16, Precision, step_cost


def _check(alpha: float, k: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"draft length must be >= 0, got {k}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens a target step yields: ``sum_{i=0..k} alpha^i``."""
    _check(alpha, k)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Wall-time speedup over plain decoding when a draft step costs ``cost_ratio`` target
    steps and verifying ``k + 1`` tokens costs one target step (memory-bound target)."""
    if cost_ratio < 0:
        raise ValueError("cost_ratio must be >= 0")
    return expected_tokens_per_step(alpha, k) / (1.0 + k * cost_ratio)


@dataclass(frozen=True)
class DraftChoice:
    best_k: int
    best_speedup: float
    curve: list[tuple[int, float, float]]
    """(k, expected tokens per step, speedup) for k = 0 .. max_k."""

    def near_optimal(self, tolerance: float = 0.02) -> list[int]:
        """Draft lengths within ``tolerance`` (relative) of the best speedup."""
        return [k for k, _, s in self.curve if s >= self.best_speedup * (1.0 - tolerance)]


def optimal_draft_length(alpha: float, cost_ratio: float, max_k: int = 32) -> DraftChoice:
    curve = [
        (k, expected_tokens_per_step(alpha, k), speedup(alpha, k, cost_ratio))
        for k in range(max_k + 1)
    ]
    best = max(curve, key=lambda row: row[2])
    return DraftChoice(best_k=best[0], best_speedup=best[2], curve=curve)


def acceptance_rate_from_tokens_per_step(mean_tokens_per_step: float, k: int) -> float:
    """Invert :func:`expected_tokens_per_step` (bisection): the per-token acceptance rate that a
    measured mean of tokens per target step implies at draft length ``k``."""
    if not 1.0 <= mean_tokens_per_step <= k + 1:
        raise ValueError(f"tokens per step must be in [1, {k + 1}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, k) < mean_tokens_per_step:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class RooflineSpecDec:
    k: int
    expected_tokens: float
    target_step_s: float
    draft_step_s: float
    verify_step_s: float
    speedup: float

    @property
    def cost_ratio(self) -> float:
        return self.draft_step_s / self.target_step_s


def roofline_speedup(
    target: ModelConfig,
    draft: ModelConfig,
    gpu: GPUSpec,
    alpha: float,
    k: int,
    batch_size: int = 1,
    context_len: int = 1024,
    precision: Precision = BF16,
) -> RooflineSpecDec:
    """Speedup with step times from the roofline: ``k`` draft decode steps plus one target
    step verifying ``k + 1`` tokens per sequence, against one plain target decode step."""
    b, ctx = batch_size, context_len
    plain = step_cost(target, gpu, b, b * ctx, precision=precision).time_s
    draft_step = step_cost(draft, gpu, b, b * ctx, precision=precision).time_s
    verify = step_cost(
        target, gpu, prefill_chunks=[(k + 1, ctx - 1)] * b, precision=precision
    ).time_s
    tokens = expected_tokens_per_step(alpha, k)
    return RooflineSpecDec(
        k=k,
        expected_tokens=tokens,
        target_step_s=plain,
        draft_step_s=draft_step,
        verify_step_s=verify,
        speedup=tokens * plain / (k * draft_step + verify),
    )
