"""What a plain and a speculative step cost, per batch bucket: measured at start-up, priced by
context, corrected online for the host.

**Device time.** :func:`calibrate` captures the verification graphs and times them, and the
decode graphs, at every bucket at two contexts (``CONTEXTS``: the time of a step is its weight
and activation work plus a KV read that grows with the context, so two points give the line
``base + per_token x context``). A plain step is a decode graph replay plus the LM head of its
``b`` rows; a speculative step a ``b x (1 + k)`` verification grid plus the head of its rows
(and, with a draft model, its catch-up grid and ``k - 1`` decode steps). The grid's GEMMs run
``b (1 + k)`` rows: from a few dozen requests on they are compute-bound and the verification
costs up to ``1 + k`` plain steps, which is what makes speculation lose at large batches.

**Graph choice.** cuBLAS picks its kernels by the number of rows, and some row counts of the
grid run slower than a larger bucket's (measured on the H100: 560 rows slower than 640). Each
batch replays the cheapest captured bucket at least its size (:func:`cheapest_buckets`).

**Host time.** A plain step runs asynchronously: its host work hides behind the device's. A
speculative step is synchronous (its proposals need every token on the host), so its host work
(proposing, scheduling ``1 + k`` tokens per request, staging the grid, folding the accepted
runs) adds to the device time. :class:`HostCosts` prices it ``fixed + per_request x b``: a
prior (``SPEC_HOST_S``, ``SPEC_HOST_PER_REQUEST_S``, from the H100 runs of
``scripts/gpu_specdec.py``) until steps are measured; each measured step's residual (wall time
minus the device time at its context) then updates its bucket, and the per-request correction
of buckets not measured yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

CONTEXTS = (128, 1024)
"""Context lengths (tokens per request) the graphs are timed at."""
SPEC_HOST_S = 0.6e-3
"""Prior: host seconds a synchronous speculative step adds to its device time, per step...
(H100 host, Llama-3.1-8B, oracle proposals, steady state: wall minus graph time 0.8 / 1.0 /
1.6 / 6.2-6.7 ms at batch 1 / 8 / 32 / 128)"""
SPEC_HOST_PER_REQUEST_S = 45e-6
"""...and per running request."""
EMA = 0.25
"""Weight of a new residual sample."""
MIN_SAMPLES = 2
OUTLIER_S = 2e-3
"""A residual sample above the estimate by more than this is clipped (GC pauses, compiles)."""


@dataclass
class StepCosts:
    """Device seconds of one step per bucket: ``base_s[b] + per_token_s[b] x context``."""

    base_s: dict[int, float]
    per_token_s: dict[int, float] = field(default_factory=dict)

    @classmethod
    def constant(cls, seconds: dict[int, float]) -> StepCosts:
        return cls(dict(seconds), {b: 0.0 for b in seconds})

    @classmethod
    def from_contexts(
        cls, short: dict[int, float], long: dict[int, float], c0: int, c1: int
    ) -> StepCosts:
        """From times at contexts ``c0 < c1`` (a negative slope is noise: 0)."""
        slope = {b: max((long[b] - short[b]) / (c1 - c0), 0.0) for b in short}
        return cls({b: short[b] - slope[b] * c0 for b in short}, slope)

    def seconds(self, bucket: int, context_len: float) -> float:
        return self.base_s[bucket] + self.per_token_s.get(bucket, 0.0) * context_len


class HostCosts:
    """Exposed host seconds of one mode's step beyond its device time (module docstring)."""

    def __init__(self, fixed_s: float, per_request_s: float) -> None:
        self.fixed_s, self.per_request_s = fixed_s, per_request_s
        self.reset()

    def reset(self) -> None:
        self.measured: dict[int, tuple[float, int, int]] = {}
        """bucket -> (EWMA residual seconds, samples, step last measured)."""
        self.correction_s = 0.0
        """Per-request correction of the prior, from the measured buckets (EWMA)."""

    def prior(self, bucket: int) -> float:
        return self.fixed_s + (self.per_request_s + self.correction_s) * bucket

    def seconds(self, bucket: int) -> float:
        got = self.measured.get(bucket)
        if got is not None and got[1] >= MIN_SAMPLES:
            return got[0]
        return self.prior(bucket)

    def samples(self, bucket: int) -> tuple[int, int]:
        """(samples, step last measured) of ``bucket``."""
        got = self.measured.get(bucket)
        return (got[1], got[2]) if got is not None else (0, -(1 << 30))

    def observe(self, bucket: int, residual_s: float, step: int) -> None:
        old = self.measured.get(bucket)
        if old is None:
            got = (residual_s, 1, step)
        elif old[1] < MIN_SAMPLES:  # the smallest of the first samples
            got = (min(old[0], residual_s), old[1] + 1, step)
        else:
            clipped = min(residual_s, old[0] + OUTLIER_S)
            got = ((1 - EMA) * old[0] + EMA * clipped, old[1] + 1, step)
        self.measured[bucket] = got
        if got[1] >= MIN_SAMPLES:
            base = self.fixed_s + self.per_request_s * bucket
            self.correction_s = (1 - EMA) * self.correction_s + EMA * (got[0] - base) / bucket


