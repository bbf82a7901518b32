"""Calibration files and the least-squares step-time fit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from roofline.planner.calibration import (
    Calibration,
    CalibrationPoint,
    RooflineStepTimer,
    StepShape,
    fit_calibration,
    load_calibration,
    nnls,
    save_calibration,
)
from roofline.planner.hardware import get_gpu


def _shapes() -> list[StepShape]:
    shapes = [StepShape(b, b * ctx) for b in (1, 4, 16, 64, 256) for ctx in (128, 1024, 4096)]
    shapes += [StepShape(prefill_chunks=((q, 0),)) for q in (64, 256, 1024, 2048, 4096)]
    shapes += [StepShape(32, 32 * 1000, ((1024, 512),))]
    return shapes


def test_fit_recovers_a_linear_model_exactly():
    coef = (2e-5, 3e-9, 5e-5, 1e-11, 1e-4, 2e-3)
    points = [
        CalibrationPoint.from_shape(s, 4e-3 + float(np.dot(coef, s.features()))) for s in _shapes()
    ]
    fit = fit_calibration(points)
    assert fit.intercept_s == pytest.approx(4e-3, rel=1e-6)
    assert fit.coef_s == pytest.approx(coef, rel=1e-5)
    assert fit.max_rel_error < 1e-6


def test_fit_of_the_roofline_is_close(llama3_8b):
    timer = RooflineStepTimer(llama3_8b, get_gpu("h100"))
    points = [CalibrationPoint.from_shape(s, timer(s)) for s in _shapes()]
    fit = fit_calibration(points)
    assert min(fit.coef_s) >= 0.0 and fit.intercept_s > 0
    # a linear fit cannot bend at the memory/compute ridge: a few percent on average
    assert fit.mean_rel_error < 0.08
    assert fit.max_rel_error < 0.3


def test_unexercised_terms_get_zero():
    points = [CalibrationPoint(b, b * 100, 0, 1e-3 + b * 1e-5) for b in (1, 2, 8, 32)]
    fit = fit_calibration(points)
    assert fit.coef_s[2:] == (0.0, 0.0, 0.0, 0.0)
    assert fit(StepShape(4, 400)) == pytest.approx(1e-3 + 4e-5, rel=1e-6)


def test_nnls_matches_unconstrained_when_positive_and_clips_otherwise():
    rng = np.random.default_rng(0)
    a = rng.random((30, 3))
    x_true = np.array([1.0, 2.0, 3.0])
    assert nnls(a, a @ x_true) == pytest.approx(x_true)
    x = nnls(a, a @ np.array([1.0, -2.0, 3.0]))
    assert (x >= 0).all() and x[1] == 0.0


def test_save_load_roundtrip(tmp_path):
    cal = Calibration(
        points=[CalibrationPoint(8, 8000, 0, 0.005), CalibrationPoint(0, 0, 512, 0.02, 131328)],
        device="NVIDIA H100",
        model="llama-3.1-8b",
        meta={"num_pages": 1234, "page_size": 16},
    )
    path = tmp_path / "cal.json"
    save_calibration(path, cal)
    assert json.loads(path.read_text())["version"] == 2
    back = load_calibration(path)
    assert back.points == cal.points and back.meta == cal.meta and back.device == cal.device
    path.write_text('{"points": [{"num_decode_tokens": 1}]}')
    with pytest.raises(ValueError, match="malformed"):
        load_calibration(path)
