"""The adaptive switch: speculate per step and per request only where it is predicted to pay.

**Cost model.** Per batch bucket ``b`` (the decode graphs' buckets) a speculative step costs
``rho(b) = T_spec(b) / T_plain(b)`` plain steps. The prior comes from start-up graph replays
(:func:`calibrate`: a plain decode step + LM head against a ``b x (1 + k)`` verification grid +
its LM head, + the draft's rounds), scaled by a host factor per mode (speculative steps are
synchronous and expose host work that async plain steps hide: ``SPEC_HOST_PRIOR`` until
measured). Online, each mode's wall seconds per decode-only step at ``b`` replace the prior
once ``MIN_SAMPLES`` are in (the fastest of those first, then an EWMA whose samples are clipped
at ``OUTLIER`` x the estimate: a GC pause or a compile must not turn speculation off), and their
ratio to the prior updates that mode's host factor for buckets not measured yet. Not measured:
the first step of a mode (it drains or defers the other mode's work) and steps with prefill
chunks.

**Acceptance, per request.** Each request keeps a Beta estimate of its per-token acceptance
with exponential forgetting (``DECAY`` per verification): accepted proposals are successes, a
verification that hit a rejection one failure (the proposals after it were never tried). Its
prior, worth ``PRIOR_WEIGHT`` trials, is the pooled estimate over all requests (forgetting
``POOL_DECAY`` per step; its own prior the proposer's), so a request's few samples are shrunk
towards what the batch shows and only a request that keeps doing worse stops. Its expected
tokens per verification are ``tau = E[tokens | alpha, k]``. In a graph-replayed step the whole
``b x (1 + k)`` grid is paid once any request speculates, so a request's own proposals cost
only their LM-head rows and the proposing: it falls back to plain decoding when they bring
less than ``REQ_MIN_GAIN`` tokens per verification (``tau - 1``), is retried after a backoff
(16 steps, doubling to 512), and resumes above twice that (hysteresis). A request that often
proposes nothing (n-gram without a match) counts in the step's prediction by the share of
``k`` it proposes (a moving average), but keeps being asked (asking costs microseconds).

**The step.** Speculate when ``(b + sum(tau_r - 1)) / b / rho(b)`` over the requests that would
propose is above ``1 + ON_MARGIN`` (``1 + OFF_MARGIN`` once on: hysteresis, no flapping).
While off, that O(batch) estimate is redone only every ``REEVALUATE_STEPS`` steps: a step
without speculation costs two dict lookups. The mode not running is measured only near
break-even (a predicted gain within ``UNCERTAIN``), once the running one is, and at most
once per ``PROBE_PERIOD`` steps at that bucket (``PROBE_STEPS`` steps). While off,
speculation is re-probed if the proposer's prior acceptance would pay at the measured cost
(so the decision was the acceptance's), after 16, 32, ... up to ``PROBE_PERIOD`` steps:
acceptance measured on a few verifications, or requests whose content changed, get measured
again. Batches above the largest verification graph do not speculate.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from roofline.request import Request

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 128
"""Largest batch with verification graphs (and so the largest that speculates by default)."""
CALIBRATION_CONTEXT = 1024
SPEC_HOST_PRIOR = 1.1
"""Host factor of a synchronous speculative step over its graph replay, until measured."""
EMA = 0.25
"""Weight of a new step-time sample."""
MIN_SAMPLES = 2
OUTLIER = 1.5
ON_MARGIN, OFF_MARGIN = 0.08, 0.0
"""Step hysteresis: predicted gain needed to turn speculation on, and to keep it on."""
REQ_MIN_GAIN = 0.1
"""A request keeps proposing while its proposals bring this many tokens per verification."""
DECAY = 0.97
PRIOR_WEIGHT = 2.0
POOL_PRIOR_WEIGHT = 8.0
"""Trials the proposer's prior acceptance is worth in the pooled estimate (one early rejection
at batch 1 must not turn speculation off)."""
POOL_DECAY = 0.9
BACKOFF_MIN, BACKOFF_MAX = 16, 512
REEVALUATE_STEPS = 16
PROBE_PERIOD = 256
PROBE_STEPS = 3
"""A probe's steps: its first is a transition (not measured), then MIN_SAMPLES measured."""
UNCERTAIN = 1.5


