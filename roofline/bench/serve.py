"""``roofline bench serve``: load-test any OpenAI-compatible server over HTTP with streaming.

Requests come from synthetic prompts (lengths drawn from a distribution, text of random common
words, about one token each) or a JSONL file; they arrive as a Poisson process at
``--request-rate`` and/or under a ``--max-concurrency`` cap. Each streamed answer gives its time
to first token (TTFT), inter-token latencies (ITL, between chunks that brought tokens), time per
output token after the first (TPOT) and end-to-end latency. Tokens are counted, not text chunks:
requests ask for vLLM's ``continuous_usage_stats`` (usage in every chunk), so models that stream
no text (random weights, no tokenizer) are timed too. The summary reports p50/p90/p99 of each,
request and token throughput, and goodput (requests per second that met every given SLO); the
result is written as JSON and, with ``--plot-dir``, as PNG plots. ``--sweep-rates`` repeats the
run at several rates and prints the throughput-latency curve. The load itself (datasets,
arrivals, the streaming client) lives in :mod:`roofline.bench.serve_load`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from roofline.bench.serve_load import (
    RequestResult,
    jsonl_requests,
    run_requests,
    served_model,
    synthetic_requests,
)

PERCENTILES = (50, 90, 99)


# ------------------------------------------------------------------------------ metrics
def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values) * 1000.0
    return {
        "mean": float(arr.mean()),
        **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES},
    }


def summarize(
    results: list[RequestResult], duration: float, slo_ms: dict[str, float] | None = None
) -> dict[str, Any]:
    """Latency percentiles (ms), throughput, and goodput under ``slo_ms`` (keys ``ttft``,
    ``tpot``, ``e2e``): a request counts toward goodput when it met every given SLO."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    duration = max(duration, 1e-9)
    slo_ms = slo_ms or {}

    def good(r: RequestResult) -> bool:
        values = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}
        for key, limit in slo_ms.items():
            v = values[key]
            if key == "tpot" and v is None:  # a single token has no TPOT to miss
                continue
            if v is None or v * 1000.0 > limit:
                return False
        return True

    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput": sum(good(r) for r in ok) / duration if slo_ms else None,
        "slo_ms": slo_ms,
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itls]),
        "e2e_ms": _stats_ms([r.e2e for r in ok]),
    }


def timeline(
    results: list[RequestResult], duration: float, bin_s: float | None = None
) -> dict[str, list[float]]:
    """Output tokens per second and requests in flight, per time bin (a chunk carrying several
    tokens spreads its request's token count evenly over the request's chunks)."""
    bin_s = bin_s or max(0.1, duration / 60)
    edges = np.arange(0.0, duration + bin_s, bin_s)
    times = [t for r in results for t in r.chunk_times]
    weights = [r.output_tokens / len(r.chunk_times) for r in results for _ in r.chunk_times]
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    mids = (edges[:-1] + bin_s / 2).tolist()
    running = [sum(r.start <= t < r.end for r in results) for t in mids]
    return {
        "time_s": mids,
        "output_tokens_per_s": (counts / bin_s).tolist(),
        "running_requests": running,
    }


# ------------------------------------------------------------------------------ CLI
def _slos(args: argparse.Namespace) -> dict[str, float]:
    pairs = (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms), ("e2e", args.slo_e2e_ms))
    return {k: v for k, v in pairs if v is not None}


