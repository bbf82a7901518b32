"""The calculator commands of ``roofline plan``: gpus, kv, memory, decode, parallel, cost and
specdec. Each turns its arguments into library calls and prints tables; no arithmetic lives here.
"""

from __future__ import annotations

import argparse

from roofline.planner import cli as c
from roofline.planner.cost import (
    continuous_batching_waste,
    cost_per_million_tokens,
    static_batching_waste,
)
from roofline.planner.hardware import DTYPE_BYTES, GPUS
from roofline.planner.latency import crossover_batch_size, decode_point, estimate_latency
from roofline.planner.memory import (
    kv_bytes,
    kv_bytes_per_token,
    max_context_len_for_batch,
    plan_memory,
    weight_bytes,
)
from roofline.planner.models import resolve_model
from roofline.planner.moe import expected_experts_touched
from roofline.planner.parallel import plan_parallel
from roofline.planner.roofline import step_cost
from roofline.planner.specdec import optimal_draft_length, roofline_speedup
from roofline.planner.workload import LengthDist


def cmd_gpus(args: argparse.Namespace) -> int:
    rows = [
        [
            key,
            g.name,
            f"{g.memory_bytes / c.GiB:.0f}",
            f"{g.hbm_bandwidth_bytes_per_s / 1e12:.3g}",
            f"{g.bf16_flops_per_s / 1e12:,.0f}",
            "-" if g.fp8_flops_per_s is None else f"{g.fp8_flops_per_s / 1e12:,.0f}",
            f"{g.ridge_point_flops_per_byte():.0f}",
            g.interconnect,
        ]
        for key, g in GPUS.items()
    ]
    headers = ["gpu", "name", "GiB", "TB/s", "bf16 TF", "fp8 TF", "FLOP/B", "interconnect"]
    c.print_table(headers, rows, "datasheet figures (dense peaks)")
    return 0


