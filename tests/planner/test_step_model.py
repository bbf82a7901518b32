"""The calibrated step model held to the roofline floor: it never predicts a step faster than
its bytes and FLOPs allow, it recovers overhead terms from measured steps, and it extrapolates
to shapes the calibration never saw (the failure of the whole-time fit, issue 19)."""

from __future__ import annotations

import random
import time

import pytest

from roofline.planner.calibration import (
    Calibration,
    CalibrationPoint,
    StepShape,
    fit_calibration,
    load_calibration,
    save_calibration,
)
from roofline.planner.hardware import custom_gpu
from roofline.planner.roofline import BF16, Precision
from roofline.planner.step_model import (
    CalibratedRegion,
    FlooredStepTimer,
    RegionCheckingTimer,
    fit_floored,
    step_physics,
    timer_from_calibration,
)
from roofline.planner.validate import EngineStepper, suite

H100ish = custom_gpu("test-gpu", 80, 3000, 750)


def _truth(shape: StepShape, model) -> float:
    """A synthetic engine: 25% slower than the bandwidth on bytes, 30% on FLOPs, 300 us per
    step and 20 us per sequence on the host."""
    ph = step_physics(shape, model, H100ish)
    seqs = shape.num_decode_tokens + len(shape.prefill_chunks)
    return max(1.25 * ph.memory_s, 1.3 * ph.compute_s) + 300e-6 + 20e-6 * seqs


def _decode_points(model, batches=(1, 4, 16, 64), contexts=(256, 320)) -> list[CalibrationPoint]:
    pts = []
    for b in batches:
        for c in contexts:
            shape = StepShape(b, b * c)
            pts.append(CalibrationPoint.from_shape(shape, _truth(shape, model)))
    return pts


def _random_shape(rng: random.Random) -> StepShape:
    num_decode = rng.choice([0, 1, 8, 64, 256, 1024])
    ctx = num_decode * rng.choice([1, 100, 4000, 30000])
    chunks = tuple(
        (rng.choice([1, 16, 512, 8000]), rng.choice([0, 64, 20000]))
        for _ in range(rng.choice([0, 0, 1, 3]))
    )
    if not num_decode and not chunks:
        chunks = ((8, 0),)
    return StepShape(num_decode, max(ctx, num_decode), chunks)


def test_prediction_never_below_the_floor_even_far_outside(llama3_8b):
    fit = fit_floored(_decode_points(llama3_8b), llama3_8b, H100ish)
    rng = random.Random(0)
    for _ in range(300):
        shape = _random_shape(rng)
        assert fit(shape) >= fit.floor(shape) > 0


def test_long_prefill_from_a_decode_calibration_pays_its_flops(llama3_8b):
    """Issue 19's third workload: calibrated on decode steps with short contexts, the
    whole-time fit prices an 8,000-token prefill below its FLOPs; the floored model cannot."""
    points = _decode_points(llama3_8b)
    prefill = StepShape(0, 0, ((8000, 0),))
    floor = step_physics(prefill, llama3_8b, H100ish).floor_s
    assert fit_calibration(points)(prefill) < 0.5 * floor  # what the old fit did
    floored = fit_floored(points, llama3_8b, H100ish)
    assert floored(prefill) >= floor
    # and a long-context decode batch pays for its KV read (KV bytes dominate here)
    long_ctx = StepShape(64, 64 * 8000)
    assert floored(long_ctx) >= step_physics(long_ctx, llama3_8b, H100ish).memory_s


def test_fit_recovers_the_synthetic_engine(llama3_8b):
    pts = _decode_points(llama3_8b, contexts=(128, 1024, 4096))
    for q, p in ((256, 0), (2048, 0), (4096, 4096), (8000, 0)):
        shape = StepShape(0, 0, ((q, p),))
        pts.append(CalibrationPoint.from_shape(shape, _truth(shape, llama3_8b)))
    for b in (8, 64):
        shape = StepShape(b, b * 600, ((512, 0),))
        pts.append(CalibrationPoint.from_shape(shape, _truth(shape, llama3_8b)))
    fit = fit_floored(pts, llama3_8b, H100ish)
    assert fit.mean_rel_error < 0.03
    assert fit.bandwidth_scale == fit.flops_scale == 1.0
    rng = random.Random(1)
    for _ in range(200):  # within 10% on shapes it never saw (same physics)
        shape = _random_shape(rng)
        truth = _truth(shape, llama3_8b)
        assert abs(fit(shape) / truth - 1) < 0.10, shape


def test_ceilings_raised_when_steps_beat_them(llama3_8b):
    slow_gpu = custom_gpu("under-measured", 80, 1000, 750)  # a third of the true bandwidth
    pts = _decode_points(llama3_8b)
    fit = fit_floored(pts, llama3_8b, slow_gpu)
    assert fit.bandwidth_scale > 2.0
    for p in pts:  # the raised floor sits at or below the measured steps (90th percentile)
        assert fit.floor(p.shape()) <= p.step_time_s * 1.05


def test_region_and_its_warning(llama3_8b):
    fit = fit_floored(_decode_points(llama3_8b), llama3_8b, H100ish)
    assert fit.region == CalibratedRegion(64, 320, 0, 0)
    checked = RegionCheckingTimer(fit, fit.region)
    checked(StepShape(16, 16 * 300))
    assert checked.warning() is None
    checked(StepShape(256, 256 * 300))
    checked(StepShape(0, 0, ((8000, 0),)))
    assert checked.num_outside == 2
    msg = checked.warning()
    assert msg is not None and "decode batch" in msg and "prefill tokens" in msg


