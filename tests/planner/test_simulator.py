"""The serving simulator driving the real scheduler: limits it must reproduce."""

from __future__ import annotations

import pytest

from roofline.config import SchedulerConfig
from roofline.planner.calibration import (
    CalibrationPoint,
    RooflineStepTimer,
    StepShape,
    fit_calibration,
)
from roofline.planner.hardware import get_gpu
from roofline.planner.metrics import SLO, replicas_needed, summarize, sweep_rates
from roofline.planner.roofline import step_time
from roofline.planner.simulator import SimConfig, simulate
from roofline.planner.workload import LengthDist, Workload


def _sim(num_pages: int = 4096, **sched) -> SimConfig:
    cfg = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096)
    cfg.update(sched)
    return SimConfig(SchedulerConfig(**cfg), num_pages=num_pages, page_size=16)


def _workload(n: int, rate: float | None, prompt="512", output="32", **kw) -> Workload:
    return Workload(n, LengthDist.parse(prompt), LengthDist.parse(output), rate, **kw)


def test_low_rate_ttft_is_prefill_and_tpot_is_batch1_decode(small_model):
    gpu = get_gpu("h100")
    timer = RooflineStepTimer(small_model, gpu)
    result = simulate(_workload(20, 0.01), _sim(), timer)
    s = summarize(result)
    assert s.num_requests == 20 and s.mean_running == pytest.approx(1.0)
    prefill = step_time(small_model, gpu, num_prefill_tokens=512)
    assert s.ttft_s[50] == pytest.approx(prefill, rel=1e-9)
    assert s.ttft_s[99] == pytest.approx(prefill, rel=1e-9)
    decode = step_time(small_model, gpu, 1, 512 + 16)  # mid-output context
    assert s.tpot_s[50] == pytest.approx(decode, rel=0.01)
    assert all(r.num_output_tokens == 32 for r in result.requests)


def test_throughput_saturates_with_rate(small_model):
    timer = RooflineStepTimer(small_model, get_gpu("h100"))
    rows = sweep_rates(_workload(150, 1.0, "uniform:64:512", "uniform:16:128"),
                       [2.0, 2000.0, 20000.0], _sim(), timer)  # fmt: skip
    low, high, higher = (r.summary for r in rows)
    assert low.request_throughput == pytest.approx(2.0, rel=0.25)
    assert high.request_throughput > 20 * low.request_throughput
    assert higher.request_throughput == pytest.approx(high.request_throughput, rel=0.1)
    assert higher.ttft_s[50] > low.ttft_s[50]  # queueing


def test_tiny_kv_pool_forces_preemptions(small_model):
    timer = RooflineStepTimer(small_model, get_gpu("h100"))
    sim = _sim(num_pages=40)  # 640 tokens for 16 requests of up to 64 + 128
    result = simulate(_workload(16, None, "64", "128"), sim, timer)
    s = summarize(result)
    assert s.num_preemptions > 0 and result.timeline[-1].num_preemptions_total == s.num_preemptions
    assert sum(r.num_preemptions for r in result.requests) == s.num_preemptions
    assert s.peak_kv_usage > 0.9
    assert all(r.num_output_tokens == 128 for r in result.requests)
    roomy = summarize(simulate(_workload(16, None, "64", "128"), _sim(), timer))
    assert roomy.num_preemptions == 0 and roomy.duration_s < s.duration_s


def test_prefix_hits_cut_ttft(small_model):
    timer = RooflineStepTimer(small_model, get_gpu("h100"))
    kw = dict(prefix_len=1024, prefix_fraction=1.0, seed=5)
    shared = summarize(simulate(_workload(20, 0.5, "1100", "8", **kw), _sim(), timer))
    assert shared.prefix_hit_rate > 0.8
    cold = SimConfig(_sim().scheduler, 4096, 16, enable_prefix_caching=False)
    plain = summarize(simulate(_workload(20, 0.5, "1100", "8", **kw), cold, timer))
    assert plain.prefix_hit_rate == 0.0 and shared.ttft_s[50] < plain.ttft_s[50] / 2


