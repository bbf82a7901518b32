"""``roofline bench latency | throughput | serve | kernels | calibrate | quality``.

Every figure is printed beside the roofline measured in the same run (copy bandwidth and matmul
rate of this machine) and, with ``--compare``, beside peers run on the same weights in the same
process. ``--record FILE`` appends the result, the device, the date and the command to FILE.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys

import torch

from roofline.engine.args import EngineArgs


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_range(text: str) -> tuple[int, int]:
    """``N`` or ``LO:HI`` -> (lo, hi)."""
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="folder, .gguf, short name or config name")
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    p.add_argument("--record", default=None, help="append a markdown record to this file")
    EngineArgs.add_cli_args(p)


def add_cli(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks against the roofline")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    from roofline.bench.quality import add_cli as add_quality

    add_quality(sub)
    lat = sub.add_parser("latency", help="decode step time per batch size")
    _common(lat)
    lat.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32, 128])
    lat.add_argument("--input-len", type=int, default=512)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument(
        "--calibration-out",
        default=None,
        help="write every step's shape and time here for `roofline plan simulate`",
    )
    lat.set_defaults(func=cmd_latency)
    cal = sub.add_parser(
        "calibrate", help="measure a designed set of step shapes for `roofline plan simulate`"
    )
    _common(cal)
    cal.add_argument("--calibration-out", required=True, help="the calibration file to write")
    cal.add_argument("--time-budget", type=float, default=170.0, help="seconds for the sweep")
    cal.add_argument("--max-batch", type=int, default=None, help="cap the decode batch sizes")
    cal.add_argument("--max-context", type=int, default=None, help="cap contexts and prompts")
    cal.set_defaults(func=cmd_calibrate)
    thr = sub.add_parser("throughput", help="offline throughput of a workload")
    _common(thr)
    thr.add_argument(
        "--dataset",
        default="synthetic",
        help="synthetic, chat (built-in questions, chat template) or a .jsonl path",
    )
    thr.add_argument(
        "--preset",
        default=None,
        choices=sorted(workloads_presets()),
        help="a named workload (overrides --dataset and the lengths): "
        + "; ".join(f"{k}: {v}" for k, v in workloads_presets().items()),
    )
    thr.add_argument("--num-prompts", type=int, default=256)
    thr.add_argument("--input-len", type=parse_range, default=(100, 1024), help="N or LO:HI")
    thr.add_argument("--output-len", type=parse_range, default=(512, 512), help="N or LO:HI")
    thr.add_argument("--compare", default="", help="comma list of peers: hf, hf-batch, llamacpp")
    thr.add_argument("--hf-batch-size", type=int, default=16)
    thr.set_defaults(func=cmd_throughput)
    from roofline.bench.serve import add_cli as add_serve

    add_serve(sub)
    ker = sub.add_parser("kernels", help="Triton kernel micro-benchmarks (CUDA)")
    ker.add_argument("rest", nargs=argparse.REMAINDER)
    ker.set_defaults(
        func=lambda ns: __import__("roofline.bench.kernels").bench.kernels.main(ns.rest)
    )


def workloads_presets() -> dict[str, str]:
    from roofline.bench.workloads import PRESETS

    return PRESETS


def _engine_llm(ns: argparse.Namespace):
    from roofline.entrypoints.llm import LLM

    args = EngineArgs.from_cli_args(ns)
    kwargs = {k: v for k, v in vars(args).items() if k != "model"}
    return LLM(ns.model, **kwargs)


def _ceilings(llm):
    from roofline.bench.ceilings import measure

    runner = llm.llm_engine.runner
    c = measure(runner.device, runner.dtype)
    print(
        f"[{c.device_name}: copy {c.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
        f"{c.matmul_dtype} matmul {c.matmul_flops_per_s / 1e12:.2f} TFLOP/s]"
    )
    return c


def _record(ns: argparse.Namespace, title: str, body: str, device: str) -> None:
    if not ns.record:
        return
    cmd = "roofline " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    date = datetime.date.today().isoformat()
    with open(ns.record, "a") as f:
        f.write(f"\n### {title} ({date}, {device})\n\n`{cmd}`\n\n```\n{body}\n```\n")


def cmd_latency(ns: argparse.Namespace) -> int:
    from roofline.bench import latency

    llm = _engine_llm(ns)
    ceilings = _ceilings(llm)
    points: list = []
    rows = latency.run(
        llm.llm_engine, ceilings, ns.batch_sizes, ns.input_len, ns.output_len, points=points
    )
    if ns.calibration_out:
        from roofline.bench.calibrate import calibration_of
        from roofline.planner.calibration import save_calibration

        cal = calibration_of(
            llm.llm_engine, ceilings, points, "roofline bench latency", batch_sizes=ns.batch_sizes
        )
        save_calibration(ns.calibration_out, cal)
        print(f"[{len(points)} calibration points written to {ns.calibration_out}]")
    table = latency.format_rows(rows)
    if llm.llm_engine.spec is not None:
        table += "\n" + llm.llm_engine.spec.stats.summary()
    print(table)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"ceilings": vars(ceilings), "rows": latency.as_dicts(rows)}, f, indent=1)
    _record(ns, f"latency, {llm.llm_engine.model_name}", table, ceilings.device_name)
    return 0


def cmd_throughput(ns: argparse.Namespace) -> int:
    from roofline.bench import throughput, workloads

    llm = _engine_llm(ns)
    engine = llm.llm_engine
    if ns.preset is not None:
        wl = workloads.preset(ns.preset, engine.model_config.vocab_size, seed=ns.seed)
    elif ns.dataset == "synthetic":
        wl = workloads.synthetic(
            ns.num_prompts,
            ns.input_len,
            ns.output_len,
            engine.model_config.vocab_size,
            seed=ns.seed,
        )
    elif ns.dataset == "chat":
        wl = workloads.chat(engine.tokenizer, ns.num_prompts, ns.output_len[1])
    else:
        wl = workloads.jsonl(ns.dataset, engine.tokenizer, ns.output_len[1], ns.num_prompts)
    ceilings = _ceilings(llm)
    res = throughput.run(llm, ceilings, wl)
    lines = [
        f"workload: {res.workload} ({res.prompt_tokens} prompt / "
        f"{res.output_tokens} output tokens)",
        f"roofline: {res.elapsed_s:.2f} s, {res.output_tok_s:.1f} output tok/s, "
        f"{res.total_tok_s:.1f} total tok/s, {res.roofline_pct:.1f}% of the workload roofline "
        f"({res.roofline_s:.2f} s); at most {res.max_running} running, "
        f"{res.num_preemptions} preemptions; host work {100 * res.host_fraction:.0f}% of "
        "step time",
    ]
    if res.jit_compiles:
        lines.append(
            f"warning: {len(res.jit_compiles)} Triton kernel specializations compiled during "
            f"the run ({', '.join(sorted(set(res.jit_compiles)))}): the start-up warm-up "
            "missed them"
        )
    if engine.spec is not None:
        lines.append(engine.spec.stats.summary())
    results = {"roofline": vars(res), "ceilings": vars(ceilings)}
    for peer in [p for p in ns.compare.split(",") if p]:
        pr = _run_peer(peer, llm, wl, ns)
        results[peer] = {"output_tok_s": pr.output_tok_s, "elapsed_s": pr.elapsed_s}
        lines.append(
            f"{pr.name}: {pr.elapsed_s:.2f} s, {pr.output_tok_s:.1f} output tok/s; "
            f"roofline is {res.output_tok_s / pr.output_tok_s:.2f}x"
        )
    text = "\n".join(lines)
    print(text)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)
    _record(ns, f"throughput, {engine.model_name}", text, ceilings.device_name)
    return 0


def cmd_calibrate(ns: argparse.Namespace) -> int:
    import time

    from roofline.bench.calibrate import calibration_of, default_plan, run_sweep
    from roofline.planner.calibration import save_calibration
    from roofline.planner.step_model import timer_from_calibration

    llm = _engine_llm(ns)
    engine = llm.llm_engine
    ceilings = _ceilings(llm)
    plan = default_plan(engine, ns.max_batch, ns.max_context)
    print(
        f"[sweep: batches {list(plan.batch_sizes)} x contexts {list(plan.context_lens)}, "
        f"prompts {list(plan.prefill_lens)}, mixed {list(plan.mixed)}; "
        f"budget {ns.time_budget:.0f} s]"
    )
    t0 = time.perf_counter()
    points, skipped = run_sweep(engine, plan, ns.time_budget)
    cal = calibration_of(engine, ceilings, points, "roofline bench calibrate", skipped=skipped)
    save_calibration(ns.calibration_out, cal)
    timer, _ = timer_from_calibration(cal)
    print(
        f"[{len(points)} steps in {time.perf_counter() - t0:.0f} s written to "
        f"{ns.calibration_out}; fit above the roofline floor: mean error "
        f"{100 * timer.mean_rel_error:.1f}%, max {100 * timer.max_rel_error:.1f}%]"
    )
    if skipped:
        print(f"[over the time budget, not measured: {', '.join(skipped)}]")
    return 0


def _run_peer(peer: str, llm, wl, ns: argparse.Namespace):
    from roofline.bench import peers

    engine = llm.llm_engine
    if peer in ("hf", "hf-batch"):
        model = peers.hf_model_from_engine(engine)
        result = (
            peers.hf_generate(model, wl, ns.hf_batch_size)
            if peer == "hf"
            else peers.hf_generate_batch(model, wl)
        )
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return result
    if peer == "llamacpp":
        from roofline.models.weights import resolve_model

        src = resolve_model(ns.model)
        if src.kind != "gguf":
            raise ValueError("the llama.cpp peer needs a GGUF model")
        return peers.llamacpp(str(src.path), wl)
    raise ValueError(f"unknown peer {peer!r} (hf, hf-batch, llamacpp)")