def test_calibration_file_v2_round_trip(tmp_path, llama3_8b):
    pts = _decode_points(llama3_8b)
    cal = Calibration(
        pts,
        "test-gpu",
        "llama-3.1-8b",
        {"num_pages": 100},
        ceilings={
            "device_name": "test-gpu",
            "bandwidth_bytes_per_s": 3e12,
            "matmul_flops_per_s": 750e12,
            "matmul_dtype": "bfloat16",
        },
        model_config=dict(llama3_8b.hf_config),
        precision={"weight_dtype": "bf16", "kv_dtype": "bf16"},
        build={"roofline": "0.1.0"},
    )
    path = tmp_path / "cal.json"
    save_calibration(path, cal)
    back = load_calibration(path)
    assert back.ceilings == cal.ceilings and back.build == cal.build
    assert back.points[0].prefill_chunks == []
    timer, note = timer_from_calibration(back)
    assert note is None and isinstance(timer, FlooredStepTimer)
    assert timer.precision == Precision() == BF16
    shape = StepShape(32, 32 * 2000)
    assert timer(shape) == pytest.approx(_truth(shape, llama3_8b), rel=0.1)
    # a version 1 file (no ceilings) falls back to the whole-time fit, with a warning
    old = Calibration(pts, "test-gpu", "llama-3.1-8b")
    timer, note = timer_from_calibration(old)
    assert not isinstance(timer, FlooredStepTimer) and "no roofline floor" in note


class _AsyncEngine:
    """As async scheduling: each step() schedules and launches a step (host time), then waits
    for the one launched before (device time); the last call only drains."""

    def __init__(self, host_s: list[float], wait_s: float) -> None:
        self.on_schedule = None
        self._in_flight = None
        self.host_s = host_s
        self.wait_s = wait_s
        self.runner = self  # runner.launch is this engine's launch
        self.counter = 0

    def launch(self, step: int) -> None:
        time.sleep(self.host_s[step - 1])

    def step(self) -> None:
        prev, self._in_flight = self._in_flight, None
        if self.counter < len(self.host_s):
            self.counter += 1
            self.on_schedule(self.counter)
            self.runner.launch(self.counter)
            self._in_flight = self.counter
        if prev is not None:
            time.sleep(self.wait_s)


def test_stepper_charges_each_step_its_launch_and_its_wait():
    engine = _AsyncEngine([0.001, 0.08, 0.001], wait_s=0.004)
    with EngineStepper(engine) as stepper:
        done = [stepper.step() for _ in range(4)]
    assert [[so for so, _ in d] for d in done] == [[], [1], [2], [3]]
    times = {so: dt for d in done for so, dt in d}
    assert times[2] >= 0.08 + 0.004  # its slow launch and its own wait
    assert times[2] == max(times.values())  # not charged to the step it launched after
    assert engine.on_schedule is None and "launch" not in vars(engine)  # unwrapped


def test_suite_fits_the_model_length():
    cases = suite(vocab_size=512, max_model_len=256, scale=0.01)
    assert [c.name for c in cases][:2] == ["short requests", "long prompts"]
    assert cases[-1].serving_fraction == 0.8
    for case in cases:
        for r in case.workload.requests():
            assert len(r.prompt_token_ids) + r.max_tokens <= 256
            assert r.max_tokens >= 1


def test_shared_prefix_decode_pays_its_own_attention_kernel(llama3_8b):
    """Decodes over a prefix the batch shares read its pages once (cascade attention) but pay
    a kernel over their queries x the prefix: the fit learns that cost from shared-prefix
    steps instead of pricing them at the bytes they no longer read, and a calibration without
    such steps flags them as outside its region."""

    def truth(shape: StepShape) -> float:
        return (
            _truth(shape, llama3_8b)
            + 4.0 * step_physics(shape, llama3_8b, H100ish).shared_attention_s
        )

    def shared(b: int, prefix: int, suffix: int = 100) -> StepShape:
        return StepShape(b, b * (prefix + suffix), (), (b - 1) * prefix)

    pts = [CalibrationPoint.from_shape(s, _truth(s, llama3_8b)) for s in (
        StepShape(b, b * c) for b in (1, 4, 16, 64, 256) for c in (256, 2048))]  # fmt: skip
    plain = fit_floored(pts, llama3_8b, H100ish)
    assert plain.region.outside(shared(64, 2048)) == ["shared decode prefix"]
    pts += [CalibrationPoint.from_shape(s, truth(s)) for s in (shared(64, 2048), shared(256, 2048))]
    fit = fit_floored(pts, llama3_8b, H100ish)
    assert fit.terms()["shared_attention_x"] > 1.0
    unseen = shared(128, 1024, suffix=300)
    extra = 4.0 * step_physics(unseen, llama3_8b, H100ish).shared_attention_s
    assert truth(unseen) - plain(unseen) > 0.5 * extra  # the old terms price only the bytes
    assert abs(fit(unseen) - truth(unseen)) < 0.25 * extra
    assert fit.region.outside(unseen) == []
