"""The measured adaptive switch: the prior from graph step times and the acceptance rate, then
online seconds per token per mode, with bounded probing of the other mode."""

from __future__ import annotations

from roofline.spec_decode.switch import PROBE_PERIOD, PROBE_STEPS, MeasuredSwitch


def _switch(alpha: float = 0.9) -> MeasuredSwitch:
    # batch 1: verification costs 1.1 plain steps; batch 8: 6 (compute-bound, say)
    return MeasuredSwitch(4, {1: 1.0, 8: 1.0}, {1: 1.1, 8: 6.0}, alpha)


def test_prior_decides_until_measured():
    s = _switch()
    assert s.choose(1) and not s.choose(5) and not s.choose(9)  # 9: no graph bucket
    assert s.predicted_gain(1) > 3.5 and s.predicted_gain(8) < 1.0


def test_low_measured_acceptance_turns_it_off():
    s = _switch(alpha=0.6)
    assert s.choose(1)
    for _ in range(40):
        s.record_acceptance(0, 1)  # the first proposal rejected
    assert s.alpha < 0.01 and s.predicted_gain(1) < 1.0
    assert not s.choose(1)


def test_online_rates_override_the_prior_and_probing_is_bounded():
    s = _switch()
    modes = []
    for _ in range(4 * PROBE_PERIOD):
        spec = s.choose(1)
        modes.append(spec)
        # measured: speculation is slower per token than the prior thought
        s.observe(spec, 1, 3.0 if spec else 1.0, 1)
    late = modes[2 * PROBE_PERIOD :]
    assert not late[-1]
    assert sum(late) <= 2 * (PROBE_STEPS + 1) + 1  # only probes, once per period
    assert s.rate[(1, True)] > s.rate[(1, False)]


def test_acceptance_estimate_counts_first_rejections_only():
    s = _switch(alpha=0.5)
    for _ in range(200):  # per verification: 2 accepted, then a rejection (k = 4)
        s.record_acceptance(2, 1)
    assert abs(s.alpha - 2 / 3) < 1e-3


def test_reset_forgets_online_state():
    s = _switch()
    s.observe(True, 1, 1.0, 1)
    s.observe(True, 1, 1.0, 1)
    s.record_acceptance(0, 1)
    s.reset()
    assert not s.rate and s.alpha == 0.9
