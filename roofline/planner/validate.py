"""Checks the simulator against the real engine on the same hardware and workloads.

``trace_engine`` drives a real ``LLMEngine`` with synthetic requests on the wall clock (offline:
all at once; serving: each added when its Poisson arrival time passes) and records, for every
step, its :class:`StepShape` and wall time (``engine.step()`` includes the scheduler, the host
preparation and the sampled-token sync) and, for every request, when its tokens came out. A
trace is both a calibration (its steps are measured points) and a measured run (its requests
summarise exactly like a simulated run). ``validate`` calibrates once (``bench calibrate``'s
designed sweep, or a given file), then runs a suite of workloads unlike the calibration
(:func:`suite`) on the engine and in the simulator, and reports output throughput, TPOT p50
and TTFT p50 of both against :data:`TARGETS`. ``roofline plan validate --model smollm2``
(or ``python -m roofline.planner.validate``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import numpy as np

from roofline.core.outputs import SchedulerOutput
from roofline.planner.calibration import (
    CalibrationPoint,
    StepTimer,
    load_calibration,
    save_calibration,
)
from roofline.planner.metrics import SimSummary, summarize
from roofline.planner.simulator import (
    RequestMetrics,
    SimConfig,
    SimResult,
    TimePoint,
    simulate,
    step_shape,
)
from roofline.planner.step_model import RegionCheckingTimer, timer_from_calibration
from roofline.planner.workload import LengthDist, SyntheticRequest, Workload
from roofline.sampling_params import SamplingParams


@dataclasses.dataclass
class Trace:
    points: list[CalibrationPoint]
    result: SimResult


class EngineStepper:
    """Steps an engine and times each scheduled step, also under async scheduling.

    With async scheduling a ``step()`` call schedules and launches step k, then waits for step
    k-1 and folds its tokens in, so a call's wall time belongs to no single step. On CUDA a
    timing event is recorded on the stream as each launch starts (``runner.launch`` wrapped)
    and whenever the engine goes idle: step k's time is the device time from the event before
    its kernels to the next one, i.e. ``max(its device time, the host's time to launch the
    next step)``, the step's real share of a pipelined run, whichever side bound it (an eager
    step whose Python launch is slower than the device, a launch that synchronises). Elsewhere
    (the CPU, stand-in engines) a step is charged its own host part up to its launch plus the
    rest of the call that completes it. ``step()`` returns the steps a call completed (oldest
    first) for token timestamps; :meth:`step_times` gives every completed step's time."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._launched: list[SchedulerOutput] = []
        self._t_sched: float | None = None
        self._t_launched: float | None = None
        self._pending: tuple[SchedulerOutput, float] | None = None  # launched, host seconds
        runner = getattr(engine, "runner", None)
        self._cuda = getattr(getattr(runner, "device", None), "type", None) == "cuda"
        self._marks: list[tuple[SchedulerOutput | None, Any]] = []  # (step or idle, event)
        self._wall: list[tuple[SchedulerOutput, float]] = []

    def __enter__(self) -> EngineStepper:
        self.engine.on_schedule = self._on_schedule
        runner = getattr(self.engine, "runner", None)
        launch = getattr(runner, "launch", None)
        if launch is not None:

            def timed_launch(sched_out: SchedulerOutput, *args: Any, **kwargs: Any) -> Any:
                if self._cuda:
                    self._mark(sched_out)
                try:
                    return launch(sched_out, *args, **kwargs)
                finally:
                    self._t_launched = time.perf_counter()

            runner.launch = timed_launch
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.on_schedule = None
        runner = getattr(self.engine, "runner", None)
        if runner is not None:
            vars(runner).pop("launch", None)  # the class's method again

    def _mark(self, sched_out: SchedulerOutput | None) -> None:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._marks.append((sched_out, event))

    def _on_schedule(self, sched_out: SchedulerOutput) -> None:
        self._launched.append(sched_out)
        self._t_sched = time.perf_counter()

    def step(self) -> list[tuple[SchedulerOutput, float]]:
        """One ``engine.step()``: the steps it completed with their wall-split times."""
        self._launched.clear()
        self._t_sched = self._t_launched = None
        t0 = time.perf_counter()
        self.engine.step()
        t1 = time.perf_counter()
        launched = self._launched[-1] if self._launched else None
        t_sched = self._t_sched if self._t_sched is not None else t0
        done: list[tuple[SchedulerOutput, float]] = []
        if getattr(self.engine, "_in_flight", None) is not None:  # overlapped
            t_launched = self._t_launched if self._t_launched is not None else t_sched
            if self._pending is not None:
                so, host_s = self._pending
                done.append((so, host_s + t1 - t_launched))
            self._pending = (launched, t_launched - t0) if launched is not None else None
        else:  # the earlier step drained first, then this one ran start to end
            if self._pending is not None:
                so, host_s = self._pending
                done.append((so, host_s + t_sched - t0))
            if launched is not None:
                done.append((launched, t1 - t_sched))
            self._pending = None
            if self._cuda:
                self._mark(None)  # the device's work ends here until the next launch
        self._wall.extend(done)
        return done

    def step_times(self) -> list[tuple[SchedulerOutput, float]]:
        """Every completed step and its time (device events on CUDA, wall split elsewhere)."""
        if not self._cuda:
            return list(self._wall)
        import torch

        torch.cuda.synchronize()
        return [
            (so, start.elapsed_time(end) / 1e3)
            for (so, start), (_, end) in zip(self._marks, self._marks[1:])
            if so is not None
        ]


