"""The simulator commands of ``roofline plan``: ``simulate`` (one run, a rate sweep, or the
replica count for a load at an SLO), ``validate`` (registered here, run by
``planner.validate``) and ``fit`` (a calibration file's step-time fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from roofline.config import SchedulerConfig
from roofline.planner import cli as c
from roofline.planner.calibration import (
    CalibrationPoint,
    FittedStepTimer,
    RooflineStepTimer,
    StepTimer,
    fit_calibration,
    load_calibration,
)
from roofline.planner.memory import plan_memory
from roofline.planner.metrics import (
    SLO,
    SimSummary,
    SweepRow,
    reaches_steady_state,
    replicas_needed,
    summarize,
    sweep_rates,
)
from roofline.planner.roofline import step_cost
from roofline.planner.simulator import SimConfig, simulate
from roofline.planner.spec_sim import SpecSimConfig
from roofline.planner.step_model import (
    FlooredStepTimer,
    RegionCheckingTimer,
    timer_from_calibration,
)
from roofline.planner.workload import LengthDist, Workload

CUDA_MAX_NUM_BATCHED_TOKENS = 8192
"""The engine's token budget on CUDA (``EngineArgs``), the simulator's default without a
calibration that says what the measured engine used."""


def _timer(args: argparse.Namespace) -> tuple[StepTimer, dict, str]:
    """The step-time model, the calibration's meta (empty for the roofline) and a label."""
    if args.calibration:
        c.reject_mla(args, "with --calibration (the measured engine's own KV is the model's)")
        cal = load_calibration(args.calibration)
        model = c.model_of(args)[1] if (args.model or args.layers) else None
        fit, note = timer_from_calibration(cal, model)
        if note:
            print(note)
        label = f"calibration {os.path.basename(args.calibration)} ({cal.device or '?'})"
        meta = dict(cal.meta)
        if cal.build and "async_scheduling" in cal.build:
            meta["async_scheduling"] = bool(cal.build["async_scheduling"])
        if isinstance(fit, FlooredStepTimer):
            label += ", roofline floor + fitted overhead"
            return RegionCheckingTimer(fit, fit.region), meta, label
        return fit, meta, label
    _, model = c.model_of(args)
    gpu = c.gpu_of(args)
    layout = c.kv_layout_of(args, model)
    timer = RooflineStepTimer(
        model, gpu, c.precision_of(args), args.tp, args.overhead_ms * 1e-3, layout
    )
    return timer, {}, f"roofline on {gpu.name}"


def _sim_config(args: argparse.Namespace, meta: dict) -> SimConfig:
    page_size = args.page_size or int(meta.get("page_size", 16))
    num_pages = args.num_pages or meta.get("num_pages")
    if num_pages is None:
        _, model = c.model_of(args)
        prec = c.precision_of(args)
        plan = plan_memory(
            model, c.gpu_of(args), args.max_model_len, prec.weight_dtype, prec.kv_dtype,
            args.util, page_size=page_size, tp=args.tp, kv_layout=c.kv_layout_of(args, model),
        )  # fmt: skip
        if not plan.fits:
            raise ValueError("the model leaves no KV pool on this GPU: raise --tp or --util")
        num_pages = plan.num_pages
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs or int(meta.get("max_num_seqs", 256)),
        max_num_batched_tokens=(
            args.max_num_batched_tokens
            or int(meta.get("max_num_batched_tokens", CUDA_MAX_NUM_BATCHED_TOKENS))
        ),
        max_model_len=args.max_model_len,
        policy=args.policy,
        enable_chunked_prefill=not args.no_chunked_prefill,
    )
    spec = None
    if args.speculative:
        try:
            fields = json.loads(args.speculative)
            spec = SpecSimConfig(**fields)
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(
                f"--speculative wants a JSON object of SpecSimConfig fields "
                f"(num_speculative_tokens, acceptance_rate, draft_cost_ratio, max_batch_size, "
                f"seed, adaptive, host_s, host_per_request_s): {e}"
            ) from None
    # the engine's CUDA default; a calibration says what the measured engine did
    async_scheduling = not args.sync_scheduling and bool(meta.get("async_scheduling", True))
    return SimConfig(
        sched, int(num_pages), page_size, not args.no_prefix_caching, spec, async_scheduling
    )