def cmd_kv(args: argparse.Namespace) -> int:
    name, model = c.model_of(args)
    layout = c.kv_layout_of(args, model)
    dtypes = (
        ["fp32", "fp16", "bf16", "fp8", "int8", "int4"]
        if args.kv_dtype == "all"
        else [args.kv_dtype]
    )
    rows = []
    for dt in dtypes:
        per_tok = kv_bytes_per_token(layout, dt, args.tp)
        seq = kv_bytes(layout, args.context, dt, tp=args.tp)
        batch = kv_bytes(layout, args.context, dt, args.batch, args.page_size, args.tp)
        rows.append(
            [dt, f"{per_tok:,.0f}", f"{per_tok / 1024:,.1f}", f"{seq / 1e9:,.3f}", c.gib(seq),
             c.gib(batch)]
        )  # fmt: skip
    title = (
        f"KV cache of {name} ({layout.attention_kind}, {layout.num_layers} layers, "
        f"{layout.elements_per_token_per_layer(args.tp)} elements/token/layer), "
        f"context {args.context}, batch {args.batch}"
        + (f", per rank of TP={args.tp}" if args.tp > 1 else "")
    )
    headers = ["kv dtype", "B/token", "KiB/token", "GB/seq", "GiB/seq", f"GiB/batch {args.batch}"]
    c.print_table(headers, rows, title)
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    name, model = c.model_of(args)
    gpu = c.gpu_of(args)
    rows = [
        [dt, c.gib(weight_bytes(model, dt, tp=args.tp).total)]
        for dt in ("fp32", "bf16", "fp8", "int8", "int4")
    ]
    title = f"{name}: {model.num_params() / 1e9:.2f}B params"
    if model.num_experts:  # MoE: what one token reads, and the experts a batch touches
        e, k = model.num_experts, model.num_experts_per_tok
        touched = ", ".join(
            f"B={b}: {expected_experts_touched(e, k, b):.1f}" for b in (1, 8, 32, 128)
        )
        title += (
            f" ({model.num_active_params() / 1e9:.2f}B active per token; {model.num_experts} "
            f"experts, top-{model.num_experts_per_tok}; experts touched per layer {touched})"
        )
    c.print_table(["weights", "GiB/GPU"], rows, title)
    reserve = None if args.reserve_gib is None else args.reserve_gib * c.GiB
    plan = plan_memory(
        model, gpu, args.context, args.weight_dtype, args.kv_dtype, args.util, reserve,
        args.page_size, args.tp, args.pp, c.kv_layout_of(args, model),
    )  # fmt: skip
    rows = [
        ["GPU memory", c.gib(plan.gpu_memory_bytes) + " GiB"],
        [f"usable at {args.util:.0%}", c.gib(plan.usable_bytes) + " GiB"],
        [f"weights ({args.weight_dtype})", c.gib(plan.weight_bytes) + " GiB"],
        ["activation reserve", c.gib(plan.reserve_bytes) + " GiB"],
        ["KV pool", c.gib(plan.kv_pool_bytes) + " GiB"],
        [f"KV per token ({args.kv_dtype})", f"{plan.kv_bytes_per_token / 1024:,.1f} KiB"],
        ["KV pages", f"{plan.num_pages:,} x {plan.page_size} tokens"],
        [f"max sequences at {args.context} tokens", f"{plan.max_num_seqs:,}"],
        [f"max context at batch {args.batch}", f"{max_context_len_for_batch(plan, args.batch):,}"],
    ]
    grid = f", TP={args.tp} PP={args.pp} (per GPU)" if args.tp * args.pp > 1 else ""
    c.print_table(["", "value"], rows, f"\n{name} on {gpu.name}{grid}")
    if not plan.fits:
        print("does not fit: use more GPUs (plan parallel) or fewer bytes (--weight-dtype)")
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    name, model = c.model_of(args)
    gpu, prec = c.gpu_of(args), c.precision_of(args)
    layout = c.kv_layout_of(args, model)
    plan = plan_memory(
        model, gpu, args.context, prec.weight_dtype, prec.kv_dtype, tp=args.tp, kv_layout=layout
    )
    rows = []
    for b in c.parse_int_list(args.batch_sizes):
        pt = decode_point(model, gpu, b, args.context, prec, args.tp, layout)
        rows.append(
            [b, c.ms(pt.step_time_s), f"{pt.tokens_per_s:,.0f}", f"{pt.tokens_per_s_per_seq:,.1f}",
             f"{pt.cost.arithmetic_intensity:,.1f}", pt.cost.bound,
             f"{100 * pt.kv_fraction_of_bytes:.0f}%", "yes" if b <= plan.max_num_seqs else "no"]
        )  # fmt: skip
    title = (
        f"decode roofline: {name} on {gpu.name}, weights {prec.weight_dtype}, KV "
        f"{prec.kv_dtype}, context {args.context}" + (f", TP={args.tp}" if args.tp > 1 else "")
    )
    headers = ["batch", "step ms", "tok/s", "tok/s/seq", "FLOP/B", "bound", "KV bytes", "fits"]
    c.print_table(headers, rows, title)
    ridge = gpu.ridge_point_flops_per_byte(prec.gemm_dtype)
    for ctx in sorted({1, args.context}):
        b = crossover_batch_size(model, gpu, ctx, prec, args.tp, layout)
        if b is None:
            print(f"context {ctx}: never compute-bound (per-token KV bytes outweigh its FLOPs)")
        else:
            print(f"context {ctx}: compute-bound from batch {b:,.0f} (ridge {ridge:.0f} FLOP/B)")
    est = estimate_latency(
        model, gpu, args.prompt_len, args.output_len, args.batch, args.max_num_batched_tokens,
        prec, args.tp, layout,
    )  # fmt: skip
    print(
        f"batch {args.batch}, prompt {args.prompt_len}, output {args.output_len}: "
        f"TTFT {c.ms(est.ttft_s)} ms, TPOT {c.ms(est.tpot_s)} ms, E2E {est.e2e_s:.2f} s, "
        f"{est.output_tokens_per_s:,.0f} output tok/s"
    )
    return 0


def cmd_parallel(args: argparse.Namespace) -> int:
    name, model = c.model_of(args)
    gpu, prec = c.gpu_of(args), c.precision_of(args)
    layout = c.kv_layout_of(args, model)
    rows = []
    for pp in c.parse_int_list(args.pp_list):
        for tp in c.parse_int_list(args.tp_list):
            try:
                pl = plan_parallel(
                    model, gpu, tp, pp, args.context, prec.weight_dtype, prec.kv_dtype, args.util,
                    kv_layout=layout,
                )  # fmt: skip
            except ValueError as e:
                print(f"TP={tp} PP={pp}: {e}")
                continue
            step = step_cost(model, gpu, 1, args.context, precision=prec, tp=tp, kv_layout=layout)
            token_s = step.time_s + pl.p2p_per_token_s
            rows.append(
                [tp, pp, tp * pp, c.gib(pl.memory.weight_bytes),
                 f"{pl.memory.kv_bytes_per_token / 1024:,.1f}", c.gib(pl.memory.kv_pool_bytes),
                 f"{pl.memory.max_num_seqs:,}", f"{pl.allreduce_per_layer_s * 1e6:,.1f}",
                 c.ms(pl.allreduce_per_token_s), c.ms(token_s), f"{1 / token_s:,.1f}"]
            )  # fmt: skip
    headers = ["TP", "PP", "GPUs", "weights GiB", "KV KiB/tok", "KV pool GiB", "max seqs",
               "AR/layer us", "AR/token ms", "token ms", "tok/s (b=1)"]  # fmt: skip
    title = f"{name} on {gpu.name} ({gpu.interconnect}), per GPU, context {args.context}"
    c.print_table(headers, rows, title)
    return 0


