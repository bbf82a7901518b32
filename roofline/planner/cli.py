"""``roofline plan``: the capacity planner and serving simulator on the command line.

``add_cli(subparsers)`` registers ``plan`` with one sub-command per calculator (``gpus``, ``kv``,
``memory``, ``decode``, ``parallel``, ``cost``, ``specdec``) plus ``simulate``, ``validate`` and
``fit``; each prints a plain-text table. The shared argument groups (model, GPU, precision)
and their resolution live here; the commands live in ``cli_calc`` and ``cli_sim``. ``main(argv)``
runs the planner alone: ``python -m roofline.planner.cli kv --model llama-3.1-8b``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from roofline.config import ModelConfig
from roofline.planner.hardware import GPUS, GPUSpec, custom_gpu, get_gpu
from roofline.planner.memory import KVLayout
from roofline.planner.models import known_model_names, model_from_dims, resolve_model
from roofline.planner.roofline import Precision

GiB = float(1 << 30)


# ----------------------------------------------------------------- argument groups


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_argument_group("model (a name, a config.json, or explicit dimensions)")
    g.add_argument("--model", help=f"short name ({', '.join(known_model_names())}) or path")
    for flag, what in (
        ("--layers", "decoder layers"),
        ("--hidden", "hidden size"),
        ("--heads", "attention heads"),
        ("--kv-heads", "KV heads (1 = MQA; default = heads)"),
        ("--intermediate", "MLP intermediate size"),
        ("--vocab", "vocabulary size"),
        ("--head-dim", "head dim (default hidden / heads)"),
    ):
        g.add_argument(flag, type=int, help=what)
    g.add_argument("--tied", action="store_true", help="tied embeddings (explicit dims)")
    g.add_argument("--mla-kv-lora-rank", type=int, help="MLA: KV latent width (DeepSeek: 512)")
    g.add_argument("--mla-rope-dim", type=int, default=64, help="MLA: decoupled RoPE key width")
    p.set_defaults(_model_required=required)


def add_gpu_args(p: argparse.ArgumentParser, default: str | None = "h100") -> None:
    g = p.add_argument_group("GPU (a table name, or explicit figures)")
    g.add_argument("--gpu", default=default, help=f"{', '.join(GPUS)} or 'custom'")
    g.add_argument("--gpu-mem-gib", type=float, help="custom: memory (GiB)")
    g.add_argument("--gpu-bw-gbs", type=float, help="custom: memory bandwidth (GB/s)")
    g.add_argument("--gpu-tflops", type=float, help="custom: dense bf16 TFLOP/s")
    g.add_argument("--bw-eff", type=float, default=1.0, help="fraction of HBM bandwidth reached")
    g.add_argument("--flops-eff", type=float, default=1.0, help="fraction of peak FLOP/s reached")


def add_precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision")
    g.add_argument("--weight-dtype", default="bf16", help="fp32, fp16, bf16, fp8, int8, int4")
    g.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        dest="kv_dtype",
        default="bf16",
        help="fp16, bf16, fp8, int8 (the engine's --kv-cache-dtype; scales counted), int4",
    )


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) <= 0:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def parse_float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from e
    if not values or min(values) <= 0:
        raise ValueError(f"expected positive numbers, got {text!r}")
    return values


# ----------------------------------------------------------------- resolution


def model_of(args: argparse.Namespace) -> tuple[str, ModelConfig]:
    dims = (args.layers, args.hidden, args.heads, args.intermediate, args.vocab)
    if args.model:
        return args.model, resolve_model(args.model)
    if all(d is not None for d in dims):
        model = model_from_dims(
            args.layers,
            args.hidden,
            args.heads,
            args.kv_heads or args.heads,
            args.intermediate,
            args.vocab,
            head_dim=args.head_dim,
            tie_word_embeddings=args.tied,
        )
        return f"custom L{args.layers} h{args.hidden}", model
    raise ValueError(
        "give --model NAME|PATH or all of --layers --hidden --heads --intermediate --vocab"
    )


def kv_layout_of(args: argparse.Namespace, model: ModelConfig) -> KVLayout:
    if args.mla_kv_lora_rank:
        return KVLayout.mla(
            model.num_hidden_layers,
            args.mla_kv_lora_rank,
            args.mla_rope_dim,
            model.num_attention_heads,
        )
    return KVLayout.from_model(model)


def reject_mla(args: argparse.Namespace, why: str) -> None:
    """Refuse ``--mla-kv-lora-rank`` where it would be ignored (rather than silently)."""
    if getattr(args, "mla_kv_lora_rank", None):
        raise ValueError(f"--mla-kv-lora-rank is not supported {why}")


def gpu_of(args: argparse.Namespace) -> GPUSpec:
    if args.gpu is None:
        raise ValueError("give --gpu")
    if args.gpu.lower() == "custom":
        if None in (args.gpu_mem_gib, args.gpu_bw_gbs, args.gpu_tflops):
            raise ValueError("--gpu custom needs --gpu-mem-gib, --gpu-bw-gbs and --gpu-tflops")
        gpu = custom_gpu("custom", args.gpu_mem_gib, args.gpu_bw_gbs, args.gpu_tflops)
    else:
        gpu = get_gpu(args.gpu)
    if args.bw_eff != 1.0 or args.flops_eff != 1.0:
        gpu = gpu.derated(args.bw_eff, args.flops_eff)
    return gpu


def precision_of(args: argparse.Namespace) -> Precision:
    return Precision(weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype)


# ----------------------------------------------------------------- output


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> None:
    """First column left-aligned, the rest right-aligned; numbers come pre-formatted."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=False))
        ).rstrip()

    if title:
        print(title)
    print(line(headers))
    print(line(["-" * w for w in widths]))
    for row in cells:
        print(line(row))


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:,.2f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


# ----------------------------------------------------------------- entry points


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plan`` and its sub-commands on the main CLI's sub-parsers."""
    from roofline.planner import cli_calc, cli_sim

    plan = subparsers.add_parser(
        "plan",
        help="capacity planner and serving simulator (roofline model)",
        description="Answer how many GPUs, which precision and what latency from the roofline.",
    )
    sub = plan.add_subparsers(dest="plan_command", metavar="COMMAND")
    sub.required = True
    cli_calc.register(sub)
    cli_sim.register(sub)
    plan.set_defaults(func=run)
    return plan


def run(args: argparse.Namespace) -> int:
    """Dispatch a parsed ``plan`` command; returns the exit status."""
    return int(args.plan_func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roofline")
    sub = parser.add_subparsers(dest="command")
    add_cli(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "plan":
        argv = ["plan", *argv]
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"roofline plan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