def _summary_rows(s: SimSummary) -> list[list[str]]:
    def pcts(d: dict[int, float], scale: float = 1e3) -> str:
        return " / ".join(f"{v * scale:,.1f}" for v in d.values())

    return [
        ["requests / steps", f"{s.num_requests:,} / {s.num_steps:,}"],
        ["duration (simulated)", f"{s.duration_s:,.2f} s"],
        ["throughput", f"{s.request_throughput:,.2f} req/s, {s.output_tokens_per_s:,.0f} "
                       f"output tok/s, {s.total_tokens_per_s:,.0f} total tok/s"],
        ["TTFT p50 / p90 / p99", pcts(s.ttft_s) + " ms"],
        ["TPOT p50 / p90 / p99", pcts(s.tpot_s) + " ms"],
        ["E2E p50 / p90 / p99", pcts(s.e2e_s, 1.0) + " s"],
        ["SLO attainment / goodput", f"{100 * s.slo_attainment:.1f}% / {s.goodput_rps:,.2f} req/s"],
        ["preemptions", f"{s.num_preemptions:,}"],
        ["KV usage peak / mean", f"{100 * s.peak_kv_usage:.1f}% / {100 * s.mean_kv_usage:.1f}%"],
        ["mean running", f"{s.mean_running:,.1f}"],
        ["prefix hit rate", f"{100 * s.prefix_hit_rate:.1f}%"],
    ]  # fmt: skip


def _warn_short(args: argparse.Namespace, points: list[tuple[float | None, SimSummary]]) -> None:
    short = [r for r, s in points if not reaches_steady_state(s, args.num_requests, r)]
    if short:
        rates = ", ".join(f"{r:g}" for r in short if r is not None)
        print(f"warning: at {rates} req/s arrivals end within 5 request lifetimes; the run "
              "mostly measures filling and draining: raise --num-requests")  # fmt: skip


def _sweep_rows(rows: list[SweepRow]) -> list[list[str]]:
    out = []
    for r in rows:
        s = r.summary
        out.append(
            [
                f"{r.x:g}",
                f"{s.request_throughput:,.2f}",
                f"{s.output_tokens_per_s:,.0f}",
                c.ms(s.ttft_s[50]),
                c.ms(s.ttft_s[99]),
                c.ms(s.tpot_s[50]),
                c.ms(s.tpot_s[99]),
                f"{100 * s.slo_attainment:.1f}%",
                f"{s.goodput_rps:,.2f}",
                f"{s.num_preemptions:,}",
            ]
        )
    return out


_SWEEP_HEADERS = ["req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "SLO met",
                  "goodput", "preempt"]  # fmt: skip


def _warn_region(timer: StepTimer) -> None:
    if isinstance(timer, RegionCheckingTimer) and (msg := timer.warning()):
        print(msg)


def cmd_simulate(args: argparse.Namespace) -> int:
    timer, meta, label = _timer(args)
    sim = _sim_config(args, meta)
    vocab = c.model_of(args)[1].vocab_size if (args.model or args.layers) else 32000
    workload = Workload(
        num_requests=args.num_requests,
        prompt_len=LengthDist.parse(args.prompt_len),
        output_len=LengthDist.parse(args.output_len),
        request_rate=args.rate,
        prefix_len=args.prefix_len,
        prefix_fraction=args.prefix_fraction,
        vocab_size=vocab,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    slo = SLO(
        ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms * 1e-3,
        tpot_s=None if args.slo_tpot_ms is None else args.slo_tpot_ms * 1e-3,
        e2e_s=args.slo_e2e_s,
    )
    rate = "offline" if args.rate is None else f"{args.rate:g} req/s"
    print(f"{label}; {sim.num_pages:,} KV pages x {sim.page_size}; max_num_seqs "
          f"{sim.scheduler.max_num_seqs}, token budget {sim.scheduler.max_num_batched_tokens}; "
          f"prompt {workload.prompt_len}, output {workload.output_len}")  # fmt: skip
    if args.plot_dir:
        os.makedirs(args.plot_dir, exist_ok=True)
    if args.rates:
        rows = sweep_rates(workload, c.parse_float_list(args.rates), sim, timer, slo)
        c.print_table(["rate", *_SWEEP_HEADERS], _sweep_rows(rows), "\nrate sweep (ms)")
        _warn_short(args, [(r.x, r.summary) for r in rows])
        _warn_region(timer)
        if args.plot_dir:
            from roofline.planner.plots import plot_sweep

            plot_sweep(rows, os.path.join(args.plot_dir, "sweep_rates.png"), "request rate (req/s)")
        return 0
    if args.replicas_for_rate:
        plan = replicas_needed(
            workload, args.replicas_for_rate, sim, timer, slo, args.target_attainment,
            args.max_replicas,
        )  # fmt: skip
        c.print_table(
            ["replicas", *_SWEEP_HEADERS],
            _sweep_rows(plan.rows),
            f"\nreplicas for {args.replicas_for_rate:g} req/s (per-replica metrics, ms)",
        )
        _warn_short(args, [(args.replicas_for_rate / r.x, r.summary) for r in plan.rows])
        _warn_region(timer)
        gpus = "" if plan.num_replicas is None else f" = {plan.num_replicas * args.tp} GPU(s)"
        print(f"\nreplicas needed for {100 * args.target_attainment:g}% within the SLO: "
              f"{plan.num_replicas or f'more than {args.max_replicas}'}{gpus}")  # fmt: skip
        if args.plot_dir:
            from roofline.planner.plots import plot_sweep

            plot_sweep(plan.rows, os.path.join(args.plot_dir, "sweep_replicas.png"), "replicas")
        return 0
    result = simulate(workload, sim, timer)
    summary = summarize(result, slo)
    if sim.speculative is not None:
        mode = "adaptive switch" if sim.speculative.adaptive else "always on"
        print(f"speculative: {result.spec_tokens_per_verification:.2f} tokens per verification "
              f"row (k = {sim.speculative.num_speculative_tokens}, acceptance "
              f"{sim.speculative.acceptance_rate:g}); {mode}: "
              f"{result.spec_step_share:.0%} of steps speculated")  # fmt: skip
    c.print_table(["", "value"], _summary_rows(summary), f"\n{args.num_requests} requests, {rate}")
    _warn_short(args, [(args.rate, summary)])
    _warn_region(timer)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dataclasses.asdict(summary), f, indent=1)
    if args.plot_dir:
        from roofline.planner.plots import plot_latency_cdf, plot_timeline

        plot_timeline(result, os.path.join(args.plot_dir, "timeline.png"), f"{label}, {rate}")
        plot_latency_cdf(result, os.path.join(args.plot_dir, "latency_cdf.png"))
        print(f"plots written to {args.plot_dir}/")
    return 0


