"""A calibrated step-time model held to physics: ``t = roofline floor + fitted overhead``.

A fit of the whole step time to measured steps (``calibration.fit_calibration``) extrapolates
freely outside the shapes it saw: fitted on decode batches of short contexts it priced a long
context's KV read near zero and an 8,000-token prefill at a quarter of its FLOPs. Here the
floor is the roofline time of the step's own bytes and FLOPs (``planner.roofline.step_cost``)
at the ceilings measured with the calibration (copy bandwidth, matmul rate), and only the time
*above* the floor is fitted, by non-negative least squares on relative error, from terms that
cannot take it below the floor:

    t = max(memory_s + c_w * weight_s + c_kv * kv_s,          (memory side, with efficiency)
            compute_s + c_lin * linear_s + c_att * attention_s)  (compute side, with efficiency)
      + c_fixed + c_seq * num_seqs + c_chunk * num_prefill_chunks     (host and launch costs)
      + c_eager * [step holds a prefill chunk] + c_mix * decodes in such a step
                                                    (eager, prefill-path steps vs CUDA graphs)
      + c_shared * shared_attention_s                (decode attention over shared prefix pages)

``num_seqs`` counts the step's decode tokens and prefill chunks; ``weight_s``/``kv_s`` are the
step's weight and KV bytes over the bandwidth, ``linear_s`` and ``attention_s`` its GEMM and
attention FLOPs over the matmul rate, ``shared_attention_s`` the attention FLOPs of decode
tokens over pages other decodes of the step also hold (cascade attention reads those pages
once, so they leave the KV bytes, but their query-by-key work is a kernel of its own that the
bytes do not pay for); ``max(memory_s, compute_s)`` is the floor. Each step is fitted on the
side that binds it (a hinge regression: sides assigned, NNLS solved, sides reassigned until
stable). Every coefficient is >= 0, so a prediction is never
below the floor, and a shape outside the calibration still pays for its bytes and FLOPs; a side
the calibration never exercised keeps zero efficiency terms (its floor, plus host costs).
Where measured steps run below the floor (the copy benchmark under-measured the bandwidth a
GEMV reaches), the ceilings are raised to the rate 90% of the steps stay under
and the fit says so (``bandwidth_scale``, ``flops_scale``). :class:`CalibratedRegion` records
the shapes a calibration covered; :class:`RegionCheckingTimer` counts simulated steps that
leave it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from roofline.config import ModelConfig
from roofline.planner.calibration import (
    Calibration,
    CalibrationPoint,
    StepShape,
    StepTimer,
    fit_calibration,
    nnls,
)
from roofline.planner.hardware import GPUSpec, custom_gpu
from roofline.planner.roofline import BF16, Precision, attention_flops_per_pair, step_cost

OVERHEAD_TERMS = (
    "fixed_s",
    "per_seq_s",
    "per_prefill_chunk_s",
    "per_prefill_step_s",
    "per_mixed_decode_s",
    "weight_read_x",
    "kv_read_x",
    "linear_compute_x",
    "attention_compute_x",
    "shared_attention_x",
)
"""Names of the fitted coefficients: seconds for the first five, multiples of the floor's
component times for the rest. ``per_prefill_step_s`` is paid once by a step holding any prefill
chunk: such steps run eagerly, while pure decode steps replay CUDA graphs;
``per_mixed_decode_s`` by each decode token in such a step (it takes the prefill path)."""


@dataclass(frozen=True)
class StepPhysics:
    """One step's roofline decomposition at given ceilings."""

    floor_s: float
    weight_s: float
    kv_s: float
    linear_s: float
    attention_s: float
    memory_s: float
    compute_s: float
    shared_attention_s: float = 0.0


def step_physics(
    shape: StepShape, model: ModelConfig, gpu: GPUSpec, precision: Precision = BF16
) -> StepPhysics:
    cost = step_cost(
        model,
        gpu,
        shape.num_decode_tokens,
        shape.decode_context_len_sum,
        prefill_chunks=list(shape.prefill_chunks),
        precision=precision,
        decode_shared_tokens=shape.decode_shared_tokens,
    )
    bw = gpu.hbm_bandwidth_bytes_per_s
    flops = gpu.peak_flops_per_s(precision.gemm_dtype)
    return StepPhysics(
        floor_s=max(cost.memory_time_s, cost.compute_time_s),
        weight_s=(cost.weight_bytes + cost.embedding_bytes) / bw,
        kv_s=(cost.kv_read_bytes + cost.kv_write_bytes) / bw,
        linear_s=cost.linear_flops / flops,
        attention_s=cost.attention_flops / flops,
        memory_s=cost.memory_time_s,
        compute_s=cost.compute_time_s,
        shared_attention_s=attention_flops_per_pair(model) * shape.decode_shared_tokens / flops,
    )


