"""``roofline bench throughput``: an offline workload through ``LLM.generate``, against the
workload's roofline.

The roofline of a workload is the time an ideal engine would need on this machine: every prompt
token's FLOPs at the measured matmul rate, plus every decode step with all unfinished requests
batched together (weights once per step, each request's KV once) at the measured bandwidth,
whichever bound each step hits. A prefix common to every prompt is prefilled and read once per
step (what prefix caching and shared-prefix attention allow), and under tensor parallelism each
step's bytes and FLOPs are split over the ranks, with the all-reduces added.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from roofline.bench.ceilings import Ceilings
from roofline.bench.latency import precision_of
from roofline.bench.workloads import Workload
from roofline.core.outputs import SchedulerOutput
from roofline.entrypoints.llm import LLM
from roofline.kernels import count_jit_compiles
from roofline.planner.roofline import Precision, step_cost
from roofline.sampling_params import SamplingParams


@dataclass
class ThroughputResult:
    workload: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    output_tok_s: float
    total_tok_s: float
    roofline_s: float
    roofline_pct: float
    num_preemptions: int = 0
    """Preemptions (recompute) during the run: KV pressure the roofline does not count."""
    max_running: int = 0
    """The most requests running in one step."""
    host_fraction: float = 0.0
    """Share of the engine's step time not spent waiting for the device: near 1, the device
    waited for the host (scheduling, inputs, outputs) instead."""
    jit_compiles: list[str] = field(default_factory=list)
    """Triton kernels specialized during the run (each should have been warmed up at start)."""


def workload_roofline_s(
    model_config,
    ceilings: Ceilings,
    workload: Workload,
    precision: Precision,
    max_num_seqs: int,
    tp: int = 1,
) -> float:
    spec = ceilings.as_gpu_spec()
    shared = workload.shared_prefix_len
    total = 0.0
    for i, prompt in enumerate(workload.prompts):  # prefill: compute-bound, one at a time
        cached = shared if i else 0  # later prompts find the common prefix cached
        cost = step_cost(
            model_config,
            spec,
            prefill_chunks=[(len(prompt) - cached, cached)],
            precision=precision,
            tp=tp,
        )
        total += cost.compute_time_s + cost.comm_time_s
    # decode: requests in arrival order, at most max_num_seqs at once, all batched per step
    pending = list(zip((len(p) for p in workload.prompts), workload.output_lens))
    running: list[list[int]] = []  # [context_len, tokens_left]
    while pending or running:
        while pending and len(running) < max_num_seqs:
            ctx, out = pending.pop(0)
            if out > 1:
                running.append([ctx + 1, out - 1])  # the first token comes from the prefill
        if not running:
            continue
        # the common prefix's KV is read once per step, each request's own part once each;
        # every query still attends its whole context (the prefix's FLOPs count per request)
        cost = step_cost(
            model_config,
            spec,
            num_decode_tokens=len(running),
            decode_context_lens=sum(c for c, _ in running),
            precision=precision,
            tp=tp,
            decode_shared_tokens=(len(running) - 1) * shared,
        )
        total += cost.time_s
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    return total


def run(
    llm: LLM,
    ceilings: Ceilings,
    workload: Workload,
    use_tqdm: bool = True,
    observe: Callable[[SchedulerOutput], None] | None = None,
) -> ThroughputResult:
    """``observe``, if given, sees each step's ``SchedulerOutput`` before it runs (as
    ``LLMEngine.on_schedule``; the GPU scripts time steps by kind with it)."""
    engine = llm.llm_engine
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    llm.generate([workload.prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    preempted = engine.scheduler.num_preemptions_total
    max_running = 0

    def watch(sched_out: SchedulerOutput) -> None:
        nonlocal max_running
        max_running = max(max_running, engine.scheduler.num_running)
        if observe is not None:
            observe(sched_out)

    engine.on_schedule = watch
    timing0 = dataclasses.replace(engine.step_timing)
    start = time.perf_counter()
    try:
        with count_jit_compiles() as compiled:
            outs = llm.generate(workload.prompts, params, use_tqdm=use_tqdm)
    finally:
        engine.on_schedule = None
    elapsed = time.perf_counter() - start
    timing = engine.step_timing.since(timing0)
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    prompt_tokens = sum(len(p) for p in workload.prompts)
    ideal = workload_roofline_s(
        engine.model_config,
        ceilings,
        workload,
        precision_of(engine),
        engine.scheduler_config.max_num_seqs,
        tp=engine.args.tensor_parallel_size,
    )
    return ThroughputResult(
        workload.name,
        workload.num_requests,
        elapsed,
        prompt_tokens,
        out_tokens,
        out_tokens / elapsed,
        (out_tokens + prompt_tokens) / elapsed,
        ideal,
        100 * ideal / elapsed,
        engine.scheduler.num_preemptions_total - preempted,
        max_running,
        timing.host_fraction,
        compiled,
    )