def _cmd_fit_floored(cal, fit: FlooredStepTimer) -> int:
    where = f"{cal.device or 'unknown device'}, {cal.model or 'unknown model'}"
    rows = [  # seconds for the host terms, multiples of a floor component for the rest
        [name, f"{v * 1e6:,.2f} us" if name.endswith("_s") else f"{v:.3f} x"]
        for name, v in fit.terms().items()
    ]
    c.print_table(["overhead term", "value"], rows, f"fit above the roofline floor, "
                  f"{len(cal.points)} steps ({where})")  # fmt: skip
    gpu = fit.gpu
    print(
        f"floor ceilings: {gpu.hbm_bandwidth_bytes_per_s / 1e9:,.0f} GB/s, "
        f"{gpu.peak_flops_per_s(fit.precision.gemm_dtype) / 1e12:,.1f} TFLOP/s "
        f"(raised x{fit.bandwidth_scale:.2f} / x{fit.flops_scale:.2f} where steps beat them); "
        f"relative error: mean {100 * fit.mean_rel_error:.1f}%, max "
        f"{100 * fit.max_rel_error:.1f}% ({fit.num_dropped} stalled steps left out)"
    )
    r = fit.region
    print(
        f"calibrated region: decode batch <= {r.max_decode_tokens}, mean context <= "
        f"{r.max_mean_context_len}, prefill tokens per step <= {r.max_prefill_tokens}, "
        f"cached prefix <= {r.max_cached_prefix_len}"
    )
    rows = []
    for p in cal.points:
        shape = p.shape()
        floor, pred = fit.floor(shape), fit(shape)
        rows.append([p.num_decode_tokens, f"{p.decode_context_len_sum:,}", p.num_prefill_tokens,
                     c.ms(p.step_time_s), c.ms(floor), c.ms(pred),
                     f"{100 * (pred / p.step_time_s - 1):+.1f}%",
                     f"{100 * floor / p.step_time_s:.0f}%"])  # fmt: skip
    headers = ["decode", "ctx sum", "prefill", "measured ms", "floor ms", "model ms", "error",
               "of roofline"]  # fmt: skip
    c.print_table(headers, rows, "")
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    c.reject_mla(args, "by plan fit (the measured engine's own KV is the model's)")
    cal = load_calibration(args.calibration)
    model = c.model_of(args)[1] if (args.model or args.layers) else None
    floored, _ = timer_from_calibration(cal, model)
    if isinstance(floored, FlooredStepTimer):
        return _cmd_fit_floored(cal, floored)
    fit: FittedStepTimer = fit_calibration(cal.points)
    names = [
        "intercept",
        "per decode token",
        "per context token",
        "per prefill token",
        "per 1k prefill pairs",
        "per decode token in a mixed step",
        "per prefill chunk",
    ]
    coefs = [fit.intercept_s, *fit.coef_s[:3], fit.coef_s[3] * 1e3, *fit.coef_s[4:]]
    rows = [[n, f"{v * 1e6:,.4f}"] for n, v in zip(names, coefs, strict=True)]
    where = f"{cal.device or 'unknown device'}, {cal.model or 'unknown model'}"
    c.print_table(["term", "us"], rows, f"fit of {len(cal.points)} steps ({where})")
    print(
        f"relative error: mean {100 * fit.mean_rel_error:.1f}%, max {100 * fit.max_rel_error:.1f}%"
        f" ({fit.num_dropped} stalled steps left out)"
    )
    roof = None
    if args.model or args.layers:
        _, model = c.model_of(args)
        gpu, prec = c.gpu_of(args), c.precision_of(args)
        roof = (model, gpu, prec)
    rows = []
    for p in cal.points:
        row = [p.num_decode_tokens, f"{p.decode_context_len_sum:,}", p.num_prefill_tokens,
               c.ms(p.step_time_s), c.ms(fit.predict_point(p)),
               f"{100 * (fit.predict_point(p) / p.step_time_s - 1):+.1f}%"]  # fmt: skip
        if roof is not None:
            rt = _roofline_of_point(p, *roof)
            row += [c.ms(rt), f"{100 * rt / p.step_time_s:.0f}%"]
        rows.append(row)
    headers = ["decode", "ctx sum", "prefill", "measured ms", "fit ms", "fit err"]
    if roof is not None:
        headers += ["roofline ms", "of roofline"]
    c.print_table(headers, rows, "")
    return 0