def test_slo_goodput_and_replicas(small_model):
    timer = RooflineStepTimer(small_model, get_gpu("h100"))
    work = _workload(120, 1.0, "uniform:256:1024", "uniform:32:128", seed=2)
    slo = SLO(ttft_s=0.05)
    plan = replicas_needed(work, 3000.0, _sim(), timer, slo, 0.95, max_replicas=32)
    assert plan.num_replicas is not None and plan.num_replicas > 1
    by_n = {int(r.x): r.summary for r in plan.rows}
    assert by_n[plan.num_replicas].slo_attainment >= 0.95
    below = [n for n in by_n if n < plan.num_replicas]
    assert below and all(by_n[n].slo_attainment < 0.95 for n in below)
    assert by_n[plan.num_replicas].goodput_rps <= by_n[plan.num_replicas].request_throughput


def test_calibrated_timer_reproduces_roofline_sim(llama3_8b):
    gpu = get_gpu("h100")
    roof = RooflineStepTimer(llama3_8b, gpu, overhead_s=0.5e-3)
    shapes = [StepShape(b, b * c) for b in (1, 8, 32, 64, 128) for c in (256, 1024)]
    shapes += [StepShape(prefill_chunks=((q, 0),)) for q in (128, 512, 1024, 2048)]
    shapes += [StepShape(b, b * 600, ((2048 - b, 0),)) for b in (16, 64)]
    fit = fit_calibration([CalibrationPoint.from_shape(s, roof(s)) for s in shapes])
    work = _workload(100, None, "uniform:128:1024", "uniform:32:256", vocab_size=1000)
    a = summarize(simulate(work, _sim(max_num_seqs=128), roof))
    b = summarize(simulate(work, _sim(max_num_seqs=128), fit))
    assert b.output_tokens_per_s == pytest.approx(a.output_tokens_per_s, rel=0.15)
    assert b.tpot_s[50] == pytest.approx(a.tpot_s[50], rel=0.15)


def test_shared_prefix_pages_are_read_once_by_the_floor(small_model):
    """Decodes holding the same cached prefix pages: the step shape counts those tokens as
    shared, the roofline reads them once, and a calibration file keeps the count."""
    shapes: list[StepShape] = []

    def timer(shape: StepShape) -> float:
        shapes.append(shape)
        return RooflineStepTimer(small_model, get_gpu("h100"))(shape)

    work = _workload(8, None, "160", "4", prefix_len=128, prefix_fraction=1.0)
    simulate(work, _sim(), timer)
    decodes = [s for s in shapes if s.num_decode_tokens == 8 and not s.prefill_chunks]
    assert decodes
    # 128 prefix tokens = 8 full pages, held by 8 decodes: 7 of each page's holders are shared
    assert all(s.decode_shared_tokens == 7 * 128 for s in decodes)
    gpu = get_gpu("h100")
    s = decodes[0]
    alone = StepShape(s.num_decode_tokens, s.decode_context_len_sum, s.prefill_chunks)
    from roofline.planner.roofline import step_cost

    shared_cost = step_cost(small_model, gpu, 8, s.decode_context_len_sum, decode_shared_tokens=896)
    plain_cost = step_cost(small_model, gpu, 8, s.decode_context_len_sum)
    kv_tok = (plain_cost.kv_read_bytes - shared_cost.kv_read_bytes) / 896
    assert kv_tok > 0 and shared_cost.attention_flops == plain_cost.attention_flops
    timer_plain = RooflineStepTimer(small_model, gpu)
    assert timer_plain(s) < timer_plain(alone)
    point = CalibrationPoint.from_shape(s, 1e-3)
    assert point.shape() == s
    with pytest.raises(ValueError, match="decode_shared_tokens"):
        step_cost(small_model, gpu, 2, 10, decode_shared_tokens=9)


