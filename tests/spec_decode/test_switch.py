"""The adaptive switch against simulated step costs and acceptance streams: it turns on at batch
1 with high acceptance, off at a large batch or with low acceptance (even when the start-up
prior is wrong), keeps what pays per request, does not flap near break-even, and does nothing
per step while off. With shadow proposals (a proposer measured while off) it never speculates
where it does not pay and turns on from measured acceptance alone; step costs priced by context,
host residuals extrapolated per request, the cheapest graph bucket chosen."""

from __future__ import annotations

import random

from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.spec_decode.step_costs import HostCosts, StepCosts, cheapest_buckets
from roofline.spec_decode.switch import (
    DECAY,
    PRIOR_WEIGHT,
    PROBE_PERIOD,
    REEVALUATE_STEPS,
    SHADOW_REQUESTS,
    AdaptiveSwitch,
    expected_tokens,
)

K = 4
BUCKETS = (1, 8, 32, 128)
PRIOR_RATIO = {1: 1.05, 8: 1.1, 32: 1.2, 128: 2.0}
"""Graph-replay cost of a verification step in plain steps (the start-up prior)."""
TRANSITION_COST = 0.3
"""Plain steps lost when a speculative step drains the async one in flight."""


def _switch(alpha_prior: float) -> AdaptiveSwitch:
    return AdaptiveSwitch(K, {b: 1.0 for b in BUCKETS}, dict(PRIOR_RATIO), alpha_prior)


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2], SamplingParams(max_tokens=10**6)) for i in range(n)]


def _accepted(rng: random.Random, alpha: float) -> int:
    n = 0
    while n < K and rng.random() < alpha:
        n += 1
    return n


def simulate(switch, alphas, steps, true_ratio, seed=0):
    """Engine loop: (tokens per plain-step time relative to plain decoding, modes, proposals per
    request). ``alphas``: per request, a float or a function of the step."""
    rng = random.Random(seed)
    running = _requests(len(alphas))
    tokens = time = 0.0
    modes: list[bool] = [False]
    proposed = [0] * len(running)
    for step in range(steps):
        on = switch.choose(running)
        modes.append(on)
        if on:
            for i, r in enumerate(running):
                if switch.wants(r.request_id):
                    a = alphas[i](step) if callable(alphas[i]) else alphas[i]
                    got = _accepted(rng, a)
                    switch.record(r.request_id, got, K)
                    proposed[i] += 1
                    tokens += got + 1
                else:
                    tokens += 1
            cost = true_ratio
        else:
            tokens += len(running)
            cost = 1.0
        if on and not modes[-2]:  # the engine drains the async plain step: not observed
            time += cost + TRANSITION_COST
            continue
        time += cost
        switch.observe(on, len(running), cost * (1 + 0.02 * rng.random()))
    return tokens / time / len(running), modes[1:], proposed


def test_on_at_batch_1_with_high_acceptance():
    s = _switch(0.9)
    gain, modes, _ = simulate(s, [0.9], 512, true_ratio=1.25)
    forced = expected_tokens(0.9, K) / 1.25
    assert gain > 0.97 * forced > 3.0 and sum(modes) > 0.98 * len(modes)


def test_off_at_a_large_batch_even_when_the_prior_says_on():
    # the prior (2.0 x 1.1) predicts 1.26x at alpha 0.7; the real step costs 3.2 plain steps
    s = _switch(0.7)
    gain, modes, _ = simulate(s, [0.7] * 128, 96, true_ratio=3.2)
    assert gain >= 0.97 and not modes[-1]
    gain, modes, _ = simulate(_switch(0.5), [0.5] * 128, 96, true_ratio=2.6)
    assert gain >= 0.97  # prior near break-even: probes bounded to one short probe


def test_on_at_a_large_batch_when_acceptance_pays():
    gain, modes, _ = simulate(_switch(0.9), [0.9] * 128, 256, true_ratio=2.6)
    assert gain > 0.95 * expected_tokens(0.9, K) / 2.6 and modes[-1]


