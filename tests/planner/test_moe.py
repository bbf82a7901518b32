"""MoE in the planner: experts touched per batch, active parameters, step bytes."""

from __future__ import annotations

import pytest

from roofline.planner.memory import param_counts
from roofline.planner.models import resolve_model
from roofline.planner.moe import expected_experts_touched
from roofline.planner.roofline import linear_flops_per_token, step_cost, step_weight_bytes


def test_expected_experts_touched() -> None:
    assert expected_experts_touched(128, 8, 0) == 0.0
    assert expected_experts_touched(128, 8, 1) == pytest.approx(8.0)
    assert expected_experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert expected_experts_touched(128, 8, 128) == pytest.approx(128.0, abs=0.05)
    with pytest.raises(ValueError):
        expected_experts_touched(8, 9, 1)


def test_qwen3_30b_a3b_counts() -> None:
    m = resolve_model("qwen3-30b-a3b")
    assert param_counts(m).total == m.num_params()
    assert 30.4e9 < m.num_params() < 30.6e9 and 3.3e9 < m.num_active_params() < 3.4e9
    # a token runs 8 of 128 experts: 2 FLOPs per active block parameter
    active_linear = param_counts(m, 8).linear
    assert linear_flops_per_token(m) == pytest.approx(2 * active_linear)
    # batch 1 reads 8 experts per layer, a large batch nearly all 128
    one, big, full = (step_weight_bytes(m, num_tokens=n) for n in (1, 4096, None))
    unread = 48 * 120 * 3 * 2048 * 768 * 2  # 120 experts x 3 matrices, bf16, 48 layers
    assert one == pytest.approx(full - unread)
    assert one < big <= full and big == pytest.approx(full)
    b1, b8 = step_cost(m, None, 1, 512), step_cost(m, None, 8, 8 * 512)
    assert b1.weight_bytes == pytest.approx(one)
    assert b1.weight_bytes < b8.weight_bytes < full


def test_mixtral_counts() -> None:
    m = resolve_model("mixtral-8x7b")
    assert 46.6e9 < m.num_params() < 46.8e9 and 12.8e9 < m.num_active_params() < 13.0e9
    assert param_counts(m).total == m.num_params()


def test_moe_decode_crossover_is_where_the_table_turns_compute_bound() -> None:
    # MoE step bytes are not affine in the batch (the experts a batch touches saturate), so a
    # slope taken between batch 1 and 2 (8 -> 15.5 experts per layer) said decode never turns
    # compute-bound while larger batches do
    from roofline.planner.hardware import get_gpu
    from roofline.planner.latency import crossover_batch_size, decode_point

    m, gpu = resolve_model("qwen3-30b-a3b"), get_gpu("h100")
    b = crossover_batch_size(m, gpu, 1)
    assert b is not None
    below = decode_point(m, gpu, int(b), 1).cost
    above = decode_point(m, gpu, int(b) + 1, 1).cost
    assert below.bound == "memory" and above.bound == "compute"
    # a long context's KV still keeps it memory-bound at every batch
    assert crossover_batch_size(m, gpu, 8192) is None
    assert decode_point(m, gpu, 1 << 16, 8192).cost.bound == "memory"
