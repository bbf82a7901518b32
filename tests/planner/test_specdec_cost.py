"""Speculative decoding arithmetic, cost per token and batching waste."""

from __future__ import annotations

import pytest

from roofline.planner.cost import (
    continuous_batching_waste,
    cost_per_million_tokens,
    static_batching_waste,
)
from roofline.planner.hardware import get_gpu
from roofline.planner.models import resolve_model
from roofline.planner.specdec import (
    acceptance_rate_from_tokens_per_step,
    expected_tokens_per_step,
    optimal_draft_length,
    roofline_speedup,
    speedup,
)
from roofline.planner.workload import LengthDist


def test_expected_tokens_literature():
    assert expected_tokens_per_step(0.8, 5) == pytest.approx((1 - 0.8**6) / 0.2)
    assert expected_tokens_per_step(0.8, 5) == pytest.approx(3.69, abs=0.005)
    assert expected_tokens_per_step(1.0, 4) == 5
    assert expected_tokens_per_step(0.0, 4) == 1
    # the linear rule of thumb 1 + k alpha over-counts: acceptance stops at the first reject
    assert 1 + 5 * 0.8 > expected_tokens_per_step(0.8, 5)


def test_optimal_draft_length_literature():
    choice = optimal_draft_length(alpha=0.8, cost_ratio=0.05)
    assert choice.best_k == 8
    assert choice.best_speedup == pytest.approx(speedup(0.8, 8, 0.05))
    assert choice.near_optimal(0.02) == [6, 7, 8, 9, 10]


def test_acceptance_rate_inverse():
    for alpha in (0.3, 0.6, 0.9):
        tokens = expected_tokens_per_step(alpha, 4)
        assert acceptance_rate_from_tokens_per_step(tokens, 4) == pytest.approx(alpha, abs=1e-9)


def test_roofline_speedup_fades_with_batch():
    target, draft = resolve_model("qwen3-8b"), resolve_model("qwen3-0.6b")
    gpu = get_gpu("h100")
    small = roofline_speedup(target, draft, gpu, 0.8, 4, batch_size=1)
    big = roofline_speedup(target, draft, gpu, 0.8, 4, batch_size=512)
    assert small.speedup > 2.0
    assert big.speedup < small.speedup
    # at batch 1 verifying 5 tokens costs about one decode step (memory-bound)
    assert small.verify_step_s == pytest.approx(small.target_step_s, rel=0.02)


def test_cost_per_million_tokens():
    assert cost_per_million_tokens(2.0, 1000.0) == pytest.approx(2.0 / 3600 / 1000 * 1e6)
    assert cost_per_million_tokens(2.0, 1000.0, num_gpus=4) == pytest.approx(4 * 0.5555556)


def test_batching_waste():
    static = static_batching_waste([1, 10], 2)
    assert (static.num_steps, static.useful_slot_steps, static.total_slot_steps) == (10, 11, 20)
    assert static.waste_fraction == pytest.approx(0.45)
    cont = continuous_batching_waste([10, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2)
    assert cont.num_steps == 10 and cont.waste_fraction == pytest.approx(1 - 19 / 20)
    lengths = LengthDist.parse("lognormal:256:256").samples(1000, seed=1)
    s, c = static_batching_waste(lengths, 32), continuous_batching_waste(lengths, 32)
    assert c.waste_fraction < 0.2 < 0.6 < s.waste_fraction
    assert c.num_steps < s.num_steps
    fixed = [100] * 64
    assert static_batching_waste(fixed, 32).waste_fraction == 0.0


def test_length_dists():
    assert LengthDist.parse("128").samples(3) == [128, 128, 128]
    u = LengthDist.parse("uniform:10:20").samples(500, seed=3)
    assert min(u) >= 10 and max(u) <= 20
    ln = LengthDist.parse("lognormal:500:200").samples(20000, seed=3)
    assert sum(ln) / len(ln) == pytest.approx(500, rel=0.03)
    with pytest.raises(ValueError):
        LengthDist.parse("gamma:1:2")
