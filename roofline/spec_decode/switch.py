"""The adaptive switch: speculate per step and per request only where it is predicted to pay.

**Cost model** (``step_costs.py``). Per batch bucket ``b`` a speculative step costs ``rho(b) =
T_spec(b) / T_plain(b)`` plain steps, each ``T`` the device time of that step's graphs at the
batch's mean context (timed at start-up at two contexts, :func:`step_costs.calibrate`) plus the
host time it exposes: nothing for an async plain step until measured, ``fixed + per_request x
b`` for a synchronous speculative one (a prior, then measured). Each steady decode-only step's
wall time minus its device time updates that mode's host estimate at its bucket (and the
per-request correction of buckets not measured yet). Not measured: the first step of a mode (it
drains or defers the other mode's work) and steps with prefill chunks.

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

**Exploring while off.** A proposer whose proposals cost only host microseconds and no state
(n-gram, the oracle: ``shadows``) keeps being measured while speculation is off: every
``SHADOW_EVERY`` steps a few requests (``SpecDecoder.shadow``) are asked for proposals that no
step verifies, and the tokens the target then emits decide them exactly as a greedy
verification would (for a sampled request, a one-hot proposal is emitted with probability
``p(token)``, its acceptance probability: the same estimate). So the acceptance is known
without speculating, and speculation turns on as soon as it pays. A draft model's proposals
cost its forward passes: with it, speculation is re-probed instead (``PROBE_STEPS`` steps) when
the proposer's prior acceptance would pay at the measured cost, after 16, 32, ... up to
``PROBE_PERIOD`` steps off.

**The step.** Speculate when ``(b + sum(tau_r - 1)) / b / rho(b)`` over the requests that would
propose is above ``1 + ON_MARGIN`` at the pooled acceptance minus one standard error
(:meth:`AdaptiveSwitch.confidence`: a few dozen shadow trials at 0.74 must not turn a batch of
128 on where 0.70 breaks even), and above ``1 + OFF_MARGIN`` at the estimate once on
(hysteresis, no flapping).
While off, that O(batch) estimate is redone only every ``REEVALUATE_STEPS`` steps: a step
without speculation costs two dict lookups. The mode not running is measured (a probe of
``PROBE_STEPS`` steps) only where its cost decides: a predicted gain within ``UNCERTAIN`` of
break-even, its cost at that bucket never or long ago measured, once the running mode's is,
and at most once per ``PROBE_PERIOD`` steps at that bucket. Batches above the largest
verification graph do not speculate.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

from roofline.request import Request
from roofline.spec_decode.step_costs import (
    CONTEXTS,
    MIN_SAMPLES,
    SPEC_HOST_PER_REQUEST_S,
    SPEC_HOST_S,
    HostCosts,
    StepCosts,
)

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 128
"""Largest batch with verification graphs (and so the largest that speculates by default)."""
ON_MARGIN, OFF_MARGIN = 0.08, 0.0
"""Step hysteresis: predicted gain needed to turn speculation on, and to keep it on."""
REQ_MIN_GAIN = 0.1
"""A request keeps proposing while its proposals bring this many tokens per verification."""
REQ_MIN_TRIALS = 8.0
"""...judged on at least this many (decayed) trials of its own: a few rejections in a row at
batch 1 (5 at alpha 0.46: a 5% event) must not stop the only request, and so the step."""
DECAY = 0.97
PRIOR_WEIGHT = 4.0
"""Trials the pooled estimate is worth in a request's own (four rejections in a row at alpha 0.46,
an 8% event, must not stop the only request at batch 1)."""
POOL_PRIOR_WEIGHT = 8.0
"""Trials the proposer's prior acceptance is worth in the pooled estimate (one early rejection
at batch 1 must not turn speculation off)."""
POOL_DECAY = 0.9
BACKOFF_MIN, BACKOFF_MAX = 16, 512
REEVALUATE_STEPS = 16
PROBE_PERIOD = 256
PROBE_STEPS = 3
"""A probe's steps: its first is a transition (not measured), then MIN_SAMPLES measured."""
UNCERTAIN = 1.25
SHADOW_EVERY = 4
"""Steps between shadow proposals while off (proposers with ``shadows``)."""
SHADOW_REQUESTS = 16
"""Requests asked per shadow round (round robin over the running ones)."""
RESHADOW_ALPHA = 0.05
"""Pooled acceptance change (from shadows) that brings the next evaluation forward."""
MIN_EVIDENCE = 8.0
"""Pooled trials before which a shadowing proposer's prior acceptance turns speculation on only
for a gain of ``UNCERTAIN`` (near break-even, the shadows decide within a few steps)."""


def expected_tokens(alpha: float, k: int) -> float:
    """E[emitted tokens per verification] at i.i.d. acceptance ``alpha`` (accepted + 1): the
    planner's ``expected_tokens_per_step`` without its argument checks (per request per step)."""
    a = min(max(alpha, 0.0), 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def alpha_for_gain(gain: float, k: int) -> float:
    """The acceptance at which ``expected_tokens(alpha, k) - 1 == gain`` (bisection)."""
    lo, hi = 0.0, 0.999
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) - 1.0 < gain else (lo, mid)
    return (lo + hi) / 2


