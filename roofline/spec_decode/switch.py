"""The measured adaptive switch: speculate at a batch size only while it is measured to pay.

At start-up (CUDA with graphs) :func:`calibrate` captures the verification graphs of the
target (and of a draft model's catch-up rounds), then times, per batch bucket ``b``, a
graph-replayed plain decode step plus its LM head and a graph-replayed ``b x (1 + k)``-row
verification step plus its LM head, plus the draft's ``k`` rounds when a draft model proposes.
That gives the prior ``gain(b) = E[tokens | alpha, k] x t_plain(b) / t_spec(b)``.

Online, :class:`MeasuredSwitch` keeps, per bucket and mode (speculating or not), an average of
the wall seconds per emitted token of the engine's steps (host work included: speculative
steps run their host work between device steps), and the acceptance rate of recent
verifications. Once both modes have been measured at a bucket the faster one runs; the other is
re-measured for a few steps every ``PROBE_PERIOD`` steps at that bucket (bounded cost: at most
``PROBE_STEPS / PROBE_PERIOD`` of the steps run the slower mode). Until then the prior decides,
at the measured acceptance rate. Batches above the largest verification graph do not speculate.
"""

from __future__ import annotations

import logging

import torch

from roofline.planner.specdec import expected_tokens_per_step

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 128
"""Largest batch with verification graphs (and so the largest that speculates by default)."""
PRIOR_MARGIN = 0.05
"""Predicted gain demanded beyond break-even before anything is measured."""
PROBE_PERIOD = 256
PROBE_STEPS = 4
EMA = 0.1
CALIBRATION_CONTEXT = 1024


