"""Speculative decoding arithmetic (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding").

A draft model proposes ``k`` tokens; the target verifies them in one step, accepts a prefix and
always adds one token of its own (the bonus or the correction). With a per-token acceptance rate
``alpha`` (independent across positions) the expected tokens per target step are
``(1 - alpha^(k+1)) / (1 - alpha)``, and with a draft step costing ``c`` target steps the
wall-time speedup is that divided by ``v + k c``, ``v`` the verification step's cost in target
steps: 1 while the target is memory-bound (batch 1), up to ``k + 1`` once a batch of ``b``
requests verifies ``b (k + 1)`` rows whose GEMMs are compute-bound (``--verify-cost``).

:func:`roofline_speedup` prices the steps with a step-time model (:class:`StepTimer`): the
roofline by default, or a calibrated ``planner.step_model`` (floor + fitted overhead, e.g. from
``roofline bench calibrate`` or the engine's own start-up graph timings). A verification step
is priced as what the engine runs (:func:`verify_shape`): ``b (1 + k)`` decode rows through
every GEMM and the LM head, each request's KV read once for its ``1 + k`` rows (CUDA graphs,
not the eager prefill path). The engine's speculative steps are synchronous: their host work
(``spec_host_s``) adds to the step, where an async plain step hides it. The context matters:
at 1024 tokens a batch of 128 reads 17 GB of KV per plain step (8B), which dilutes the
verification's extra compute; at 100 tokens it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from roofline.config import ModelConfig
from roofline.planner.calibration import RooflineStepTimer, StepShape, StepTimer
from roofline.planner.hardware import GPUSpec
from roofline.planner.roofline import BF16, Precision


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


def speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Wall-time speedup over plain decoding when a draft step costs ``cost_ratio`` target
    steps and verifying ``k + 1`` tokens costs ``verify_cost`` target steps (1: a memory-bound
    target; measured, or :func:`roofline_speedup`'s, at larger batches)."""
    if cost_ratio < 0:
        raise ValueError("cost_ratio must be >= 0")
    if verify_cost <= 0:
        raise ValueError("verify_cost must be > 0")
    return expected_tokens_per_step(alpha, k) / (verify_cost + k * cost_ratio)


def verify_shape(batch_size: int, k: int, context_len: int) -> StepShape:
    """A verification step as the step models price it: ``b (1 + k)`` decode rows over
    ``context_len`` tokens each, the ``1 + k`` rows of a request reading its KV once."""
    q = k + 1
    return StepShape(
        num_decode_tokens=batch_size * q,
        decode_context_len_sum=batch_size * q * context_len,
        decode_shared_tokens=batch_size * k * context_len,
    )


def plain_shape(batch_size: int, context_len: int) -> StepShape:
    return StepShape(batch_size, batch_size * context_len)


@dataclass(frozen=True)
class DraftChoice:
    best_k: int
    best_speedup: float
    curve: list[tuple[int, float, float]]
    """(k, expected tokens per step, speedup) for k = 0 .. max_k."""

    def near_optimal(self, tolerance: float = 0.02) -> list[int]:
        """Draft lengths within ``tolerance`` (relative) of the best speedup."""
        return [k for k, _, s in self.curve if s >= self.best_speedup * (1.0 - tolerance)]


def optimal_draft_length(
    alpha: float, cost_ratio: float, max_k: int = 32, verify_cost: float = 1.0
) -> DraftChoice:
    """The best k; ``verify_cost`` (a fixed verification cost in target steps) applies to
    every k >= 1."""
    curve = [
        (k, expected_tokens_per_step(alpha, k),
         speedup(alpha, k, cost_ratio, verify_cost if k else 1.0))
        for k in range(max_k + 1)
    ]  # fmt: skip
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
    host_s: float = 0.0
    """Host time a synchronous speculative step adds (``spec_host_s``)."""

    @property
    def cost_ratio(self) -> float:
        return self.draft_step_s / self.target_step_s

    @property
    def verify_cost(self) -> float:
        """The verification step (with its host time) in target steps."""
        return (self.verify_step_s + self.host_s) / self.target_step_s


def roofline_speedup(
    target: ModelConfig,
    draft: ModelConfig | None,
    gpu: GPUSpec,
    alpha: float,
    k: int,
    batch_size: int = 1,
    context_len: int = 1024,
    precision: Precision = BF16,
    timer: StepTimer | None = None,
    spec_host_s: float = 0.0,
) -> RooflineSpecDec:
    """Speedup with step times from a step model (``timer``; default the roofline of
    ``target`` on ``gpu``): ``k`` draft decode steps (their roofline; ``draft`` None: free
    proposals, n-gram) plus one target step verifying ``k + 1`` tokens per sequence
    (:func:`verify_shape`) and ``spec_host_s`` of host time, against one plain decode step."""
    b, ctx = batch_size, context_len
    timer = timer or RooflineStepTimer(target, gpu, precision)
    plain = timer(plain_shape(b, ctx))
    draft_step = 0.0
    if draft is not None:
        draft_step = RooflineStepTimer(draft, gpu, precision)(plain_shape(b, ctx))
    verify = timer(verify_shape(b, k, ctx))
    tokens = expected_tokens_per_step(alpha, k)
    return RooflineSpecDec(
        k=k,
        expected_tokens=tokens,
        target_step_s=plain,
        draft_step_s=draft_step,
        verify_step_s=verify,
        speedup=tokens * plain / (k * draft_step + verify + spec_host_s),
        host_s=spec_host_s,
    )