def cmd_cost(args: argparse.Namespace) -> int:
    tps = args.tokens_per_s
    source = "given"
    if tps is None:
        if not (args.model or args.layers):
            raise ValueError(
                "give --tokens-per-s, or --model or explicit dimensions (and --gpu) to use the "
                "roofline"
            )
        name, model = c.model_of(args)
        gpu, prec = c.gpu_of(args), c.precision_of(args)
        pt = decode_point(
            model, gpu, args.batch, args.context, prec, args.tp, c.kv_layout_of(args, model)
        )
        tps = pt.tokens_per_s
        source = f"roofline decode, {name} on {gpu.name}, batch {args.batch}"
    gpus = args.tp * args.num_replicas
    total = tps * args.num_replicas
    usd = cost_per_million_tokens(args.price, total, gpus)
    print(f"{total:,.0f} tok/s ({source}) on {gpus} GPU(s) at ${args.price:.2f}/GPU-hour: "
          f"${usd:.3f} per million tokens")  # fmt: skip
    dist = LengthDist.parse(args.output_len)
    lengths = dist.samples(args.num_requests, args.seed)
    rows = []
    for label, w in (
        ("static", static_batching_waste(lengths, args.batch)),
        ("continuous", continuous_batching_waste(lengths, args.batch)),
    ):
        rows.append([label, f"{w.num_steps:,}", f"{100 * w.waste_fraction:.1f}%",
                     f"${usd / w.utilization:.3f}"])  # fmt: skip
    title = f"\nbatching waste: {args.num_requests} requests, output {dist}, batch {args.batch}"
    c.print_table(["batching", "decode steps", "idle slots", "$/M useful tok"], rows, title)
    return 0