def cheapest_buckets(buckets: list[int], seconds: dict[int, float]) -> dict[int, int]:
    """bucket -> the cheapest measured bucket at least as large (itself when none is cheaper)."""
    choice: dict[int, int] = {}
    best = None
    for b in sorted(buckets, reverse=True):
        if best is None or seconds[b] <= seconds[best]:
            best = b
        choice[b] = best
    return choice


@dataclass
class Calibration:
    plain: StepCosts
    spec: StepCosts
    table: list[tuple[int, int, float, float, float, float]]
    """(bucket, context, plain graph s, plain head s, grid s, grid head s) per timing."""
    replays: dict[int, int]
    """bucket -> the verification bucket it replays (:func:`cheapest_buckets`)."""

    def points(self, k: int) -> list:
        """The timings as ``planner.calibration.CalibrationPoint`` s (plain decode steps and
        verification grids, ``planner.specdec.verify_shape``): a step model fitted on them
        prices either step at any batch and context."""
        from roofline.planner.calibration import CalibrationPoint
        from roofline.planner.specdec import plain_shape, verify_shape

        out = []
        for b, ctx, plain, plain_head, grid, grid_head in self.table:
            out.append(CalibrationPoint.from_shape(plain_shape(b, ctx), plain + plain_head))
            out.append(CalibrationPoint.from_shape(verify_shape(b, k, ctx), grid + grid_head))
        return out


def _head_seconds(runner, rows: int, repeats: int = 3) -> float:
    hidden = torch.zeros(rows, runner.model_config.hidden_size, dtype=runner.dtype,
                         device=runner.device)  # fmt: skip
    runner.model.compute_logits(hidden)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        runner.model.compute_logits(hidden)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


@torch.inference_mode()
def calibrate(
    runner, k: int, max_batch: int, draft_runner=None, num_replays: int = 3
) -> Calibration | None:
    """Capture verification graphs on ``runner`` (and ``draft_runner``) up to ``max_batch``
    requests and time them against the decode graphs (module docstring); None when the runner
    has no decode graphs (CPU, enforce_eager) or a backend without the multi-query kernel."""
    from roofline.spec_decode.verify_graph import time_decode_graph

    if runner.graphs is None or getattr(runner.backend, "name", "") != "triton":
        return None  # the grid needs the multi-query kernel (the torch backend reads host lists)
    q = k + 1
    runner.capture_verify_graphs(q, max_batch)
    if draft_runner is not None and draft_runner.graphs is not None:
        draft_runner.capture_verify_graphs(q, max_batch)
    vg = runner.verify_graphs
    max_len = runner.scheduler_config.max_model_len
    buckets = [b for b in vg.buckets if b in runner.graphs.graphs]
    if not buckets:
        return None
    times: dict[int, dict[int, tuple[float, float]]] = {}  # ctx -> bucket -> (plain, spec)
    table = []
    contexts = sorted({max(min(c, max_len - q - 1), 1) for c in CONTEXTS})
    for ctx in contexts:
        times[ctx] = {}
        for b in buckets:
            plain = time_decode_graph(runner.graphs, b, ctx, num_replays)
            plain_head = _head_seconds(runner, b)
            grid = vg.time_replays(b, ctx, num_replays)
            grid_head = _head_seconds(runner, b * q)
            spec_s = grid + grid_head
            if draft_runner is not None and draft_runner.verify_graphs is not None:
                dg = draft_runner.verify_graphs
                spec_s += dg.time_replays(b, ctx, num_replays) + _head_seconds(draft_runner, b)
                if b in draft_runner.graphs.graphs:
                    one = time_decode_graph(draft_runner.graphs, b, ctx, num_replays)
                    spec_s += (k - 1) * (one + _head_seconds(draft_runner, b))
            times[ctx][b] = (plain + plain_head, spec_s)
            table.append((b, ctx, plain, plain_head, grid, grid_head))
    torch.cuda.synchronize(runner.device)
    short, long = times[contexts[0]], times[contexts[-1]]
    both = {b: short[b][1] + long[b][1] for b in buckets}
    replays = cheapest_buckets(buckets, both)
    vg.replay_bucket = replays
    plain_s = [{b: t[b][0] for b in buckets} for t in (short, long)]
    spec_s = [{b: t[replays[b]][1] for b in buckets} for t in (short, long)]
    if short is long:  # max_model_len too small for two contexts
        return Calibration(StepCosts.constant(plain_s[0]), StepCosts.constant(spec_s[0]), table,
                           replays)  # fmt: skip
    c0, c1 = contexts[0], contexts[-1]
    return Calibration(
        StepCosts.from_contexts(*plain_s, c0, c1),
        StepCosts.from_contexts(*spec_s, c0, c1),
        table,
        replays,
    )