def expected_tokens(alpha: float, k: int) -> float:
    """E[emitted tokens per verification] at i.i.d. acceptance ``alpha`` (accepted + 1): the
    planner's ``expected_tokens_per_step`` without its argument checks (per request per step)."""
    a = min(max(alpha, 0.0), 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class _RequestState:
    successes: float = 0.0
    failures: float = 0.0
    off: bool = False
    retry_step: int = 0
    backoff: int = BACKOFF_MIN
    yield_: float = 1.0
    """Moving average of the share of the asked-for k it proposed (n-gram: no match, none)."""


class AdaptiveSwitch:
    def __init__(
        self, k: int, t_plain: dict[int, float], t_spec: dict[int, float], alpha_prior: float
    ) -> None:
        self.k = k
        self.t_plain, self.t_spec = t_plain, t_spec
        """The prior: seconds per step of each bucket, from graph replays."""
        self.buckets = sorted(t_spec)
        largest = self.buckets[-1]
        self._bucket_of = [next(b for b in self.buckets if b >= n) for n in range(largest + 1)]
        """num_running -> its bucket (one list index per step)."""
        self.alpha_prior = alpha_prior
        self.reset()

    def reset(self) -> None:
        """Forget everything measured online (benchmarks: each run starts cold)."""
        self.step = 0
        self.online: dict[tuple[int, bool], tuple[float, int, int]] = {}
        """(bucket, speculating) -> (EWMA seconds per step, samples, step last measured)."""
        self.host_factor = {False: 1.0, True: SPEC_HOST_PRIOR}
        self.requests: dict[str, _RequestState] = {}
        self._pool = [0.0, 0.0]
        """Pooled (successes, failures) over every request, forgetting per step."""
        self._mode: dict[int, bool] = {}
        self._next_eval: dict[int, int] = {}
        self._off_since: dict[int, int] = {}
        self._reprobe: dict[int, int] = {}
        """bucket -> steps off before speculation is re-probed (doubles while it stays off)."""
        self._last_probe: dict[tuple[int, bool], int] = {}
        """(bucket, mode probed) -> step the probe started."""
        self._probe: tuple[int, bool, int] | None = None
        """(bucket, mode, steps left) of a probe in progress."""
        self._all_propose = False
        self._transition = False
        """This step's mode differs from the previous step's (its time is not steady)."""
        self.trace: list[tuple] | None = None
        """Benchmarks: set to a list to record (step, bucket, on, gain, rho, pooled alpha)."""
        self.num_switches = 0
        """Times the step mode changed (probes included): the flapping measure."""
        self.num_on_steps = 0
        self._last_choice: bool | None = None

    # ------------------------------------------------------------------ cost model
    def bucket(self, num_running: int) -> int | None:
        return self._bucket_of[num_running] if 0 < num_running < len(self._bucket_of) else None

    def seconds(self, bucket: int, speculating: bool) -> float:
        """Seconds per step at ``bucket``: measured online, else the prior x host factor."""
        got = self.online.get((bucket, speculating))
        if got is not None and got[1] >= MIN_SAMPLES:
            return got[0]
        prior = (self.t_spec if speculating else self.t_plain)[bucket]
        return prior * self.host_factor[speculating]

    def ratio(self, bucket: int) -> float:
        """rho: a speculative step's cost in plain steps."""
        return self.seconds(bucket, True) / self.seconds(bucket, False)

    def observe(self, speculated: bool, num_running: int, seconds: float | None) -> None:
        """The engine step just chosen: its mode, batch and wall seconds (None: not a steady
        decode step, e.g. it had prefill chunks)."""
        b = self.bucket(num_running)
        if b is None or seconds is None or self._transition or seconds <= 0:
            return
        key = (b, speculated)
        old = self.online.get(key)
        if old is None:
            got = (seconds, 1, self.step)
        elif old[1] < MIN_SAMPLES:  # the fastest of the first samples
            got = (min(old[0], seconds), old[1] + 1, self.step)
        else:
            clipped = min(seconds, OUTLIER * old[0])
            got = ((1 - EMA) * old[0] + EMA * clipped, old[1] + 1, self.step)
        self.online[key] = got
        if got[1] >= MIN_SAMPLES:
            prior = (self.t_spec if speculated else self.t_plain)[b]
            factor = self.host_factor[speculated]
            self.host_factor[speculated] = (1 - EMA) * factor + EMA * got[0] / prior

    # ------------------------------------------------------------------ acceptance
    def pooled_alpha(self) -> float:
        s, f = self._pool
        return (s + POOL_PRIOR_WEIGHT * self.alpha_prior) / (s + f + POOL_PRIOR_WEIGHT)

    def alpha(self, request_id: str) -> float:
        st = self.requests.get(request_id)
        pooled = self.pooled_alpha()
        if st is None:
            return pooled
        return (st.successes + PRIOR_WEIGHT * pooled) / (st.successes + st.failures + PRIOR_WEIGHT)

    def record(self, request_id: str, num_accepted: int, num_proposed: int) -> None:
        """One verification of ``request_id``; turns the request off (with backoff) or on."""
        if num_proposed <= 0:
            return
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = _RequestState()
        failed = num_accepted < num_proposed
        st.successes = DECAY * st.successes + num_accepted
        st.failures = DECAY * st.failures + failed
        self._pool[0] += num_accepted
        self._pool[1] += failed
        gain = expected_tokens(self.alpha(request_id), self.k) - 1.0
        if st.off and gain >= 2 * REQ_MIN_GAIN:
            st.off, st.backoff = False, BACKOFF_MIN
        elif gain < REQ_MIN_GAIN:
            if st.off:  # a retry that failed: wait longer
                st.backoff = min(2 * st.backoff, BACKOFF_MAX)
            st.off, st.retry_step = True, self.step + st.backoff
        elif st.off:
            st.retry_step = self.step + st.backoff

    def proposed(self, request_id: str, num_proposed: int, num_wanted: int) -> None:
        """What ``request_id`` proposed when asked for ``num_wanted`` tokens (the step's
        prediction counts a request that often proposes nothing accordingly)."""
        if num_wanted <= 0:
            return
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = _RequestState()
        st.yield_ = DECAY * st.yield_ + (1 - DECAY) * min(num_proposed / num_wanted, 1.0)

    def wants(self, request_id: str) -> bool:
        """Whether ``request_id`` proposes in this (speculative) step."""
        if self._all_propose:
            return True
        st = self.requests.get(request_id)
        return st is None or not st.off or self.step >= st.retry_step

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    # ------------------------------------------------------------------ the decision
    def predicted_gain(self, running: list[Request], bucket: int) -> float:
        """Tokens per second speculating over not, for the requests that would propose."""
        extra = 0.0
        for r in running:
            rid = r.request_id
            if self.wants(rid):
                st = self.requests.get(rid)
                share = 1.0 if st is None else st.yield_
                extra += share * (expected_tokens(self.alpha(rid), self.k) - 1.0)
        n = max(len(running), 1)
        return (n + extra) / n / self.ratio(bucket)

    def choose(self, running: list[Request]) -> bool:
        """Whether the next step (over ``running``) speculates."""
        on = self._choose(running)
        self.num_on_steps += on
        self._transition = self._last_choice is not None and on != self._last_choice
        self.num_switches += self._transition
        self._last_choice = on
        return on

    def _choose(self, running: list[Request]) -> bool:
        self.step += 1
        if self._last_choice:  # the pool forgets per speculative step
            self._pool[0] *= POOL_DECAY
            self._pool[1] *= POOL_DECAY
        self._all_propose = False
        b = self.bucket(len(running))
        if b is None:
            return False
        probe = self._probe
        if probe is not None:
            pb, mode, left = probe
            if pb == b:
                self._probe = (pb, mode, left - 1) if left > 1 else None
                self._all_propose = mode
                return mode
            self._probe = None  # the batch moved to another bucket
        last = self._mode.get(b)
        if last is False and self.step < self._next_eval.get(b, 0):
            return False  # off: nothing per step but this check
        gain = self.predicted_gain(running, b)
        on = gain >= 1.0 + (OFF_MARGIN if last else ON_MARGIN)
        if self.trace is not None:
            self.trace.append((self.step, b, on, gain, self.ratio(b), self.pooled_alpha()))
        self._mode[b] = on
        if on:
            self._reprobe[b] = BACKOFF_MIN
        else:
            self._next_eval[b] = self.step + REEVALUATE_STEPS
            if last is not False:
                self._off_since[b] = self.step
        since = self.step - self._last_probe.get((b, not on), -PROBE_PERIOD)
        other = self.online.get((b, not on))
        stale = other is None or other[1] < MIN_SAMPLES or self.step - other[2] > PROBE_PERIOD
        near = abs(math.log(gain)) < math.log(UNCERTAIN)
        mine = self.online.get((b, on))
        measured = mine is not None and mine[1] >= MIN_SAMPLES  # this mode first, then the other
        probe = since > PROBE_PERIOD and near and stale and measured
        if not on and not probe:  # off on acceptance measured while on: re-measure it,
            wait = self._reprobe.get(b, BACKOFF_MIN)  # after 16, 32, ... steps off
            idle = min(since, self.step - self._off_since[b])
            pays = expected_tokens(self.alpha_prior, self.k) / self.ratio(b) >= 1 + ON_MARGIN
            if pays and idle >= wait:
                probe = True
                self._reprobe[b] = min(2 * wait, PROBE_PERIOD)
        if probe:
            self._last_probe[(b, not on)] = self.step
            self._next_eval[b] = 0  # decide again as soon as the probe is over
            self._probe = (b, not on, PROBE_STEPS - 1)
            self._all_propose = not on
            return not on
        return on

    def table(self) -> list[tuple[int, float, float, float]]:
        """(bucket, plain step s, speculative step s, gain at the prior alpha) per bucket."""
        tokens = expected_tokens(self.alpha_prior, self.k)
        return [(b, self.t_plain[b], self.t_spec[b], tokens * self.t_plain[b] / self.t_spec[b])
                for b in self.buckets]  # fmt: skip


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
def calibrate(spec, runner, draft_runner=None) -> AdaptiveSwitch | None:
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
    if not t_spec:
        return None
    switch = AdaptiveSwitch(k, t_plain, t_spec, spec.alpha_prior)
    for b, tp, ts, gain in switch.table():
        logger.info(
            "spec decode b=%d: plain %.3f ms, speculative %.3f ms, predicted gain %.2fx",
            b, 1e3 * tp, 1e3 * ts, gain,
        )  # fmt: skip
    return switch