@dataclass
class _RequestState:
    successes: float = 0.0
    failures: float = 0.0
    off: bool = False
    retry_step: int = 0
    backoff: int = BACKOFF_MIN
    yield_: float = 1.0
    """Moving average of the share of the asked-for k it proposed (n-gram: no match, none)."""


def _costs(t: StepCosts | dict[int, float]) -> StepCosts:
    return t if isinstance(t, StepCosts) else StepCosts.constant(t)


class AdaptiveSwitch:
    def __init__(
        self,
        k: int,
        t_plain: StepCosts | dict[int, float],
        t_spec: StepCosts | dict[int, float],
        alpha_prior: float,
        spec_host: tuple[float, float] = (SPEC_HOST_S, SPEC_HOST_PER_REQUEST_S),
        shadows: bool = False,
    ) -> None:
        self.k = k
        self.t_plain, self.t_spec = _costs(t_plain), _costs(t_spec)
        """Device seconds per step of each bucket (graph replays at start-up)."""
        self.spec_host = spec_host
        """Prior (fixed, per request) host seconds of a synchronous speculative step."""
        self.shadows = shadows
        """The proposer is measured while off (module docstring)."""
        self.buckets = sorted(self.t_spec.base_s)
        largest = self.buckets[-1]
        self._bucket_of = [next(b for b in self.buckets if b >= n) for n in range(largest + 1)]
        """num_running -> its bucket (one list index per step)."""
        self.alpha_prior = alpha_prior
        self._alpha_stop = alpha_for_gain(REQ_MIN_GAIN, k)
        self._alpha_resume = alpha_for_gain(2 * REQ_MIN_GAIN, k)
        """A request stops proposing below the first acceptance, resumes above the second."""
        self.reset()

    def reset(self) -> None:
        """Forget everything measured online (benchmarks: each run starts cold)."""
        self.step = 0
        self.host = {False: HostCosts(0.0, 0.0), True: HostCosts(*self.spec_host)}
        """Per mode: host seconds beyond the device's (prior, then measured)."""
        self.context_len = float(CONTEXTS[0])
        """Mean context of the running requests at the last evaluation."""
        self.requests: dict[str, _RequestState] = {}
        self._pool = [0.0, 0.0]
        """Pooled (successes, failures) over every request, forgetting per step."""
        self._eval_alpha = self.alpha_prior
        """Pooled acceptance at the last evaluation."""
        self._last_shadow = -SHADOW_EVERY
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
        self.num_shadowed = 0
        """Shadow proposals decided (benchmarks)."""
        self._last_choice: bool | None = None

    # ------------------------------------------------------------------ cost model
    def bucket(self, num_running: int) -> int | None:
        return self._bucket_of[num_running] if 0 < num_running < len(self._bucket_of) else None

    def device_seconds(self, bucket: int, speculating: bool) -> float:
        return (self.t_spec if speculating else self.t_plain).seconds(bucket, self.context_len)

    def seconds(self, bucket: int, speculating: bool) -> float:
        """Seconds per step at ``bucket``: device time at the context plus host time."""
        host = self.host[speculating].seconds(bucket)
        return max(self.device_seconds(bucket, speculating) + host, 1e-9)

    def ratio(self, bucket: int) -> float:
        """rho: a speculative step's cost in plain steps."""
        return self.seconds(bucket, True) / self.seconds(bucket, False)

    def observe(self, speculated: bool, num_running: int, seconds: float | None) -> None:
        """The engine step just chosen: its mode, batch and wall seconds (None: not a steady
        decode step, e.g. it had prefill chunks)."""
        b = self.bucket(num_running)
        if b is None or seconds is None or self._transition or seconds <= 0:
            return
        residual = seconds - self.device_seconds(b, speculated)
        self.host[speculated].observe(b, residual, self.step)

    def _measured(self, bucket: int, speculating: bool) -> bool:
        return self.host[speculating].samples(bucket)[0] >= MIN_SAMPLES

    # ------------------------------------------------------------------ acceptance
    def pooled_alpha(self) -> float:
        s, f = self._pool
        return (s + POOL_PRIOR_WEIGHT * self.alpha_prior) / (s + f + POOL_PRIOR_WEIGHT)

    def confidence(self) -> float:
        """``tau`` at the pooled acceptance minus one standard error (of the pool's effective
        trials, its prior's included) over ``tau`` at the estimate: turning speculation on near
        break-even needs the gain to hold at a pessimistic acceptance."""
        s, f = self._pool
        a = self.pooled_alpha()
        se = math.sqrt(a * (1.0 - a) / (s + f + POOL_PRIOR_WEIGHT))
        return expected_tokens(max(a - se, 0.0), self.k) / expected_tokens(a, self.k)

    def decay_pool(self) -> None:
        self._pool[0] *= POOL_DECAY
        self._pool[1] *= POOL_DECAY

    def shadows_decided(self) -> None:
        """A shadow round was decided: re-evaluate at once (not after ``REEVALUATE_STEPS``)
        when the pooled acceptance moved by more than ``RESHADOW_ALPHA`` since the last
        evaluation, so measured acceptance turns speculation on without waiting."""
        self.decay_pool()
        if abs(self.pooled_alpha() - self._eval_alpha) > RESHADOW_ALPHA:
            self._next_eval.clear()

    def alpha(self, request_id: str) -> float:
        st = self.requests.get(request_id)
        pooled = self.pooled_alpha()
        if st is None:
            return pooled
        return (st.successes + PRIOR_WEIGHT * pooled) / (st.successes + st.failures + PRIOR_WEIGHT)

    def record(self, request_id: str, num_accepted: int, num_proposed: int) -> None:
        """One verification of ``request_id`` (or a shadow proposal decided by the emitted
        tokens); turns the request off (with backoff) or on. Once per request per step: its
        gain test compares alpha with the thresholds of ``REQ_MIN_GAIN`` (tau is monotone)."""
        if num_proposed <= 0:
            return
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = _RequestState()
        failed = num_accepted < num_proposed
        st.successes = DECAY * st.successes + num_accepted
        st.failures = DECAY * st.failures + failed
        pool = self._pool
        pool[0] += num_accepted
        pool[1] += failed
        pooled = (pool[0] + POOL_PRIOR_WEIGHT * self.alpha_prior) / (
            pool[0] + pool[1] + POOL_PRIOR_WEIGHT
        )
        a = (st.successes + PRIOR_WEIGHT * pooled) / (st.successes + st.failures + PRIOR_WEIGHT)
        if st.off and a >= self._alpha_resume:
            st.off, st.backoff = False, BACKOFF_MIN
        elif a < self._alpha_stop and st.successes + st.failures >= REQ_MIN_TRIALS:
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

    def shadow_due(self) -> bool:
        """Whether this (non-speculative) step asks a few requests for shadow proposals (every
        ``SHADOW_EVERY`` steps, the first round at once)."""
        return self.shadows and self.step - self._last_shadow >= SHADOW_EVERY

    def shadowed(self) -> None:
        """A shadow round was proposed this step."""
        self._last_shadow = self.step

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    # ------------------------------------------------------------------ the decision
    def predicted_gain(self, running: list[Request], bucket: int) -> float:
        """Tokens per second speculating over not, for the requests that would propose (and
        the running requests' mean context, which prices the steps)."""
        extra = 0.0
        context = 0
        pooled = self.pooled_alpha()
        k, step, everyone = self.k, self.step, self._all_propose
        tau_pooled = expected_tokens(pooled, k) - 1.0
        requests = self.requests
        for r in running:
            context += r.num_computed_tokens
            st = requests.get(r.request_id)
            if st is None:
                extra += tau_pooled
            elif everyone or not st.off or step >= st.retry_step:  # wants()
                a = (st.successes + PRIOR_WEIGHT * pooled) / (
                    st.successes + st.failures + PRIOR_WEIGHT
                )
                extra += st.yield_ * (expected_tokens(a, k) - 1.0)
        n = max(len(running), 1)
        if running:
            self.context_len = context / n
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
            self.decay_pool()
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
        self._eval_alpha = self.pooled_alpha()
        if last:
            on = gain >= 1.0 + OFF_MARGIN
        else:  # turning on: at the acceptance one standard error below the estimate
            margin = ON_MARGIN
            if self.shadows and sum(self._pool) < MIN_EVIDENCE:
                margin = UNCERTAIN - 1.0  # on the prior acceptance alone: only a clear gain
            on = gain * self.confidence() >= 1.0 + margin
        if self.trace is not None:
            self.trace.append((self.step, b, on, gain, self.ratio(b), self.pooled_alpha()))
        self._mode[b] = on
        if on:
            self._reprobe[b] = BACKOFF_MIN
        else:
            self._next_eval[b] = self.step + REEVALUATE_STEPS
            if last is not False:
                self._off_since[b] = self.step
        since = self.step - self._last_probe.get((b, not on), 0)  # none in the first period
        samples, at = self.host[not on].samples(b)
        stale = samples < MIN_SAMPLES or self.step - at > PROBE_PERIOD
        near = abs(math.log(gain)) < math.log(UNCERTAIN)
        # the running mode measured first, then the other
        probe = since > PROBE_PERIOD and near and stale and self._measured(b, on)
        if not on and not probe and not self.shadows:  # off on acceptance measured while on:
            wait = self._reprobe.get(b, BACKOFF_MIN)  # re-measure it after 16, 32, ... steps
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

    def table(self, context_len: float | None = None) -> list[tuple[int, float, float, float]]:
        """(bucket, plain step s, speculative step s, gain at the prior alpha) per bucket, at
        ``context_len`` (default: the current estimate), host priors included."""
        saved = self.context_len
        if context_len is not None:
            self.context_len = context_len
        tokens = expected_tokens(self.alpha_prior, self.k)
        rows = [(b, self.seconds(b, False), self.seconds(b, True),
                 tokens / self.ratio(b)) for b in self.buckets]  # fmt: skip
        self.context_len = saved
        return rows
