"""Workload presets of `roofline bench throughput` and the workload roofline: a prefix common to
every prompt is prefilled and read once per step, and tensor parallelism splits each step."""

from __future__ import annotations

import pytest

from roofline.bench import workloads
from roofline.bench.ceilings import Ceilings
from roofline.bench.throughput import workload_roofline_s
from roofline.planner.models import resolve_model
from roofline.planner.roofline import BF16, step_cost

H100_LIKE = Ceilings("test-gpu", 3.0e12, 7.0e14, "bfloat16")


def test_presets_have_their_documented_shapes():
    short = workloads.preset("short", 32000)
    assert short.num_requests == 1000
    assert all(20 <= len(p) <= 300 for p in short.prompts)
    assert all(20 <= n <= 300 for n in short.output_lens)
    shared = workloads.preset("shared-prefix", 32000)
    assert shared.num_requests == 256 and shared.shared_prefix_len == 2000
    head = shared.prompts[0][:2000]
    assert all(p[:2000] == head and len(p) == 2064 for p in shared.prompts)
    assert len({tuple(p[2000:]) for p in shared.prompts}) == 256  # own suffixes differ
    long = workloads.preset("long-prompt", 32000)
    assert [len(p) for p in long.prompts] == [8000] * 16 and set(long.output_lens) == {128}
    default = workloads.preset("default", 32000)
    assert default.num_requests == 256 and set(default.output_lens) == {512}
    assert set(workloads.PRESETS) == {"default", "short", "shared-prefix", "long-prompt"}


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown workload preset 'nope'"):
        workloads.preset("nope", 32000)
    with pytest.raises(ValueError, match="prefix_len"):
        workloads.shared_prefix(4, 0, (1, 2), (1, 2), 100)


def test_roofline_without_a_shared_prefix_is_every_prefill_plus_batched_decode():
    model = resolve_model("llama-3.1-8b")
    wl = workloads.Workload([[1] * 100, [1] * 300], [3, 2], "two")
    spec = H100_LIKE.as_gpu_spec()
    expect = sum(
        step_cost(model, spec, num_prefill_tokens=n, precision=BF16).compute_time_s
        for n in (100, 300)
    )
    # decode: both run (contexts 101, 301), then only the first (102)
    expect += step_cost(model, spec, decode_context_lens=[101, 301], precision=BF16).time_s
    expect += step_cost(model, spec, decode_context_lens=[102], precision=BF16).time_s
    got = workload_roofline_s(model, H100_LIKE, wl, BF16, max_num_seqs=8)
    assert got == pytest.approx(expect, rel=1e-12)


def test_shared_prefix_is_prefilled_and_read_once():
    model = resolve_model("llama-3.1-8b")
    wl = workloads.shared_prefix(64, 2000, (64, 64), (32, 32), 32000)
    plain = workloads.Workload(wl.prompts, wl.output_lens, "same prompts, nothing declared")
    shared_s = workload_roofline_s(model, H100_LIKE, wl, BF16, max_num_seqs=64)
    plain_s = workload_roofline_s(model, H100_LIKE, plain, BF16, max_num_seqs=64)
    assert shared_s < 0.5 * plain_s
    # the bound is still at least the weights once per decode step and the prefix once
    spec = H100_LIKE.as_gpu_spec()
    floor = 31 * step_cost(model, spec, decode_context_lens=[2100], precision=BF16).time_s
    floor += step_cost(model, spec, num_prefill_tokens=2064, precision=BF16).compute_time_s
    assert shared_s > floor


def test_shared_prefix_decode_step_reads_the_prefix_once_and_attends_it_per_request():
    """A decode step of the shared-prefix roofline: the prefix's KV bytes once, but its
    attention FLOPs for every request (each query still attends the whole prefix)."""
    model = resolve_model("llama-3.1-8b")
    wl = workloads.shared_prefix(3, 32, (4, 4), (2, 2), 32000)
    slow = Ceilings("compute-poor", 3.0e12, 1.0e12, "bfloat16")  # the decode step's FLOPs bind
    spec = slow.as_gpu_spec()
    expect = step_cost(model, spec, num_prefill_tokens=36, precision=BF16).compute_time_s
    expect += 2 * step_cost(model, spec, prefill_chunks=[(4, 32)], precision=BF16).compute_time_s
    step = step_cost(model, spec, decode_context_lens=[37] * 3, precision=BF16,
                     decode_shared_tokens=2 * 32)  # fmt: skip
    expect += step.time_s
    assert step.bound == "compute"
    got = workload_roofline_s(model, slow, wl, BF16, max_num_seqs=8)
    assert got == pytest.approx(expect, rel=1e-12)
    per_request = step_cost(model, spec, decode_context_lens=[37] * 3, precision=BF16)
    assert step.attention_flops == per_request.attention_flops
    assert step.kv_read_bytes < per_request.kv_read_bytes


def test_tensor_parallel_roofline_splits_the_step():
    model = resolve_model("llama-3.1-8b")
    wl = workloads.synthetic(8, (100, 200), (64, 64), 32000)
    tp1 = workload_roofline_s(model, H100_LIKE, wl, BF16, max_num_seqs=8)
    tp2 = workload_roofline_s(model, H100_LIKE, wl, BF16, max_num_seqs=8, tp=2)
    assert 0.5 * tp1 < tp2 < 0.75 * tp1  # half the bytes per GPU, plus the all-reduces