def trace_engine(engine: Any, requests: list[SyntheticRequest], realtime: bool = True) -> Trace:
    """Run ``requests`` through ``engine`` and time every step (see the module docstring)."""
    reqs = sorted(requests, key=lambda r: r.arrival_time_s)
    metrics: dict[str, RequestMetrics] = {}
    max_tokens: dict[str, int] = {}
    points: list[CalibrationPoint] = []
    timeline: list[TimePoint] = []
    start = time.perf_counter()
    i = 0
    with EngineStepper(engine) as stepper:
        while i < len(reqs) or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while i < len(reqs) and (not realtime or reqs[i].arrival_time_s <= now):
                r, rid = reqs[i], f"v{i}"
                params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
                engine.add_request(rid, list(r.prompt_token_ids), params)
                # the true arrival time, not when the loop got round to adding it
                arrival = r.arrival_time_s if realtime else 0.0
                metrics[rid] = RequestMetrics(rid, arrival, len(r.prompt_token_ids))
                max_tokens[rid] = r.max_tokens
                i += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, reqs[i].arrival_time_s - (time.perf_counter() - start)))
                continue
            done = stepper.step()
            if not done:
                continue
            clock = time.perf_counter() - start
            for sched_out, _ in done:
                for s in sched_out.scheduled:
                    if not s.samples or s.request.request_id not in metrics:
                        continue
                    m = metrics[s.request.request_id]
                    m.num_output_tokens += 1
                    if m.first_token_s is None:
                        m.first_token_s = clock
                    if m.num_output_tokens == max_tokens[m.request_id]:  # ignore_eos
                        m.finish_s = clock
            sch = engine.scheduler
            timeline.append(
                TimePoint(clock, sum(dt for _, dt in done), sched_out.num_batched_tokens,
                          sch.num_running, sch.num_waiting, sch.kv_usage,
                          sch.num_preemptions_total)
            )  # fmt: skip
        for sched_out, dt in stepper.step_times():
            shape = step_shape(sched_out, engine.kv_manager.page_size)
            if shape.num_tokens:
                points.append(CalibrationPoint.from_shape(shape, dt))
    stats = engine.get_stats()
    result = SimResult(
        list(metrics.values()),
        timeline,
        engine.scheduler.num_preemptions_total,
        stats.prefix_cache_hits_total,
        stats.prefix_cache_queries_total,
    )
    return Trace(points, result)


def _compare(name: str, measured: SimSummary, simulated: SimSummary) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": name}
    for key, m, sim in (
        ("output_tok_s", measured.output_tokens_per_s, simulated.output_tokens_per_s),
        ("tpot_p50_ms", 1e3 * measured.tpot_s[50], 1e3 * simulated.tpot_s[50]),
        ("ttft_p50_ms", 1e3 * measured.ttft_s[50], 1e3 * simulated.ttft_s[50]),
    ):
        row[key] = {"measured": m, "simulated": sim, "error": sim / m - 1.0 if m else 0.0}
    return row


TARGETS = {"output_tok_s": 0.15, "tpot_p50_ms": 0.15, "ttft_p50_ms": 0.25}
"""The largest |error| each figure may show (issue 19's targets)."""


