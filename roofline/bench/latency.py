"""``roofline bench latency``: decode step time per batch size, against the step's roofline.

For each batch size, ``batch`` requests of ``input_len`` random tokens are prefilled, then every
decode step is timed (each step ends with the host reading the sampled ids, so wall time is the
step's time). The roofline of a step is the planner's: weights + KV read over the measured
copy bandwidth, or FLOPs over the measured matmul rate, whichever is larger.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass

from roofline.bench.ceilings import Ceilings
from roofline.core.outputs import SchedulerOutput
from roofline.engine.heap import frozen_heap
from roofline.engine.llm_engine import LLMEngine
from roofline.planner.calibration import CalibrationPoint
from roofline.planner.roofline import Precision, step_cost
from roofline.planner.simulator import step_shape
from roofline.sampling_params import SamplingParams

_DTYPE_NAMES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float8_e4m3fn": "fp8",
    "int8": "int8",
}


@dataclass
class LatencyRow:
    batch_size: int
    input_len: int
    output_len: int
    prefill_s: float
    step_ms_p50: float
    step_ms_p90: float
    output_tok_s: float
    roofline_step_ms: float
    roofline_pct: float
    bound: str


def precision_of(engine: LLMEngine) -> Precision:
    """The planner's precision of ``engine``: its weights (through the quantization config)
    and its KV pages as stored (``--kv-cache-dtype``: fp8 / int8 pages, scales counted)."""
    dt = _DTYPE_NAMES[str(engine.runner.dtype).removeprefix("torch.")]
    kv_spec = getattr(engine.runner, "kv_spec", None)
    kv = dt if kv_spec is None else _DTYPE_NAMES[str(kv_spec.page_dtype).removeprefix("torch.")]
    quant = getattr(engine.runner, "quant_config", None)
    if quant is None:
        return Precision(weight_dtype=dt, kv_dtype=kv)
    weight, gemm, group = quant.planner_precision()
    return Precision(weight_dtype=weight, kv_dtype=kv, compute_dtype=gemm, quant_group_size=group)


def run_batch(
    engine: LLMEngine,
    ceilings: Ceilings,
    batch_size: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    points: list[CalibrationPoint] | None = None,
) -> LatencyRow:
    """Time every step of ``batch_size`` requests; each step's shape and time is appended to
    ``points`` when given (the planner's calibration format)."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [f"lat-{batch_size}-{i}" for i in range(batch_size)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(10, vocab - 10) for _ in range(input_len)], params)
    scheduled: list[SchedulerOutput] = []  # shapes are computed after the run, not in a step
    if points is not None:
        engine.on_schedule = scheduled.append
    timed: list[tuple[SchedulerOutput, float]] = []
    started: set[str] = set()
    prefill_s, step_times = 0.0, []
    stats0 = engine.get_stats()
    try:
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if scheduled:
                timed.append((scheduled[-1], dt))
            if len(started) < batch_size:
                prefill_s += dt
                started.update(o.request_id for o in outs)
            else:
                step_times.append(dt)
    finally:
        engine.on_schedule = None
    if points is not None:
        page_size = engine.kv_manager.page_size
        points += [CalibrationPoint.from_shape(step_shape(so, page_size), dt) for so, dt in timed]
    stats1 = engine.get_stats()
    drafts = stats1.spec_decode_num_drafts_total - stats0.spec_decode_num_drafts_total
    emitted = (
        stats1.spec_decode_num_emitted_tokens_total - stats0.spec_decode_num_emitted_tokens_total
    )
    tokens_per_step = emitted / drafts if drafts else 1.0  # speculative: tokens per verification
    step_times = step_times[1:-1] or step_times  # the edges may hold ragged work
    p50 = statistics.median(step_times)
    p90 = sorted(step_times)[int(0.9 * (len(step_times) - 1))]
    mid_context = input_len + output_len // 2
    cost = step_cost(
        engine.model_config,
        ceilings.as_gpu_spec(),
        num_decode_tokens=batch_size,
        decode_context_lens=batch_size * mid_context,
        precision=precision_of(engine),
        tp=engine.args.tensor_parallel_size,
    )
    return LatencyRow(
        batch_size,
        input_len,
        output_len,
        prefill_s,
        1e3 * p50,
        1e3 * p90,
        batch_size * tokens_per_step / p50,
        1e3 * cost.time_s,
        100 * cost.time_s / p50,
        cost.bound,
    )


def run(
    engine: LLMEngine,
    ceilings: Ceilings,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    points: list[CalibrationPoint] | None = None,
) -> list[LatencyRow]:
    with frozen_heap():  # as LLM.generate and the server's engine core step
        run_batch(engine, ceilings, 1, min(input_len, 16), 4)  # warm-up
        return [
            run_batch(engine, ceilings, b, input_len, output_len, points=points)
            for b in batch_sizes
        ]


def format_rows(rows: list[LatencyRow]) -> str:
    head = (
        f"{'batch':>5} {'in':>5} {'out':>5} {'prefill s':>9} {'step ms p50':>11} "
        f"{'p90':>7} {'out tok/s':>10} {'roofline ms':>11} {'% roofline':>10} bound"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.batch_size:>5} {r.input_len:>5} {r.output_len:>5} {r.prefill_s:>9.3f} "
            f"{r.step_ms_p50:>11.2f} {r.step_ms_p90:>7.2f} {r.output_tok_s:>10.1f} "
            f"{r.roofline_step_ms:>11.2f} {r.roofline_pct:>9.1f}% {r.bound}"
        )
    return "\n".join(lines)


def as_dicts(rows: list[LatencyRow]) -> list[dict]:
    return [asdict(r) for r in rows]