def bench_once(args: argparse.Namespace, model: str, rate: float) -> dict[str, Any]:
    chat = args.endpoint == "chat"
    if args.dataset:
        requests = jsonl_requests(args.dataset, args.num_prompts, args.output_len, chat)
    else:
        requests = synthetic_requests(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.input_dist,
            args.output_dist,
            args.range_ratio,
            args.seed,
            chat,
        )
    results, duration = asyncio.run(
        run_requests(
            args.base_url,
            model,
            requests,
            endpoint=args.endpoint,
            request_rate=rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            api_key=args.api_key,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            timeout=args.timeout,
        )
    )
    summary = summarize(results, duration, _slos(args))
    out: dict[str, Any] = {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "max_concurrency": args.max_concurrency,
        **summary,
        "timeline": timeline(results, duration),
    }
    if args.save_requests:
        out["requests"] = [asdict(r) for r in results]
    out["_results"] = results
    return out


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_summary(run: dict[str, Any]) -> None:
    print(
        f"requests: {run['completed']} ok, {run['failed']} failed in "
        f"{run['duration_s']:.2f} s (rate {run['request_rate']}, "
        f"concurrency {run['max_concurrency'] or 'unbounded'})"
    )
    for e in run["errors"]:
        print(f"  error: {e}")
    print(
        f"throughput: {run['request_throughput']:.2f} req/s, "
        f"{run['output_throughput']:.1f} output tok/s, "
        f"{run['total_token_throughput']:.1f} total tok/s"
        + (
            f", goodput {run['goodput']:.2f} req/s under {run['slo_ms']}"
            if run["goodput"] is not None
            else ""
        )
    )
    print(f"{'ms':>6} {'mean':>9} " + " ".join(f"{'p' + str(p):>9}" for p in PERCENTILES))
    for key in ("ttft", "tpot", "itl", "e2e"):
        s = run[f"{key}_ms"]
        print(
            f"{key:>6} {_fmt(s['mean']):>9} "
            + " ".join(f"{_fmt(s[f'p{p}']):>9}" for p in PERCENTILES)
        )


def print_sweep(runs: list[dict[str, Any]]) -> None:
    print("\nthroughput-latency curve")
    print(
        f"{'rate':>6} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'goodput':>8}"
    )
    for r in runs:
        t, p = r["ttft_ms"], r["tpot_ms"]
        print(
            f"{r['request_rate']!s:>6} {r['request_throughput']:>7.2f} "
            f"{r['output_throughput']:>10.1f} {_fmt(t['p50']):>9} {_fmt(t['p99']):>9} "
            f"{_fmt(p['p50']):>9} {_fmt(p['p99']):>9} {_fmt(r['goodput'], 2):>8}"
        )


def _rate(text: str) -> float:
    return math.inf if text.strip().lower() in ("inf", "infinity") else float(text)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root, without /v1 (default %(default)s)",
    )
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument(
        "--dataset",
        default=None,
        help="JSONL of {prompt|messages[, max_tokens]}; default: synthetic prompts",
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="mean synthetic prompt words")
    p.add_argument("--output-len", type=int, default=64, help="mean max_tokens")
    for which in ("input", "output"):
        p.add_argument(
            f"--{which}-dist",
            default="fixed",
            choices=["fixed", "uniform", "normal", "exponential"],
        )
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.5,
        help="uniform: +-ratio*mean; normal: stddev = ratio*mean",
    )
    p.add_argument(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="Poisson arrivals per second (inf: all at once)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument(
        "--sweep-rates",
        default=None,
        help="comma-separated rates, e.g. 1,2,4,inf: one run per rate",
    )
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/roofline)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--result-json", default=None, help="write the result here")
    p.add_argument("--save-requests", action="store_true", help="per-request data in the JSON")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here (needs matplotlib)")


def add_cli(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "serve", help="benchmark an OpenAI-compatible server", description=__doc__.split("\n\n")[0]
    )
    add_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.num_prompts <= 0:
        print("error: --num-prompts must be positive", file=sys.stderr)
        return 2
    model = args.model or served_model(args.base_url, args.api_key)
    rates = (
        [_rate(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else [args.request_rate]
    )
    runs = []
    for rate in rates:
        one = bench_once(args, model, rate)
        print_summary(one)
        runs.append(one)
    if len(runs) > 1:
        print_sweep(runs)
    if args.plot_dir:
        from roofline.bench.serve_plots import plot_run, plot_sweep

        out = Path(args.plot_dir)
        out.mkdir(parents=True, exist_ok=True)
        for one in runs:
            tag = "" if len(runs) == 1 else f"_rate{one['request_rate']}"
            plot_run(one["_results"], one, out, tag)
        if len(runs) > 1:
            plot_sweep(runs, out / "sweep.png")
        print(f"plots: {out}")
    for one in runs:
        del one["_results"]
    result = {
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "num_prompts": args.num_prompts,
        "runs": runs,
    }
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2))
        print(f"result: {args.result_json}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roofline bench")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