@dataclasses.dataclass(frozen=True)
class SuiteCase:
    name: str
    workload: Workload
    serving_fraction: float | None = None
    """Serving: arrivals at this fraction of the request rate the offline run sustained."""


def suite(vocab_size: int, max_model_len: int, scale: float = 1.0) -> list[SuiteCase]:
    """Workloads unlike any calibration: short requests, long prompts, long outputs, a shared
    prefix, issue 3's mixed offline workload, and serving near saturation. ``scale`` shrinks
    the request counts (and prompts/outputs clip to ``max_model_len``) for slow devices."""

    def n(k: int) -> int:
        return max(4, int(round(k * scale)))

    def wl(num, prompt, output, seed, **kw) -> Workload:
        return Workload(
            num,
            LengthDist.parse(prompt),
            LengthDist.parse(output),
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            seed=seed,
            **kw,
        )

    q = max(32, max_model_len // 4)  # lengths shrink with short contexts (slow devices)
    long_prompt = max(16, min(8000, max_model_len - 160))
    prefix = max(16, min(2000, max_model_len - 64 - 128 - 16))
    short = f"uniform:16:{min(256, q)}"
    long_out = f"uniform:{min(512, q)}:{min(1024, 2 * q)}"
    mixed = wl(n(256), f"uniform:{min(100, q // 2)}:{min(1024, 2 * q)}", str(min(512, q)), 14)
    return [
        SuiteCase("short requests", wl(n(1000), short, short, 11)),
        SuiteCase("long prompts", wl(n(16), str(long_prompt), "128", 12)),
        SuiteCase("long outputs", wl(n(64), f"uniform:{min(64, q)}:{min(256, q)}", long_out, 13)),
        SuiteCase(
            "shared prefix",
            wl(n(256), str(prefix + 64), "128", 15, prefix_len=prefix, prefix_fraction=1.0),
        ),
        SuiteCase("mixed 100-1024 / 512", mixed),
        SuiteCase("serving at 80% of saturation", dataclasses.replace(mixed, seed=16), 0.8),
    ]


def _step_model_sums(model: StepTimer, points: list[CalibrationPoint]) -> dict[str, list]:
    """Per kind of step (holding a prefill chunk, decode only): [number of steps, measured
    seconds, predicted seconds] over the engine's own steps: which kind a workload's error
    comes from, weighted by time (a median over many decode steps hides a few long ones)."""
    sums: dict[str, list] = {}
    for p in points:
        shape = p.shape()
        entry = sums.setdefault("prefill" if shape.prefill_chunks else "decode", [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += p.step_time_s
        entry[2] += model(shape)
    return sums


def run_suite(engine: Any, timer: StepTimer, cases: list[SuiteCase], log=print) -> list[dict]:
    """Each case on the engine and in the simulator (same scheduler limits and KV pool)."""
    sim = SimConfig(engine.scheduler_config, engine.runner.num_pages, engine.args.page_size,
                    engine.args.enable_prefix_caching,
                    async_scheduling=bool(getattr(engine, "async_scheduling", False)))  # fmt: skip
    rows = []
    offline_rps: float | None = None
    for case in cases:
        work = case.workload
        if case.serving_fraction is not None:
            if offline_rps is None:
                raise ValueError("a serving case needs an offline case before it")
            work = dataclasses.replace(work, request_rate=case.serving_fraction * offline_rps)
        engine.kv_manager.reset_prefix_cache()
        t0 = time.perf_counter()
        trace = trace_engine(engine, work.requests(), realtime=work.request_rate is not None)
        measured = summarize(trace.result)
        offline_rps = measured.request_throughput if work.request_rate is None else offline_rps
        name = (
            case.name if work.request_rate is None else f"{case.name} ({work.request_rate:.3g}/s)"
        )
        simulated = simulate(work, sim, timer)
        row = _compare(name, measured, summarize(simulated))
        # where an error comes from: the step model on the engine's own steps, and the number
        # of steps the engine and the simulator took (scheduling differences)
        model = getattr(timer, "inner", timer)
        ratios = [model(p.shape()) / p.step_time_s for p in trace.points]
        row["step_model_error_p50"] = float(np.median(ratios)) - 1.0 if ratios else 0.0
        row["step_model_by_kind"] = _step_model_sums(model, trace.points)
        row["engine_steps"], row["simulated_steps"] = len(trace.points), simulated.num_steps
        rows.append(row)
        log(f"  {name}: measured in {time.perf_counter() - t0:.1f} s")
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'workload':<34} {'figure':<13} {'measured':>11} {'simulated':>11} {'error':>8}"]
    for row in rows:
        if "engine_steps" in row:
            lines.append(
                f"{row['workload']:<34} steps: engine {row['engine_steps']:,}, simulator "
                f"{row['simulated_steps']:,}; step model on the engine's steps "
                f"{100 * row['step_model_error_p50']:+.1f}% (median)"
            )
            kinds = [
                f"{kind} {n:,} steps {measured:.2f} s -> {100 * (predicted / measured - 1):+.1f}%"
                for kind, (n, measured, predicted) in row.get("step_model_by_kind", {}).items()
                if measured > 0
            ]
            if kinds:
                lines.append(f"{row['workload']:<34} step model by kind: " + "; ".join(kinds))
        for key, bound in TARGETS.items():
            v = row[key]
            mark = "" if abs(v["error"]) <= bound else f"  (over {100 * bound:.0f}%)"
            lines.append(
                f"{row['workload']:<34} {key:<13} {v['measured']:>11.2f} {v['simulated']:>11.2f} "
                f"{100 * v['error']:>+7.1f}%{mark}"
            )
    return "\n".join(lines)


def validate(engine: Any, args: argparse.Namespace, log=print) -> dict[str, Any]:
    """Calibrate once (the designed sweep, or ``args.calibration``), then predict the suite."""
    from roofline.bench.calibrate import calibration_of, default_plan, run_sweep
    from roofline.bench.ceilings import measure

    trace_engine(
        engine,
        Workload(
            4,
            LengthDist.parse("64"),
            LengthDist.parse("4"),
            vocab_size=engine.model_config.vocab_size,
        ).requests(),
        realtime=False,
    )  # fmt: skip  (warm-up)
    if args.calibration:
        cal = load_calibration(args.calibration)
    else:
        ceilings = measure(engine.runner.device, engine.runner.dtype)
        plan = default_plan(engine, args.max_batch, args.max_context)
        t0 = time.perf_counter()
        points, skipped = run_sweep(engine, plan, args.time_budget, log)
        log(f"calibration: {len(points)} steps in {time.perf_counter() - t0:.0f} s")
        cal = calibration_of(engine, ceilings, points, "roofline plan validate", skipped=skipped)
        if args.calibration_out:
            save_calibration(args.calibration_out, cal)
    timer, note = timer_from_calibration(cal, engine.model_config)
    if note:
        log(note)
    region = getattr(timer, "region", None)
    checked = RegionCheckingTimer(timer, region) if region is not None else timer
    cases = suite(engine.model_config.vocab_size, engine.scheduler_config.max_model_len,
                  args.scale)  # fmt: skip
    rows = run_suite(engine, checked, cases, log)
    warning = checked.warning() if isinstance(checked, RegionCheckingTimer) else None
    return {"device": cal.device, "model": engine.model_name, "ceilings": cal.ceilings,
            "build": cal.build, "num_calibration_points": len(cal.points),
            "fit": {k: v for k, v in dataclasses.asdict(timer).items()
                    if k not in ("model", "gpu")} if region is not None else None,
            "region_warning": warning, "rows": rows}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    from roofline.engine.args import EngineArgs

    p.add_argument("--model", default="smollm2", help="folder, .gguf, short or config name")
    EngineArgs.add_cli_args(p)
    p.add_argument("--calibration", help="predict from this calibration instead of sweeping")
    p.add_argument("--calibration-out", help="write the sweep's calibration here")
    p.add_argument("--time-budget", type=float, default=170.0, help="seconds for the sweep")
    p.add_argument("--max-batch", type=int, help="cap the sweep's decode batch sizes")
    p.add_argument("--max-context", type=int, help="cap the sweep's contexts and prompts")
    p.add_argument("--scale", type=float, default=1.0, help="shrink the suite's request counts")
    p.add_argument("--out", help="write the comparison as JSON here")


def run_cli(args: argparse.Namespace) -> int:
    from roofline.engine.args import EngineArgs
    from roofline.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    report = validate(engine, args)
    print(format_rows(report["rows"]))
    if report["region_warning"]:
        print(report["region_warning"])
    failed = sum(
        abs(row[k]["error"]) > bound for row in report["rows"] for k, bound in TARGETS.items()
    )
    print(f"{failed} of {len(report['rows']) * len(TARGETS)} figures outside their target")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