def _features(shape: StepShape, ph: StepPhysics) -> tuple[list[float], list[float]]:
    """(memory-side, compute-side) feature rows in :data:`OVERHEAD_TERMS` order: host terms in
    both, each side's efficiency terms in its own row only."""
    num_chunks = len(shape.prefill_chunks)
    host = [
        1.0,
        float(shape.num_decode_tokens + num_chunks),
        float(num_chunks),
        float(num_chunks > 0),
        float(shape.num_decode_tokens if num_chunks else 0),
    ]
    shared = [ph.shared_attention_s]  # a kernel of its own: paid on either side
    return (
        host + [ph.weight_s, ph.kv_s, 0.0, 0.0] + shared,
        host + [0.0, 0.0, ph.linear_s, ph.attention_s] + shared,
    )


def _predict(coef: np.ndarray, shape: StepShape, ph: StepPhysics) -> float:
    mem, comp = _features(shape, ph)
    return max(ph.memory_s + float(np.dot(coef, mem)), ph.compute_s + float(np.dot(coef, comp)))


@dataclass(frozen=True)
class CalibratedRegion:
    """The step shapes a calibration measured: a simulated step beyond any bound is an
    extrapolation (the floor still holds, the overhead terms are untested there)."""

    max_decode_tokens: int = 0
    max_mean_context_len: int = 0
    """Largest mean context per decode token among decode steps."""
    max_prefill_tokens: int = 0
    max_cached_prefix_len: int = 0
    """Longest cached prefix a measured prefill chunk attended to."""
    max_decode_shared_tokens: int = 0
    """Most decode context tokens on pages shared with another decode of the step."""

    @classmethod
    def of(cls, shapes: Sequence[StepShape]) -> CalibratedRegion:
        dec = [s for s in shapes if s.num_decode_tokens]
        return cls(
            max((s.num_decode_tokens for s in dec), default=0),
            max((s.decode_context_len_sum // s.num_decode_tokens for s in dec), default=0),
            max((s.num_prefill_tokens for s in shapes), default=0),
            max((p for s in shapes for _, p in s.prefill_chunks), default=0),
            max((s.decode_shared_tokens for s in shapes), default=0),
        )

    def outside(self, shape: StepShape) -> list[str]:
        """The bounds ``shape`` passes (empty: inside), with 10% slack."""
        out = []
        if shape.num_decode_tokens > 1.1 * self.max_decode_tokens:
            out.append("decode batch")
        if shape.num_decode_tokens and (
            shape.decode_context_len_sum / shape.num_decode_tokens > 1.1 * self.max_mean_context_len
        ):
            out.append("decode context")
        if shape.num_prefill_tokens > 1.1 * self.max_prefill_tokens:
            out.append("prefill tokens")
        if any(p > 1.1 * self.max_cached_prefix_len for _, p in shape.prefill_chunks):
            out.append("cached prefix")
        if shape.decode_shared_tokens > 1.1 * self.max_decode_shared_tokens:
            out.append("shared decode prefix")
        return out


@dataclass(frozen=True)
class FlooredStepTimer:
    """``t = floor(shape) + overhead(shape)`` (see the module docstring)."""

    model: ModelConfig
    gpu: GPUSpec
    """The calibration's ceilings (raised where steps beat them)."""
    precision: Precision
    coef: tuple[float, ...]
    """One per :data:`OVERHEAD_TERMS`, all >= 0."""
    bandwidth_scale: float = 1.0
    """How much the measured bandwidth was raised because steps beat their floor (1 = none)."""
    flops_scale: float = 1.0
    max_rel_error: float = 0.0
    mean_rel_error: float = 0.0
    num_dropped: int = 0
    region: CalibratedRegion = field(default_factory=CalibratedRegion)

    def physics(self, shape: StepShape) -> StepPhysics:
        return step_physics(shape, self.model, self.gpu, self.precision)

    def floor(self, shape: StepShape) -> float:
        return self.physics(shape).floor_s if shape.num_tokens else 0.0

    def __call__(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        return _predict(np.asarray(self.coef), shape, self.physics(shape))

    def terms(self) -> dict[str, float]:
        return dict(zip(OVERHEAD_TERMS, self.coef))


def _fit_overhead(
    shapes: Sequence[StepShape], phys: Sequence[StepPhysics], t: np.ndarray
) -> np.ndarray:
    """Hinge regression of the time above each step's binding side (see the module doc)."""
    rows = [_features(s, ph) for s, ph in zip(shapes, phys)]
    mem_side = np.array([ph.memory_s >= ph.compute_s for ph in phys])
    coef = np.zeros(len(OVERHEAD_TERMS))
    for _ in range(10):
        feats = np.array([m if side else c for (m, c), side in zip(rows, mem_side)])
        base = np.array([ph.memory_s if side else ph.compute_s for ph, side in zip(phys, mem_side)])
        resid = np.maximum(t - base, 0.0)
        scale = np.abs(feats).max(axis=0)
        used = scale > 0
        coef = np.zeros(len(OVERHEAD_TERMS))
        if used.any():
            design = feats[:, used] / scale[used] / t[:, None]  # relative error
            coef[used] = nnls(design, resid / t) / scale[used]
        new_side = np.array(
            [
                ph.memory_s + np.dot(coef, m) >= ph.compute_s + np.dot(coef, c)
                for (m, c), ph in zip(rows, phys)
            ]
        )
        if np.array_equal(new_side, mem_side):
            break
        mem_side = new_side
    return coef


def fit_floored(
    points: Sequence[CalibrationPoint],
    model: ModelConfig,
    gpu: GPUSpec,
    precision: Precision = BF16,
    shapes: Sequence[StepShape] | None = None,
    stall_threshold: float = 1.0,
) -> FlooredStepTimer:
    """Fit the overhead above the floor to measured steps. ``shapes`` (one per point) carries
    the exact prefill chunks when the caller has them; else they come from the points."""
    if len(points) < 2:
        raise ValueError("a calibration needs at least two measured steps")
    shapes = list(shapes) if shapes is not None else [p.shape() for p in points]
    t = np.array([p.step_time_s for p in points])
    if np.any(t <= 0):
        raise ValueError("measured step times must be positive")
    raw = [step_physics(s, model, gpu, precision) for s in shapes]
    # ceilings below what the steps reached: raise each until the steps stay above the floor
    # (the 90th percentile, so one mistimed step cannot move them)
    bw_scale = float(max(1.0, np.quantile([ph.memory_s / ti for ph, ti in zip(raw, t)], 0.9)))
    flop_scale = float(max(1.0, np.quantile([ph.compute_s / ti for ph, ti in zip(raw, t)], 0.9)))
    if bw_scale > 1.0 or flop_scale > 1.0:
        gpu = custom_gpu(
            gpu.name,
            gpu.memory_bytes / 2**30,
            gpu.hbm_bandwidth_bytes_per_s * bw_scale / 1e9,
            gpu.peak_flops_per_s("bf16") * flop_scale / 1e12,
        )
    phys = [step_physics(s, model, gpu, precision) for s in shapes]
    coef = _fit_overhead(shapes, phys, t)
    pred = np.array([_predict(coef, s, ph) for s, ph in zip(shapes, phys)])
    keep = t <= (1.0 + stall_threshold) * pred  # JIT compiles, allocator growth
    if 2 <= keep.sum() < len(t):
        idx = np.flatnonzero(keep)
        coef = _fit_overhead([shapes[i] for i in idx], [phys[i] for i in idx], t[keep])
        pred = np.array([_predict(coef, s, ph) for s, ph in zip(shapes, phys)])
    rel = np.abs(pred - t)[keep] / t[keep]
    return FlooredStepTimer(
        model=model,
        gpu=gpu,
        precision=precision,
        coef=tuple(float(c) for c in coef),
        bandwidth_scale=bw_scale,
        flops_scale=flop_scale,
        max_rel_error=float(rel.max()),
        mean_rel_error=float(rel.mean()),
        num_dropped=int(len(t) - keep.sum()),
        region=CalibratedRegion.of(shapes),
    )


@dataclass
class RegionCheckingTimer:
    """Wraps a timer and counts the steps whose shape leaves a calibrated region."""

    inner: StepTimer
    region: CalibratedRegion
    num_steps: int = 0
    num_outside: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def __call__(self, shape: StepShape) -> float:
        self.num_steps += 1
        out = self.region.outside(shape)
        if out:
            self.num_outside += 1
            for r in out:
                self.reasons[r] = self.reasons.get(r, 0) + 1
        return self.inner(shape)

    def warning(self) -> str | None:
        if not self.num_outside:
            return None
        why = ", ".join(f"{k} ({v:,} steps)" for k, v in sorted(self.reasons.items()))
        return (
            f"warning: {self.num_outside:,} of {self.num_steps:,} simulated steps "
            f"({100 * self.num_outside / max(1, self.num_steps):.0f}%) leave the calibrated "
            f"region: {why}; their times rest on the roofline floor plus untested overhead "
            "terms (calibrate wider: `roofline bench calibrate`)"
        )


def timer_from_calibration(
    cal: Calibration, model: ModelConfig | None = None
) -> tuple[StepTimer, str | None]:
    """The step model of a calibration file, and a note when it cannot hold predictions to
    the floor. Version 2 files (ceilings and model config inside) give a
    :class:`FlooredStepTimer`; ``model`` supplies the config for files that lack it. Files
    without ceilings fall back to the whole-time fit, which extrapolates without a floor."""
    if model is None and cal.model_config:
        model = ModelConfig.from_dict(cal.model_config)
    if cal.ceilings and model is not None:
        ceil = cal.ceilings
        flops = float(ceil["matmul_flops_per_s"])
        if ceil.get("matmul_dtype") == "float32":
            flops *= 2  # GPUSpec derives its fp32 rate as half the 16-bit one
        gpu = custom_gpu(
            str(ceil.get("device_name") or cal.device or "calibrated"),
            float(ceil.get("memory_gib", 80.0)),
            float(ceil["bandwidth_bytes_per_s"]) / 1e9,
            flops / 1e12,
        )
        precision = Precision(**cal.precision) if cal.precision else BF16
        return fit_floored(cal.points, model, gpu, precision), None
    why = "no ceilings" if not cal.ceilings else "no model config (pass --model)"
    return fit_calibration(cal.points), (
        f"warning: this calibration has {why}: its whole-time fit has no roofline floor and "
        "may extrapolate below physics; recalibrate with `roofline bench calibrate`"
    )
