"""Step-time models for the simulator: the roofline, or a fit to measured steps.

A calibration file (JSON, written by ``roofline bench calibrate`` or ``roofline bench latency
--calibration-out`` through :func:`save_calibration`) holds measured step times with the shape
of each step, and (version 2) the ceilings, model config, precision and build it measured:

    {"version": 2, "device": "...", "model": "...", "meta": {...},
     "ceilings": {"bandwidth_bytes_per_s": ..., "matmul_flops_per_s": ..., ...},
     "model_config": {...HF config...}, "precision": {"weight_dtype": "bf16", ...},
     "build": {"roofline": "0.1.0", "git": "...", ...},
     "points": [{"num_decode_tokens": 64, "decode_context_len_sum": 65600,
                 "num_prefill_tokens": 0, "prefill_attention_pairs": 0,
                 "prefill_chunks": [], "step_time_s": 0.0071}, ...]}

Version 2 files feed ``planner.step_model`` (roofline floor + fitted overhead, the default);
:func:`fit_calibration` below is the older whole-time fit, kept for version 1 files.

:func:`fit_calibration` fits ``t = c0 + c_decode * num_decode_tokens + c_context *
decode_context_len_sum + c_prefill * num_prefill_tokens + c_pairs * prefill_attention_pairs +
c_mixed * mixed_decode_tokens + c_chunk * num_prefill_chunks``
by non-negative least squares on relative error (every point counts alike, whether 5 ms or
500 ms), then once more without the stalls (steps over twice the first fit: JIT compiles).
Terms a file does not exercise (e.g. no prefill points) get a zero coefficient. ``meta``
may carry the engine's KV pool (``num_pages``, ``page_size``) and limits for the simulator.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from roofline.config import ModelConfig
from roofline.planner.hardware import GPUSpec
from roofline.planner.memory import KVLayout
from roofline.planner.roofline import BF16, Precision, prefill_attention_pairs, step_cost

FEATURES = (
    "num_decode_tokens",
    "decode_context_len_sum",
    "num_prefill_tokens",
    "prefill_attention_pairs",
    "mixed_decode_tokens",
    "num_prefill_chunks",
)


@dataclass(frozen=True)
class StepShape:
    """What a step computes, as the step-time models see it."""

    num_decode_tokens: int = 0
    decode_context_len_sum: int = 0
    """Sum over decode tokens of the context each attends to (itself included)."""
    prefill_chunks: tuple[tuple[int, int], ...] = ()
    """``(num_new_tokens, num_cached_tokens)`` per prefilling request."""
    decode_shared_tokens: int = 0
    """Decode context tokens on pages another decode token of the step also reads (a shared
    prefix): the floor counts their KV bytes once."""

    @property
    def num_prefill_tokens(self) -> int:
        return sum(q for q, _ in self.prefill_chunks)

    @property
    def prefill_attention_pairs(self) -> int:
        return sum(prefill_attention_pairs(q, p) for q, p in self.prefill_chunks)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    def features(self) -> list[float]:
        return _features(
            self.num_decode_tokens,
            self.decode_context_len_sum,
            self.num_prefill_tokens,
            self.prefill_attention_pairs,
            len(self.prefill_chunks),
        )


def _features(
    num_decode: int, ctx_sum: int, num_prefill: int, pairs: int, num_chunks: int
) -> list[float]:
    """The fit's regressors, in :data:`FEATURES` order. ``mixed_decode_tokens`` (decodes that
    share a step with a prefill chunk) lets a fit price an engine whose mixed steps run every
    token through the slower prefill path."""
    mixed = num_decode if num_chunks else 0
    return [float(v) for v in (num_decode, ctx_sum, num_prefill, pairs, mixed, num_chunks)]


class StepTimer(Protocol):
    def __call__(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class RooflineStepTimer:
    """Step time from :func:`step_cost`, plus a fixed per-step overhead (launches, host)."""

    model: ModelConfig
    gpu: GPUSpec
    precision: Precision = BF16
    tp: int = 1
    overhead_s: float = 0.0
    kv_layout: KVLayout | None = None
    """An MLA cache (``KVLayout.mla``); None: the model's own KV heads."""

    def __call__(self, shape: StepShape) -> float:
        return step_cost(
            self.model,
            self.gpu,
            shape.num_decode_tokens,
            shape.decode_context_len_sum,
            prefill_chunks=list(shape.prefill_chunks),
            precision=self.precision,
            tp=self.tp,
            overhead_s=self.overhead_s,
            decode_shared_tokens=shape.decode_shared_tokens,
            kv_layout=self.kv_layout,
        ).time_s


@dataclass(frozen=True)
class CalibrationPoint:
    num_decode_tokens: int
    decode_context_len_sum: int
    num_prefill_tokens: int
    step_time_s: float
    prefill_attention_pairs: int | None = None
    """None: the prefill tokens were one fresh prompt, ``q (q + 1) / 2`` pairs."""
    num_prefill_chunks: int | None = None
    """Prefilling requests in the step; None: one if there are prefill tokens."""
    prefill_chunks: list[list[int]] | None = None
    """``[num_new_tokens, num_cached_tokens]`` per chunk (version 2 files); None: unknown."""
    decode_shared_tokens: int = 0
    """See :attr:`StepShape.decode_shared_tokens` (0 in files written before it existed)."""

    @classmethod
    def from_shape(cls, shape: StepShape, step_time_s: float) -> CalibrationPoint:
        return cls(
            shape.num_decode_tokens,
            shape.decode_context_len_sum,
            shape.num_prefill_tokens,
            step_time_s,
            shape.prefill_attention_pairs,
            len(shape.prefill_chunks),
            [[q, p] for q, p in shape.prefill_chunks],
            shape.decode_shared_tokens,
        )

    def shape(self) -> StepShape:
        """The step's shape; a point without chunk detail is split into equal fresh chunks."""
        if self.prefill_chunks is not None:
            chunks = tuple((int(q), int(p)) for q, p in self.prefill_chunks)
        elif self.num_prefill_tokens:
            n = self.num_prefill_chunks or 1
            q, r = divmod(self.num_prefill_tokens, n)
            chunks = tuple((q + (i < r), 0) for i in range(n))
        else:
            chunks = ()
        return StepShape(
            self.num_decode_tokens, self.decode_context_len_sum, chunks, self.decode_shared_tokens
        )

    def features(self) -> list[float]:
        pairs = self.prefill_attention_pairs
        if pairs is None:
            pairs = prefill_attention_pairs(self.num_prefill_tokens)
        chunks = self.num_prefill_chunks
        if chunks is None:
            chunks = 1 if self.num_prefill_tokens else 0
        return _features(
            self.num_decode_tokens,
            self.decode_context_len_sum,
            self.num_prefill_tokens,
            pairs,
            chunks,
        )