def test_speculation_emits_the_expected_run_per_verification(small_model):
    """Proposals accepted at rate a: a verification row emits (1 - a^(k+1)) / (1 - a) tokens
    on average, so at batch 1 the steps shrink by that factor, and each step pays a 1 + k
    chunk plus the draft's k decode steps."""
    from roofline.planner.spec_sim import SpecSimConfig
    from roofline.planner.specdec import expected_tokens_per_step

    gpu = get_gpu("h100")
    timer = RooflineStepTimer(small_model, gpu)
    work = _workload(4, 0.001, "64", "400")  # one request at a time: batch 1
    plain = simulate(work, _sim(), timer)
    # always on, no host time: the mechanics (the adaptive switch: the test below)
    spec_cfg = SpecSimConfig(4, 0.7, 0.1, seed=3, adaptive=False, host_s=0, host_per_request_s=0)
    sim = SimConfig(_sim().scheduler, num_pages=4096, page_size=16, speculative=spec_cfg)
    spec = simulate(work, sim, timer)
    assert all(r.num_output_tokens == 400 for r in spec.requests)  # max_tokens never exceeded
    decode_steps = plain.num_steps - 4
    spec_steps = spec.num_steps - 4
    per_step = 4 * 399 / spec_steps
    assert per_step == pytest.approx(expected_tokens_per_step(0.7, 4), rel=0.06)
    assert decode_steps / spec_steps == pytest.approx(per_step, rel=0.02)
    # each verification step costs more than a decode step: the 5-token chunk and the draft
    busy_spec = sum(p.step_time_s for p in spec.timeline)
    busy_plain = sum(p.step_time_s for p in plain.timeline)
    ratio = (busy_spec / spec.num_steps) / (busy_plain / plain.num_steps)
    assert 1.3 < ratio < 1.8
    assert busy_spec < busy_plain / 1.5
    off = SpecSimConfig(4, 0.7, max_batch_size=1, adaptive=False)
    busy = simulate(_workload(8, None, "64", "20"), SimConfig(_sim().scheduler, 4096, 16,
                    speculative=off), timer)  # fmt: skip
    assert busy.num_steps == simulate(_workload(8, None, "64", "20"), _sim(), timer).num_steps
    with pytest.raises(ValueError, match="acceptance_rate"):
        SpecSimConfig(4, 1.5)


def test_the_adaptive_switch_speculates_where_it_pays(llama3_8b):
    """The engine's switch in the simulator (8B roofline on the H100, n-gram proposals): at
    batch 128 with acceptance 0.5 the 640-row verification and the synchronous step's host
    time cost more than the 1.9 tokens a row brings, so it never speculates and costs nothing;
    with 0.9 it turns on from what shadow proposals measure; at batch 1 it speculates."""
    from roofline.planner.spec_sim import SpecSimConfig
    from roofline.planner.specdec import expected_tokens_per_step

    timer = RooflineStepTimer(llama3_8b, get_gpu("h100"))
    sched = _sim(max_num_seqs=128, max_num_batched_tokens=8192).scheduler

    def run(n, alpha, output="128"):
        work = _workload(n, None, "64", output)
        spec = SpecSimConfig(4, alpha, seed=1) if alpha is not None else None
        return simulate(work, SimConfig(sched, 16384, 16, speculative=spec), timer)

    plain = run(128, None).duration_s
    low = run(128, 0.5)
    assert low.spec_step_share == 0.0 and low.duration_s == pytest.approx(plain, rel=1e-9)
    high = run(128, 0.9)
    assert high.spec_step_share > 0.5 and high.duration_s < plain / 1.1
    single, single_plain = run(1, 0.9, "512"), run(1, None, "512")
    assert single.spec_step_share > 0.9
    assert single_plain.duration_s / single.duration_s > 0.6 * expected_tokens_per_step(0.9, 4)


def test_async_scheduling_delays_an_arrival_by_one_step():
    """With async scheduling a request arriving while step k runs is first scheduled in step
    k+2 (k+1 was scheduled as k launched); an idle engine still schedules it at once."""
    import dataclasses

    from roofline.planner.workload import SyntheticRequest

    def timer(shape):
        return 0.010  # every step 10 ms

    reqs = [
        SyntheticRequest(0.0, tuple(range(1, 65)), 50),  # decodes for 50 steps
        SyntheticRequest(0.105, tuple(range(100, 164)), 2),  # arrives during step 11
        SyntheticRequest(5.0, tuple(range(200, 264)), 2),  # arrives when the engine is idle
    ]
    sync = _sim()
    by_id = {}
    for name, cfg in (("sync", sync), ("async", dataclasses.replace(sync, async_scheduling=True))):
        res = simulate(reqs, cfg, timer)
        by_id[name] = {r.request_id: r for r in res.requests}
    # sync: scheduled at 0.110 (end of step 11), first token at 0.120
    assert by_id["sync"]["sim-1"].ttft_s == pytest.approx(0.015)
    assert by_id["async"]["sim-1"].ttft_s == pytest.approx(0.025)
    for name in ("sync", "async"):
        assert by_id[name]["sim-2"].ttft_s == pytest.approx(0.010)
        assert by_id[name]["sim-0"].num_output_tokens == 50