def test_low_measured_acceptance_turns_it_off_and_recovery_turns_it_back_on():
    # a prior of 0.7, but this request's proposals are all wrong for 600 steps, then right
    s = _switch(0.7)
    gain, modes, _ = simulate(s, [lambda t: 0.0 if t < 600 else 0.9], 1600, true_ratio=1.25)
    # off but for probes of 3 steps after 16, 32, 64, ... steps off (<= 4 between 100 and 600)
    assert sum(modes[100:600]) <= 3 * 4
    assert all(modes[600 + PROBE_PERIOD + 4 :])  # re-probed, back on for good


def test_requests_with_low_acceptance_stop_while_others_continue():
    s = _switch(0.6)
    alphas = [0.9] * 4 + [0.0] * 4
    _, modes, proposed = simulate(s, alphas, 1000, true_ratio=1.3)
    assert all(modes[20:])
    assert min(proposed[:4]) > 950
    assert max(proposed[4:]) < 1000 * 0.15  # stopped on its own trials, retried with backoff


def test_no_flapping_near_break_even():
    # acceptance right at break-even (tau(alpha) ~ ratio), noisy per step
    alpha = 0.34  # tau(0.34, 4) ~ 1.51
    s = _switch(alpha)
    gain, modes, _ = simulate(s, [alpha] * 8, 4000, true_ratio=1.5, seed=3)
    # a probe (two changes) per period, and a few changes of mind
    assert s.num_switches <= 2 * (4000 // PROBE_PERIOD + 1) + 4 and gain > 0.97
    runs, start = [], 0
    for i in range(1, len(modes) + 1):
        if i == len(modes) or modes[i] != modes[start]:
            runs.append(i - start)
            start = i
    assert sum(r < 3 for r in runs) <= 2  # no mode lasts less than a probe


class _CountingList(list):
    iterations = 0

    def __iter__(self):
        type(self).iterations += 1
        return super().__iter__()


def test_nothing_per_step_while_off():
    s = _switch(0.3)
    running = _CountingList(_requests(128))
    modes = []
    for _ in range(640):
        on = s.choose(running)
        modes.append(on)
        s.observe(on, 128, 2.6 if on else 1.0)
    assert not any(modes[64:])
    assert _CountingList.iterations <= 640 // REEVALUATE_STEPS + 4


def test_expected_tokens_is_the_planners():
    from roofline.planner.specdec import expected_tokens_per_step

    for alpha in (0.0, 0.3, 0.9, 0.99):
        assert abs(expected_tokens(alpha, K) - expected_tokens_per_step(alpha, K)) < 1e-12


def test_acceptance_estimate_counts_first_rejections_only():
    s = _switch(0.5)
    for _ in range(200):  # per verification: 2 accepted, then a rejection (k = 4)
        s.record("a", 2, K)
    # 2 / 3: two successes per failure (2 / 4 would count the proposals never tried)
    assert abs(s.alpha("a") - 2 / 3) < 1e-3 and abs(s.pooled_alpha() - 2 / 3) < 5e-3
    assert s.alpha("new") == s.pooled_alpha()  # a new request starts from the pool
    for _ in range(3):
        s.record("b", 0, K)
    # shrunk towards the pool: three failures do not make it zero
    successes, failures = 0.0, 1 + DECAY + DECAY**2
    want = (successes + PRIOR_WEIGHT * s.pooled_alpha()) / (failures + PRIOR_WEIGHT)
    assert abs(s.alpha("b") - want) < 1e-9 and 0.2 < want < 0.45
    s.forget(["a"])
    assert "a" not in s.requests


def test_reset_forgets_online_state():
    s = _switch(0.9)
    simulate(s, [0.1], 300, true_ratio=1.25)
    s.reset()
    assert not s.host[True].measured and not s.host[False].measured
    assert not s.requests and s.num_switches == 0 and s.step == 0


def test_requests_that_rarely_propose_count_for_what_they_propose():
    # n-gram at batch 32: every proposal is accepted, but only one request in four has a match
    s = _switch(0.6)
    running = _requests(32)
    for _ in range(200):
        on = s.choose(running)
        if on:
            for i, r in enumerate(running):
                n = K if i % 4 == 0 else 0
                s.proposed(r.request_id, n, K)
                s.record(r.request_id, n, n)
        s.observe(on, 32, 1.9 if on else 1.0)
    # tokens per request per step: 1 + 4 / 4 = 2 against a cost ratio of 1.9 -> ~1.05:
    # all proposals accepted, yet speculation barely pays; the prediction knows it
    assert abs(s.predicted_gain(running, 32) - 2 / 1.9) < 0.1


def simulate_shadows(switch, alpha, batch, steps, true_ratio, seed=0):
    """Like ``simulate`` for one acceptance, with shadow proposals while off: every due step
    the first ``SHADOW_REQUESTS`` requests are decided ``K + 1`` steps later (their tokens)."""
    rng = random.Random(seed)
    running = _requests(batch)
    tokens = time = 0.0
    pending: list[tuple[int, str, int]] = []
    modes: list[bool] = [False]
    for step in range(steps):
        for _due, rid, got in [p for p in pending if p[0] <= step]:
            switch.record(rid, got, K)
            switch.num_shadowed += 1
        pending = [p for p in pending if p[0] > step]
        on = switch.choose(running)
        modes.append(on)
        if not on and switch.shadow_due():
            for r in running[:SHADOW_REQUESTS]:
                pending.append((step + K + 1, r.request_id, _accepted(rng, alpha)))
        if on:
            got = [_accepted(rng, alpha) for _ in running]
            for r, g in zip(running, got):
                switch.record(r.request_id, g, K)
            tokens += sum(got) + batch
            cost = true_ratio
        else:
            tokens += batch
            cost = 1.0
        time += cost + (TRANSITION_COST if on != modes[-2] else 0.0)
        if on == modes[-2]:
            switch.observe(on, batch, cost * (1 + 0.02 * rng.random()))
    return tokens / time / batch, modes[1:]


def _shadow_switch(alpha_prior: float, ratio_128: float) -> AdaptiveSwitch:
    spec = {**PRIOR_RATIO, 128: ratio_128}
    return AdaptiveSwitch(K, {b: 1.0 for b in BUCKETS}, spec, alpha_prior, (0.0, 0.0), True)


def test_shadows_keep_speculation_off_where_it_does_not_pay():
    # batch 128, the cost right (2.8 plain steps), the prior acceptance 0.6: never speculates
    s = _shadow_switch(0.6, 2.8)
    gain, modes = simulate_shadows(s, 0.5, 128, 400, true_ratio=2.8)
    assert not any(modes) and gain == 1.0 and s.num_shadowed > 1000
    # near break-even (tau(0.7) = 2.77): the speculative cost is measured, rarely
    s = _shadow_switch(0.6, 2.8)
    gain, modes = simulate_shadows(s, 0.7, 128, 600, true_ratio=2.8)
    assert not any(modes[:PROBE_PERIOD]) and sum(modes) <= 3 * (600 // PROBE_PERIOD)
    assert gain > 0.99


def test_shadows_turn_speculation_on_from_measured_acceptance():
    s = _shadow_switch(0.6, 2.8)
    gain, modes = simulate_shadows(s, 0.9, 128, 200, true_ratio=2.8)
    assert modes.index(True) <= 2 * REEVALUATE_STEPS and all(modes[40:])
    assert gain > 0.9 * expected_tokens(0.9, K) / 2.8
    # batch 1 with a low prior: shadows find 0.8 acceptance, speculation turns on
    s = AdaptiveSwitch(K, {1: 1.0}, {1: 1.1}, 0.1, (0.0, 0.0), True)
    gain, modes = simulate_shadows(s, 0.8, 1, 300, true_ratio=1.1)
    assert all(modes[60:]) and gain > 0.9 * expected_tokens(0.8, K) / 1.1


def test_step_costs_by_context_and_host_per_request():
    short = {1: 5.0, 128: 15.0}  # ms at context 128: verification grid compute-bound
    long = {1: 5.5, 128: 21.0}  # at 1024
    plain = StepCosts.from_contexts({1: 4.0, 128: 6.0}, {1: 4.5, 128: 12.0}, 128, 1024)
    spec = StepCosts.from_contexts(short, long, 128, 1024)
    assert abs(spec.seconds(128, 128) - 15.0) < 1e-9 and abs(spec.seconds(128, 1024) - 21) < 1e-9
    s = AdaptiveSwitch(K, plain, spec, 0.6, (0.5, 0.01))
    s.context_len = 128
    r_short = s.ratio(128)
    assert abs(r_short - (15.0 + 0.5 + 1.28) / 6.0) < 1e-9
    s.context_len = 1024
    assert s.ratio(128) < r_short  # a long context's KV read dilutes the grid's compute
    # a measured bucket's residual corrects the per-request host cost of the others
    s.context_len = 128
    s._transition = False
    for _ in range(12):
        s.observe(True, 8, spec.seconds(8, 128) if 8 in spec.base_s else 0)
    host = HostCosts(0.5, 0.01)
    for step in range(12):
        host.observe(32, 0.5 + 0.03 * 32, step)  # measured 3x the prior per request
    assert abs(host.seconds(32) - (0.5 + 0.03 * 32)) < 1e-6
    assert host.prior(128) > 0.5 + 0.02 * 128  # extrapolated towards 0.03 per request


def test_cheapest_bucket_replays_each_batch():
    seconds = {64: 12.8, 80: 16.8, 96: 15.5, 112: 22.1, 128: 20.2}
    got = cheapest_buckets(list(seconds), seconds)
    assert got == {64: 64, 80: 96, 96: 96, 112: 128, 128: 128}


def test_shadows_decide_a_cold_start_near_break_even():
    # the prior acceptance (0.6) predicts 1.15x at batch 128 (ratio 2.0), the truth is 0.4:
    # a shadowing proposer waits for its shadows instead of speculating on the prior
    s = _shadow_switch(0.6, 2.0)
    assert abs(expected_tokens(0.6, K) / 2.0 - 1.155) < 0.01
    gain, modes = simulate_shadows(s, 0.4, 128, 300, true_ratio=2.0)
    assert not any(modes[:PROBE_PERIOD]) and gain > 0.99  # then one cost probe (gain 0.82)
    # a clear prior gain (batch 1) turns it on at once
    s = AdaptiveSwitch(K, {1: 1.0}, {1: 1.1}, 0.6, (0.0, 0.0), True)
    assert s.choose(_requests(1))


def test_near_break_even_a_large_batch_stays_off():
    # batch 128, a verification step at 2.7 plain steps, true acceptance 0.7 (tau 2.77: gain
    # 1.03), but the first shadow rounds measured 0.74 over 50 trials (one standard error
    # high): the point estimate (1.11x) would turn speculation on, its lower bound does not
    s = _shadow_switch(0.6, 2.7)
    s._pool = [38.1, 11.9]
    running = _requests(128)
    assert abs(s.pooled_alpha() - 0.74) < 0.005
    assert s.predicted_gain(running, 128) >= 1.08 and s.confidence() < 0.92
    assert not s.choose(running)
    # with 0.9 measured the same way it pays at the lower bound too
    s = _shadow_switch(0.6, 2.7)
    s._pool = [46.4, 3.6]  # 0.88 over 50 trials
    assert s.choose(running)
    # and the whole loop at the true 0.7 never speculates in its first period
    for seed in range(4):
        s = _shadow_switch(0.6, 2.7)
        gain, modes = simulate_shadows(s, 0.7, 128, PROBE_PERIOD, true_ratio=2.7, seed=seed)
        assert not any(modes)


def test_a_run_of_rejections_does_not_stop_batch_1():
    # alpha 0.46 at batch 1 (forced: tau / 1.18 = 1.54x): a few rejections in a row (an 8%
    # event per window) must not turn the only request, and so the step, off
    forced = expected_tokens(0.46, K) / 1.18
    gains = []
    for seed in range(50):
        s = AdaptiveSwitch(K, {1: 1.0}, {1: 1.18}, 0.6, (0.0, 0.0))
        gains.append(simulate(s, [0.46], 70, true_ratio=1.18, seed=seed)[0])
    assert sum(gains) / len(gains) > 0.98 * forced