@dataclass
class Calibration:
    points: list[CalibrationPoint]
    device: str = ""
    model: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    ceilings: dict[str, Any] | None = None
    """The ceilings measured with the steps (``bench.ceilings.Ceilings`` as a dict): the floor
    the step model holds predictions to. None in version 1 files."""
    model_config: dict[str, Any] | None = None
    """The model's HF config dict, so the floor's bytes and FLOPs need no ``--model``."""
    precision: dict[str, Any] | None = None
    """``planner.roofline.Precision`` fields of the measured engine."""
    build: dict[str, Any] | None = None
    """What was measured: roofline version and git commit, torch, device, engine settings."""


def save_calibration(path: str | os.PathLike[str], calibration: Calibration) -> None:
    doc = {
        "version": 2,
        "device": calibration.device,
        "model": calibration.model,
        "meta": calibration.meta,
        "ceilings": calibration.ceilings,
        "model_config": calibration.model_config,
        "precision": calibration.precision,
        "build": calibration.build,
        "points": [asdict(p) for p in calibration.points],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("points"), list):
        raise ValueError(f"{path}: not a calibration file (no 'points' list)")
    points = []
    for i, p in enumerate(doc["points"]):
        try:
            points.append(
                CalibrationPoint(
                    num_decode_tokens=int(p.get("num_decode_tokens", 0)),
                    decode_context_len_sum=int(p.get("decode_context_len_sum", 0)),
                    num_prefill_tokens=int(p.get("num_prefill_tokens", 0)),
                    step_time_s=float(p["step_time_s"]),
                    prefill_attention_pairs=p.get("prefill_attention_pairs"),
                    num_prefill_chunks=p.get("num_prefill_chunks"),
                    prefill_chunks=p.get("prefill_chunks"),
                    decode_shared_tokens=int(p.get("decode_shared_tokens", 0)),
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: point {i} is malformed: {p!r}") from e
    return Calibration(
        points,
        str(doc.get("device", "")),
        str(doc.get("model", "")),
        doc.get("meta") or {},
        doc.get("ceilings"),
        doc.get("model_config"),
        doc.get("precision"),
        doc.get("build"),
    )


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """Lawson-Hanson non-negative least squares: argmin ||a x - b|| subject to x >= 0."""
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        candidates = np.where(~passive & (w > tol))[0]
        if candidates.size == 0:
            break
        passive[candidates[np.argmax(w[candidates])]] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > tol):
                x = z
                break
            neg = passive & (z <= tol)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


@dataclass(frozen=True)
class FittedStepTimer:
    """``t = intercept_s + sum(coef_s[i] * feature[i])`` over :data:`FEATURES`."""

    intercept_s: float
    coef_s: tuple[float, ...]
    max_rel_error: float = 0.0
    """Largest |fit - measured| / measured over the calibration points."""
    mean_rel_error: float = 0.0
    num_dropped: int = 0
    """Stalled steps left out of the fit."""

    def __call__(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        return self.intercept_s + float(np.dot(self.coef_s, shape.features()))

    def predict_point(self, point: CalibrationPoint) -> float:
        return self.intercept_s + float(np.dot(self.coef_s, point.features()))


def _fit(feats: np.ndarray, t: np.ndarray) -> np.ndarray:
    scale = np.abs(feats).max(axis=0)
    used = scale > 0
    design = feats[:, used] / scale[used] / t[:, None]  # relative error: divide rows by t
    coef = np.zeros(feats.shape[1])
    coef[used] = nnls(design, np.ones(len(t))) / scale[used]
    return coef


def fit_calibration(
    points: Sequence[CalibrationPoint], stall_threshold: float = 1.0
) -> FittedStepTimer:
    """Fit, drop stalls (steps slower than ``1 + stall_threshold`` times the first fit: JIT
    compiles, allocator growth), refit. Errors are reported over the kept points."""
    if len(points) < 2:
        raise ValueError("a calibration needs at least two measured steps")
    t = np.array([p.step_time_s for p in points])
    if np.any(t <= 0):
        raise ValueError("measured step times must be positive")
    feats = np.array([[1.0, *p.features()] for p in points])
    coef = _fit(feats, t)
    keep = t <= (1.0 + stall_threshold) * (feats @ coef)
    if 2 <= keep.sum() < len(t):
        feats, t = feats[keep], t[keep]
        coef = _fit(feats, t)
    rel = np.abs(feats @ coef - t) / t
    return FittedStepTimer(
        intercept_s=float(coef[0]),
        coef_s=tuple(float(c) for c in coef[1:]),
        max_rel_error=float(rel.max()),
        mean_rel_error=float(rel.mean()),
        num_dropped=int(len(points) - len(t)),
    )
