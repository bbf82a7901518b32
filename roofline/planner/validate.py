"""Checks the simulator against the real engine on the same hardware and workloads.

``trace_engine`` drives a real ``LLMEngine`` with synthetic requests on the wall clock (offline:
all at once; serving: each added when its Poisson arrival time passes) and records, for every
step, its :class:`StepShape` and wall time (``engine.step()`` includes the scheduler, the host
preparation and the sampled-token sync) and, for every request, when its tokens came out. A
trace is both a calibration (its steps are measured points) and a measured run (its requests
summarise exactly like a simulated run). ``validate`` calibrates on one workload, then runs a
different offline workload and a serving rate on the engine and in the simulator, and reports
throughput and TPOT p50 of both. ``python -m roofline.planner.validate --model smollm2``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from roofline.planner.calibration import (
    Calibration,
    CalibrationPoint,
    fit_calibration,
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
from roofline.planner.workload import LengthDist, SyntheticRequest, Workload
from roofline.sampling_params import SamplingParams


@dataclasses.dataclass
class Trace:
    points: list[CalibrationPoint]
    result: SimResult


def trace_engine(engine: Any, requests: list[SyntheticRequest], realtime: bool = True) -> Trace:
    """Run ``requests`` through ``engine`` and time every step (see the module docstring)."""
    seen: list[Any] = []

    def record(sched_out):  # the shape before the scheduler's update advances it
        seen.append((step_shape(sched_out), [s.request.request_id for s in sched_out.scheduled
                                             if s.samples]))  # fmt: skip

    engine.on_schedule = record
    reqs = sorted(requests, key=lambda r: r.arrival_time_s)
    metrics: dict[str, RequestMetrics] = {}
    max_tokens: dict[str, int] = {}
    points: list[CalibrationPoint] = []
    timeline: list[TimePoint] = []
    start = time.perf_counter()
    i = 0
    try:
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
            seen.clear()
            t0 = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            if not seen:
                continue
            shape, sampled = seen[-1]
            points.append(CalibrationPoint.from_shape(shape, t1 - t0))
            clock = t1 - start
            for rid in sampled:
                m = metrics[rid]
                m.num_output_tokens += 1
                if m.first_token_s is None:
                    m.first_token_s = clock
                if m.num_output_tokens == max_tokens[rid]:  # ignore_eos: length decides
                    m.finish_s = clock
            sch = engine.scheduler
            timeline.append(
                TimePoint(clock, t1 - t0, shape.num_tokens, sch.num_running, sch.num_waiting,
                          sch.kv_usage, sch.num_preemptions_total)
            )  # fmt: skip
    finally:
        engine.on_schedule = None
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
    row = {"workload": name}
    for key, m, s in (
        ("output_tok_s", measured.output_tokens_per_s, simulated.output_tokens_per_s),
        ("tpot_p50_ms", 1e3 * measured.tpot_s[50], 1e3 * simulated.tpot_s[50]),
        ("ttft_p50_ms", 1e3 * measured.ttft_s[50], 1e3 * simulated.ttft_s[50]),
    ):
        row[key] = {"measured": m, "simulated": s, "error": s / m - 1.0}
    return row


def validate(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    vocab = engine.model_config.vocab_size
    max_len = engine.scheduler_config.max_model_len

    def workload(n: int, prompt: str, output: str, rate: float | None, seed: int) -> Workload:
        return Workload(n, LengthDist.parse(prompt), LengthDist.parse(output), rate,
                        vocab_size=vocab, max_model_len=max_len, seed=seed)  # fmt: skip

    trace_engine(engine, workload(4, "64", "4", None, 99).requests(), realtime=False)  # warm-up
    cal_trace = trace_engine(
        engine, workload(args.num_requests, args.cal_prompt_len, args.cal_output_len, None, 1)
        .requests(), realtime=False,
    )  # fmt: skip
    fit = fit_calibration(cal_trace.points)
    sim = SimConfig(engine.scheduler_config, engine.runner.num_pages, engine.args.page_size,
                    engine.args.enable_prefix_caching)  # fmt: skip
    meta = {"num_pages": sim.num_pages, "page_size": sim.page_size,
            "max_num_seqs": sim.scheduler.max_num_seqs,
            "max_num_batched_tokens": sim.scheduler.max_num_batched_tokens}  # fmt: skip
    if args.calibration_out:
        save_calibration(
            args.calibration_out, Calibration(cal_trace.points, args.device_name, args.model, meta)
        )
    offline = workload(args.num_requests, args.prompt_len, args.output_len, None, 2)
    measured = summarize(trace_engine(engine, offline.requests(), realtime=False).result)
    rows = [_compare("offline", measured, summarize(simulate(offline, sim, fit)))]
    rate = args.rate or args.rate_fraction * measured.request_throughput
    online = dataclasses.replace(offline, request_rate=rate, seed=3)
    measured_online = summarize(trace_engine(engine, online.requests()).result)
    rows.append(_compare(f"serving {rate:.3g} req/s", measured_online,
                         summarize(simulate(online, sim, fit))))  # fmt: skip
    return {"device": args.device_name, "model": args.model, "fit": dataclasses.asdict(fit),
            "serving_rate": rate, "args": {k: v for k, v in vars(args).items()},
            "num_calibration_points": len(cal_trace.points), "kv": meta, "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--cal-prompt-len", default="uniform:16:1024")
    p.add_argument("--cal-output-len", default="uniform:8:256")
    p.add_argument("--prompt-len", default="uniform:128:512")
    p.add_argument("--output-len", default="uniform:32:160")
    p.add_argument("--rate", type=float, help="serving rate (default: a fraction of offline)")
    p.add_argument("--rate-fraction", type=float, default=0.6)
    p.add_argument("--calibration-out", help="write the calibration trace here")
    p.add_argument("--out", help="write the comparison as JSON here")
    args = p.parse_args(argv)

    import torch

    from roofline.engine.args import EngineArgs
    from roofline.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(
        model=args.model, device=args.device, load_format=args.load_format,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    ))  # fmt: skip
    dev = engine.runner.device
    args.device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    report = validate(engine, args)
    for row in report["rows"]:
        for key in ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms"):
            v = row[key]
            print(f"{row['workload']:>24}  {key:>12}  measured {v['measured']:10.2f}  "
                  f"simulated {v['simulated']:10.2f}  error {100 * v['error']:+6.1f}%")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