def cmd_specdec(args: argparse.Namespace) -> int:
    verify = args.verify_cost if args.verify_cost is not None else 1.0
    choice = optimal_draft_length(args.alpha, args.cost_ratio, args.max_k, verify)
    rows = [[k, f"{e:.3f}", f"{s:.3f}", "<- best" if k == choice.best_k else ""]
            for k, e, s in choice.curve]  # fmt: skip
    title = (f"speculative decoding, acceptance {args.alpha}, draft/target cost "
             f"{args.cost_ratio}, verification {verify:g} target steps")  # fmt: skip
    c.print_table(["k", "tokens/step", "speedup", ""], rows, title)
    near = choice.near_optimal(args.tolerance)
    print(f"best k = {choice.best_k} ({choice.best_speedup:.2f}x); within "
          f"{args.tolerance:.0%} of it: k = {near[0]}..{near[-1]}")  # fmt: skip
    if args.model:
        from roofline.spec_decode.step_costs import SPEC_HOST_PER_REQUEST_S, SPEC_HOST_S

        c.reject_mla(args, "by plan specdec")
        _, target = c.model_of(args)
        draft = resolve_model(args.draft_model) if args.draft_model else None
        gpu, prec = c.gpu_of(args), c.precision_of(args)
        timer, label = None, f"roofline on {gpu.name}"
        if args.calibration:
            from roofline.planner.calibration import load_calibration
            from roofline.planner.step_model import timer_from_calibration

            timer, note = timer_from_calibration(load_calibration(args.calibration), target)
            label = f"calibration {args.calibration}"
            if note:
                print(note)
        k = args.k if args.k is not None else choice.best_k
        rows = []
        for b in c.parse_int_list(args.batch_sizes):
            host = (args.spec_host_ms * 1e-3 if args.spec_host_ms is not None
                    else SPEC_HOST_S + SPEC_HOST_PER_REQUEST_S * b)  # fmt: skip
            r = roofline_speedup(target, draft, gpu, args.alpha, k, b, args.context, prec,
                                 timer=timer, spec_host_s=host)  # fmt: skip
            rows.append([b, c.ms(r.target_step_s), c.ms(r.draft_step_s), c.ms(r.verify_step_s),
                         c.ms(r.host_s), f"{r.verify_cost:.2f}", f"{r.cost_ratio:.3f}",
                         f"{r.speedup:.2f}"])  # fmt: skip
        c.print_table(
            ["batch", "target ms", "draft ms", "verify ms", "host ms", "verify/target",
             "draft/target", "speedup"],
            rows,
            f"\n{label}, k={k}, context {args.context} (verification: b x (1 + k) rows, "
            "KV read once per request; host: the synchronous step's)",
        )  # fmt: skip
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpus", help="the GPU datasheet table")
    p.set_defaults(plan_func=cmd_gpus)

    p = sub.add_parser("kv", help="KV cache bytes per token / sequence / batch")
    c.add_model_args(p)
    p.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        dest="kv_dtype",
        default="all",
        help=f"{', '.join(DTYPE_BYTES)} or all",
    )
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--page-size", type=int, default=16, help="round the batch to whole pages")
    p.add_argument("--tp", type=int, default=1, help="per rank of this tensor-parallel degree")
    p.set_defaults(plan_func=cmd_kv)

    p = sub.add_parser("memory", help="weights, KV pool, max sequences, max context")
    c.add_model_args(p)
    c.add_gpu_args(p)
    c.add_precision_args(p)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64, help="batch for the max-context row")
    p.add_argument("--util", type=float, default=0.9, help="GPU memory utilisation")
    p.add_argument("--reserve-gib", type=float, help="activation reserve (default: estimate)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.set_defaults(plan_func=cmd_memory)

    p = sub.add_parser("decode", help="decode roofline per batch size, TTFT and TPOT")
    c.add_model_args(p)
    c.add_gpu_args(p)
    c.add_precision_args(p)
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256,512")
    p.add_argument("--context", type=int, default=1024, help="tokens each decode attends to")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="batch of the TTFT/TPOT estimate")
    p.add_argument("--max-num-batched-tokens", type=int, help="prefill chunk budget")
    p.set_defaults(plan_func=cmd_decode)

    p = sub.add_parser("parallel", help="tensor / pipeline parallel memory and all-reduce time")
    c.add_model_args(p)
    c.add_gpu_args(p)
    c.add_precision_args(p)
    p.add_argument("--tp-list", default="1,2,4,8")
    p.add_argument("--pp-list", default="1")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--util", type=float, default=0.9)
    p.set_defaults(plan_func=cmd_parallel)

    p = sub.add_parser("cost", help="cost per million tokens; static vs continuous batching")
    c.add_model_args(p, required=False)
    c.add_gpu_args(p)
    c.add_precision_args(p)
    p.add_argument("--price", type=float, required=True, help="price per GPU-hour")
    p.add_argument("--tokens-per-s", type=float, help="measured throughput of one replica")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tp", type=int, default=1, help="GPUs per replica")
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument("--output-len", default="lognormal:256:256", help="output length spec")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(plan_func=cmd_cost)

    p = sub.add_parser("specdec", help="speculative decoding speedup and best draft length")
    c.add_model_args(p, required=False)
    c.add_gpu_args(p)
    c.add_precision_args(p)
    p.add_argument("--alpha", type=float, default=0.8, help="per-token acceptance rate")
    p.add_argument("--cost-ratio", type=float, default=0.05, help="draft / target step time")
    p.add_argument("--max-k", type=int, default=16)
    p.add_argument("--tolerance", type=float, default=0.02, help="'flat' band around the best")
    p.add_argument(
        "--verify-cost",
        type=float,
        help="verification step / plain step (measured; default 1: memory-bound target)",
    )
    p.add_argument(
        "--draft-model", help="with --model: the draft's steps priced by its roofline (default: "
        "free proposals, n-gram)"
    )  # fmt: skip
    p.add_argument("--batch-sizes", default="1,8,32,128")
    p.add_argument("--context", type=int, default=1024, help="tokens per request")
    p.add_argument("--k", type=int, help="proposals per step of the per-batch table (default: "
                   "the best k above)")  # fmt: skip
    p.add_argument(
        "--calibration",
        help="with --model: price steps with this calibration's step model (roofline bench "
        "calibrate) instead of the roofline",
    )
    p.add_argument(
        "--spec-host-ms",
        type=float,
        help="host time of a synchronous speculative step (default: the engine's prior, "
        "0.6 ms + 0.045 ms per request)",
    )
    p.set_defaults(plan_func=cmd_specdec)