class MeasuredSwitch:
    def __init__(
        self,
        k: int,
        t_plain: dict[int, float],
        t_spec: dict[int, float],
        alpha: float,
        fixed_alpha: bool = False,
    ) -> None:
        self.k = k
        self.t_plain, self.t_spec = t_plain, t_spec
        """Seconds per step of each bucket, from graph replays (the prior)."""
        self.buckets = sorted(t_spec)
        self.alpha = alpha
        """Acceptance rate: measured (moving average) unless ``fixed_alpha``."""
        self.fixed_alpha = fixed_alpha
        self.alpha_prior = alpha
        self.rate: dict[tuple[int, bool], float] = {}
        """(bucket, speculating) -> seconds per emitted token (moving average)."""
        self._steps: dict[int, int] = {}
        self._last_measured: dict[tuple[int, bool], int] = {}
        self._probe_left: dict[int, int] = {}
        self._last_mode: bool | None = None

    def reset(self) -> None:
        """Forget what was measured online (benchmarks: each run starts cold)."""
        self.alpha = self.alpha_prior
        self.rate.clear()
        self._steps.clear()
        self._last_measured.clear()
        self._probe_left.clear()
        self._last_mode = None

    def bucket(self, num_running: int) -> int | None:
        return next((b for b in self.buckets if b >= num_running), None)

    def predicted_gain(self, bucket: int, alpha: float | None = None) -> float:
        a = self.alpha if alpha is None else alpha
        tokens = expected_tokens_per_step(min(max(a, 0.0), 0.999), self.k)
        return tokens * self.t_plain[bucket] / self.t_spec[bucket]

    def choose(self, num_running: int) -> bool:
        """Whether the next step at ``num_running`` requests speculates."""
        b = self.bucket(num_running)
        if b is None or num_running == 0:
            return False
        step = self._steps[b] = self._steps.get(b, 0) + 1
        spec_rate, plain_rate = self.rate.get((b, True)), self.rate.get((b, False))
        if spec_rate is not None and plain_rate is not None:
            best = spec_rate < plain_rate
        elif spec_rate is not None:  # against the plain graph step: no host work, optimistic
            best = spec_rate < self.t_plain[b] / num_running
        else:
            best = self.predicted_gain(b) >= 1.0 + PRIOR_MARGIN
        seen = self._last_measured.get((b, not best))
        due = step == 2 * PROBE_STEPS if seen is None else step - seen > PROBE_PERIOD
        if due and not self._probe_left.get(b, 0):
            self._probe_left[b] = PROBE_STEPS + 1  # its first step is a transition
        left = self._probe_left.get(b, 0)
        if left:
            self._probe_left[b] = left - 1
            return not best
        return best

    def observe(self, speculated: bool, num_running: int, seconds: float, tokens: int) -> None:
        """One engine step: its mode, batch, wall seconds and tokens emitted."""
        b = self.bucket(num_running)
        transition = self._last_mode is not None and self._last_mode != speculated
        self._last_mode = speculated
        if b is None or tokens <= 0 or transition:
            return
        key = (b, speculated)
        per_token = seconds / tokens
        old = self.rate.get(key)
        self.rate[key] = per_token if old is None else (1 - EMA) * old + EMA * per_token
        self._last_measured[key] = self._steps.get(b, 0)

    def record_acceptance(self, num_accepted: int, num_rejected: int) -> None:
        """A step's verifications: proposals accepted, and verifications that hit a rejection.
        Under the i.i.d. model each accepted proposal is a success and each first rejection a
        failure (the proposals after it are never tried), so alpha is estimated by
        ``accepted / (accepted + rejections)``, not by accepted / proposed."""
        tried = num_accepted + num_rejected
        if self.fixed_alpha or tried == 0:
            return
        self.alpha = (1 - EMA) * self.alpha + EMA * (num_accepted / tried)

    def table(self) -> list[tuple[int, float, float, float]]:
        """(bucket, plain step s, speculative step s, predicted gain) per bucket."""
        return [(b, self.t_plain[b], self.t_spec[b], self.predicted_gain(b)) for b in self.buckets]


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
def calibrate(spec, runner, draft_runner=None) -> MeasuredSwitch | None:
    """Capture verification graphs on ``runner`` (and ``draft_runner``) and time them against
    the decode graphs; None when the runner has no decode graphs (CPU, enforce_eager)."""
    from roofline.spec_decode.verify_graph import time_decode_graph

    if runner.graphs is None or getattr(runner.backend, "name", "") != "triton":
        return None  # the grid needs the multi-query kernel (the torch backend reads host lists)
    k = spec.config.num_speculative_tokens
    q = k + 1
    max_batch = min(MAX_GRAPH_BATCH, runner.scheduler_config.max_num_seqs)
    if spec.config.disable_by_batch_size is not None:
        max_batch = min(max(spec.config.disable_by_batch_size, 1), max_batch)
    runner.capture_verify_graphs(q, max_batch)
    if draft_runner is not None and draft_runner.graphs is not None:
        draft_runner.capture_verify_graphs(q, max_batch)
    ctx = min(CALIBRATION_CONTEXT, runner.scheduler_config.max_model_len - q - 1)
    vg = runner.verify_graphs
    t_plain: dict[int, float] = {}
    t_spec: dict[int, float] = {}
    for b in vg.buckets:
        if b not in runner.graphs.graphs:
            continue
        plain = time_decode_graph(runner.graphs, b, ctx) + _head_seconds(runner, b)
        spec_s = vg.time_replays(b, ctx) + _head_seconds(runner, b * q)
        if draft_runner is not None and draft_runner.verify_graphs is not None:
            dg = draft_runner.verify_graphs
            spec_s += dg.time_replays(b, ctx) + _head_seconds(draft_runner, b)
            if b in draft_runner.graphs.graphs:
                one = time_decode_graph(draft_runner.graphs, b, ctx) + _head_seconds(
                    draft_runner, b
                )
                spec_s += (k - 1) * one
        t_plain[b], t_spec[b] = plain, spec_s
    torch.cuda.synchronize(runner.device)
    switch = MeasuredSwitch(k, t_plain, t_spec, spec.alpha_prior)
    for b, tp, ts, gain in switch.table():
        logger.info(
            "spec decode b=%d: plain %.3f ms, speculative %.3f ms, predicted gain %.2fx",
            b, 1e3 * tp, 1e3 * ts, gain,
        )  # fmt: skip
    return switch