def _roofline_of_point(p: CalibrationPoint, model, gpu, prec) -> float:
    return step_cost(
        model, gpu, p.num_decode_tokens, p.decode_context_len_sum, p.num_prefill_tokens,
        precision=prec,
    ).time_s  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="discrete-event serving simulation (real scheduler)")
    c.add_model_args(p, required=False)
    c.add_gpu_args(p)
    c.add_precision_args(p)
    p.add_argument(
        "--calibration",
        help="step times from a calibration file (`roofline bench calibrate`, or `bench latency "
        "--calibration-out`) instead of the roofline",
    )
    p.add_argument("--overhead-ms", type=float, default=0.0, help="roofline: fixed per-step cost")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--util", type=float, default=0.9)
    p.add_argument("--num-pages", type=int, help="KV pool (default: calibration or memory plan)")
    p.add_argument("--page-size", type=int, help="default: the calibration's, else 16")
    p.add_argument("--max-num-seqs", type=int, help="default: the calibration's, else 256")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="token budget per step (default: the calibration's, else 8192, the engine's on CUDA)",
    )
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--sync-scheduling",
        action="store_true",
        help="an engine that schedules each step after the previous one ends (default: as the "
        "calibration measured, else async scheduling, the engine's CUDA default: an arrival "
        "waits one step longer)",
    )
    p.add_argument(
        "--speculative",
        default=None,
        help='speculative decoding, JSON: {"num_speculative_tokens": 4, "acceptance_rate": 0.7, '
        '"draft_cost_ratio": 0.1, "max_batch_size": 32, "adaptive": true} (adaptive: the '
        "engine's switch decides each step, default)",
    )
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=500)
    g.add_argument("--rate", type=float, help="Poisson req/s (default: offline, all at t=0)")
    g.add_argument("--prompt-len", default="uniform:128:1024", help="N, uniform:A:B, normal:M:S, "
                   "lognormal:M:S, exp:M")  # fmt: skip
    g.add_argument("--output-len", default="uniform:64:512")
    g.add_argument("--prefix-len", type=int, default=0, help="shared prompt prefix tokens")
    g.add_argument("--prefix-fraction", type=float, default=0.0, help="requests sharing it")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("SLO, sweeps and output")
    g.add_argument("--slo-ttft-ms", type=float)
    g.add_argument("--slo-tpot-ms", type=float)
    g.add_argument("--slo-e2e-s", type=float)
    g.add_argument("--rates", help="sweep these request rates, e.g. 1,2,4,8")
    g.add_argument("--replicas-for-rate", type=float, help="replicas needed for this total rate")
    g.add_argument("--target-attainment", type=float, default=0.99)
    g.add_argument("--max-replicas", type=int, default=64)
    g.add_argument("--plot-dir", help="write PNG plots here")
    g.add_argument("--json", help="write the summary of a single run here")
    p.set_defaults(plan_func=cmd_simulate)

    from roofline.planner import validate

    p = sub.add_parser(
        "validate",
        help="calibrate once, then predict a suite of unlike workloads and compare with the engine",
    )
    validate.add_arguments(p)
    p.set_defaults(plan_func=validate.run_cli)

    p = sub.add_parser("fit", help="fit a calibration file; compare with the roofline")
    p.add_argument("--calibration", required=True)
    c.add_model_args(p, required=False)
    c.add_gpu_args(p)
    c.add_precision_args(p)
    p.set_defaults(plan_func=cmd_fit)
