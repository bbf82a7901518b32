"""``roofline bench calibrate``: measure a designed set of step shapes for the planner.

A calibration fitted to one workload's steps knows nothing of the shapes it never saw. This
sweep measures the corners of the shape space in a bounded time, cheapest first, so that a
simulation of a workload unlike the calibration still interpolates:

* **decode grid**: batch sizes x context lengths (up to ``max_model_len``, as far as the KV
  pool holds the batch). Each request has its own context: requests sharing their pages would
  read them from L2 and time steps below the floor of real, distinct contexts (measured: 64
  requests x 8k shared tokens decoded at 1.7x the distinct-context HBM floor).
* **prefill**: single prompts of growing length (longer than the token budget: chunked, so
  chunks over a cached prefix are measured too) and steps of several short prompts.
* **mixed**: a prompt arriving while a batch decodes (the step shape of steady serving).
* **shared prefix**: a batch whose prompts share a long prefix through the prefix cache: its
  suffix chunks prefill over the cached prefix, and its decodes read the shared pages once per
  step (cascade attention), which the decode grid's own contexts never exercise.

Step times come from ``planner.validate.EngineStepper``: on CUDA, device events recorded as
each launch starts (a step's share of the pipelined run, whichever of host or device bound
it). The result is a version 2 calibration (:mod:`roofline.planner.calibration`): the
points, the ceilings measured in the same run, the model config, the precision and the build,
which ``roofline plan simulate --calibration`` turns into a step model held to the roofline
floor (``planner.step_model``).
"""

from __future__ import annotations

import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from roofline.bench.ceilings import Ceilings
from roofline.engine.heap import frozen_heap
from roofline.engine.llm_engine import LLMEngine
from roofline.planner.calibration import Calibration, CalibrationPoint
from roofline.planner.simulator import step_shape
from roofline.planner.validate import EngineStepper
from roofline.sampling_params import SamplingParams

DECODE_STEPS = 8
"""Tokens each request of a decode cell generates (its prefill steps are measured too)."""
SHARED_SUFFIX_LEN = 64


@dataclass(frozen=True)
class SweepPlan:
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    multi_prompt_counts: tuple[int, ...]
    mixed: tuple[tuple[int, int], ...]
    """``(decode batch, arriving prompt length)`` pairs."""
    shared: tuple[tuple[int, int], ...] = ()
    """``(batch, shared prefix length)`` pairs: prompts of the prefix plus
    :data:`SHARED_SUFFIX_LEN` tokens of their own."""


def _geometric(lo: int, hi: int, factor: int) -> list[int]:
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= factor
    return out + [hi]


def default_plan(engine: LLMEngine, max_batch: int | None = None, max_context: int | None = None):
    """A grid spanning the engine's limits: batch 1..max_num_seqs (x4), contexts 128 ..
    max_model_len (x4), prompts 16 .. 4 token budgets (x4)."""
    sc = engine.scheduler_config
    max_b = min(sc.max_num_seqs, max_batch or sc.max_num_seqs)
    max_c = min(sc.max_model_len - DECODE_STEPS - 2, max_context or sc.max_model_len)
    max_p = min(sc.max_model_len - 2, 4 * sc.max_num_batched_tokens, max_context or 1 << 30)
    batches = _geometric(1, max_b, 4)
    mid_b = batches[len(batches) // 2]
    arrivals = sorted({min(n, max_p) for n in (64, 512, sc.max_num_batched_tokens)})
    return SweepPlan(
        batch_sizes=tuple(batches),
        context_lens=tuple(_geometric(min(128, max_c), max_c, 4)),
        prefill_lens=tuple(_geometric(min(16, max_p), max_p, 4)),
        multi_prompt_counts=tuple(n for n in (4, 16) if n <= sc.max_num_seqs),
        mixed=tuple(
            (b, p)
            for b in sorted({min(4, max_b), mid_b, max_b})
            for p in arrivals
            if b + 1 <= sc.max_num_seqs
        ),
        shared=tuple(
            (b, min(2048, max_c - SHARED_SUFFIX_LEN - 16))
            for b in sorted({mid_b, max_b})
            if b >= 4 and max_c >= SHARED_SUFFIX_LEN + 48  # a prefix of two pages or more
        ),
    )


def _run(engine: LLMEngine, points: list[CalibrationPoint], after_step=None) -> None:
    """Step ``engine`` until idle and record every step it ran."""
    num_steps = 0
    with EngineStepper(engine) as stepper:
        while engine.has_unfinished_requests():
            num_steps += len(stepper.step())
            if after_step is not None:
                after_step(num_steps)
        for sched_out, dt in stepper.step_times():
            shape = step_shape(sched_out, engine.kv_manager.page_size)
            if shape.num_tokens:
                points.append(CalibrationPoint.from_shape(shape, dt))


def _ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(10, vocab - 10, n).tolist()


def run_sweep(
    engine: LLMEngine,
    plan: SweepPlan,
    time_budget_s: float = 170.0,
    log: Callable[[str], None] = print,
) -> tuple[list[CalibrationPoint], list[str]]:
    """Measure ``plan`` cheapest-first within ``time_budget_s``; the points and the cells that
    did not fit the budget."""
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    points: list[CalibrationPoint] = []
    greedy = dict(temperature=0.0, ignore_eos=True)
    counter = iter(range(1 << 30))

    def add(prompt: list[int], max_tokens: int) -> None:
        engine.add_request(
            f"cal-{next(counter)}", prompt, SamplingParams(max_tokens=max_tokens, **greedy)
        )

    def decode_cell(batch: int, context: int) -> None:
        # own contexts (shared pages would be read from L2); the first requests keep decoding
        # until the last one's prompt is in, so the full batch decodes DECODE_STEPS times
        sc = engine.scheduler_config
        max_tokens = DECODE_STEPS + 1 + -(-batch * context // sc.max_num_batched_tokens)
        context = min(context, sc.max_model_len - max_tokens)
        for _ in range(batch):
            add(_ids(rng, vocab, context), max_tokens)
        _run(engine, points)  # its prefill steps are measured points too

    def prefill_cell(length: int, count: int) -> None:
        for _ in range(count):
            add(_ids(rng, vocab, length), 1)
        _run(engine, points)

    mixed_context = min(512, engine.scheduler_config.max_model_len - DECODE_STEPS - 6)

    def mixed_cell(batch: int, prompt_len: int) -> None:
        for _ in range(batch):
            add(_ids(rng, vocab, mixed_context), DECODE_STEPS + 4)
        arrived: set[int] = set()

        def arrive(num_steps: int) -> None:
            for at in (3, 6):  # once the batch decodes
                if num_steps >= at and at not in arrived:
                    arrived.add(at)
                    add(_ids(rng, vocab, prompt_len), 1)

        _run(engine, points, after_step=arrive)

    def shared_cell(batch: int, prefix_len: int) -> None:
        # one prefix for all (prefix caching shares its pages); the first requests keep
        # decoding until the last one's suffix is in, so the full batch decodes together
        budget = engine.scheduler_config.max_num_batched_tokens
        max_tokens = DECODE_STEPS + 2 + -(-(prefix_len + batch * SHARED_SUFFIX_LEN) // budget)
        prefix = _ids(rng, vocab, prefix_len)
        for _ in range(batch):
            add(prefix + _ids(rng, vocab, SHARED_SUFFIX_LEN), max_tokens)
        _run(engine, points)

    pool_tokens = engine.runner.num_pages * engine.args.page_size
    cells: list[tuple[float, str, Callable[[], None]]] = []
    skipped: list[str] = []
    for b in plan.batch_sizes:
        for c in plan.context_lens:
            name = f"decode b={b} ctx={c}"
            if b * (c + DECODE_STEPS + engine.args.page_size) > 0.9 * pool_tokens:
                skipped.append(f"{name} (over the KV pool)")
                continue
            cells.append((b * c, name, lambda b=b, c=c: decode_cell(b, c)))
    for p in plan.prefill_lens:
        cells.append((p * 4.0, f"prefill {p}", lambda p=p: prefill_cell(p, 1)))
    for n in plan.multi_prompt_counts:
        cells.append((n * 64 * 4.0, f"prefill {n}x64", lambda n=n: prefill_cell(64, n)))
    for b, p in plan.mixed:
        cost = b * mixed_context + 4.0 * p
        cells.append((cost, f"mixed b={b}+{p}", lambda b=b, p=p: mixed_cell(b, p)))
    for b, p in plan.shared:
        if p + b * (SHARED_SUFFIX_LEN + DECODE_STEPS + 2 * engine.args.page_size) > pool_tokens:
            skipped.append(f"shared b={b} prefix={p} (over the KV pool)")
            continue
        cost = 4.0 * (p + b * SHARED_SUFFIX_LEN)
        cells.append((cost, f"shared b={b} prefix={p}", lambda b=b, p=p: shared_cell(b, p)))
    cells.sort(key=lambda cell: cell[0])

    start = time.perf_counter()
    with frozen_heap():
        prefill_cell(16, 2)  # warm-up, not recorded
        points.clear()
        for _, name, run in cells:
            if time.perf_counter() - start > time_budget_s:
                skipped.append(name)
                continue
            t0 = time.perf_counter()
            engine.kv_manager.reset_prefix_cache()
            run()
            log(f"  {name}: {time.perf_counter() - t0:.1f} s")
    return points, skipped


def build_info(engine: LLMEngine) -> dict:
    """What a calibration measured: versions, commit, device and engine settings."""
    import torch

    import roofline

    commit = None
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=Path(roofline.__file__).parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        pass
    args = engine.args
    return {
        "roofline": roofline.__version__,
        "git": commit,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "async_scheduling": engine.async_scheduling,
        "enforce_eager": bool(getattr(args, "enforce_eager", False)),
        "enable_prefix_caching": bool(args.enable_prefix_caching),
    }


def calibration_of(
    engine: LLMEngine, ceilings: Ceilings, points: list[CalibrationPoint], source: str, **meta
) -> Calibration:
    """A version 2 calibration of ``points`` measured on ``engine`` with ``ceilings``."""
    from roofline.bench.latency import precision_of

    sc = engine.scheduler_config
    memory_gib = 80.0
    if engine.runner.device.type == "cuda":
        import torch

        memory_gib = torch.cuda.get_device_properties(engine.runner.device).total_memory / 2**30
    ceil = dict(vars(ceilings), memory_gib=memory_gib)
    return Calibration(
        points,
        device=ceilings.device_name,
        model=engine.model_name,
        meta={
            "source": source,
            "num_pages": engine.runner.num_pages,
            "page_size": engine.args.page_size,
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_model_len": sc.max_model_len,
            **meta,
        },
        ceilings=ceil,
        model_config=dict(engine.model_config.hf_config),
        precision=asdict(precision_of(engine)),
        build=build_info(engine),
    )
