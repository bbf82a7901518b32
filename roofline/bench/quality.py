"""``roofline bench quality``: perplexity and teacher-forced top-1 agreement of engine
configurations on a fixed English text shipped with roofline.

The text (``bench/data/quality_essay.txt``, an essay on lighthouses written for this project,
~2,600 SmolLM2 tokens) is scored as one prompt with ``SamplingParams(prompt_logprobs=1)``:
position ``i`` gives the log-probability of token ``i`` given tokens ``< i`` and the model's top-1
token there. Perplexity is ``exp(-mean logprob)``; agreement of a configuration is the fraction of
positions whose top-1 token equals the reference configuration's (teacher-forced: both read the
true text, so one disagreement does not cascade as in free-running generation). Each
configuration is a name and the keyword arguments of ``LLM(...)`` (``kv_cache_dtype``,
``quantization``, ``dtype``, ...), so a new method is one more entry.
"""

from __future__ import annotations

import gc
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT_PATH = Path(__file__).parent / "data" / "quality_essay.txt"


def load_text() -> str:
    return TEXT_PATH.read_text(encoding="utf-8")


@dataclass
class QualityResult:
    name: str
    kwargs: dict[str, Any]
    num_tokens: int
    """Scored positions (prompt tokens after the first)."""
    perplexity: float
    agreement: float | None
    """Top-1 agreement with the reference configuration (None for the reference itself)."""
    seconds: float


def score(llm: Any, token_ids: list[int]) -> tuple[list[float], list[int]]:
    """(logprob of each true token after the first, the model's top-1 token at each)."""
    from roofline import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    out = llm.generate([token_ids], params, use_tqdm=False)[0]
    logprobs, top1 = [], []
    for tid, step in zip(token_ids[1:], out.prompt_logprobs[1:], strict=True):
        logprobs.append(step[tid].logprob)
        top1.append(next(t for t, lp in step.items() if lp.rank == 1))
    return logprobs, top1


def measure(
    configs: dict[str, dict[str, Any]],
    reference: str | None = None,
    model: str | None = None,
    num_tokens: int | None = None,
    text: str | None = None,
) -> list[QualityResult]:
    """Score ``text`` (default: the shipped essay), cut to its first ``num_tokens`` tokens, under
    each configuration in turn; agreement against ``reference`` (default: the first)."""
    import time

    from roofline import LLM

    if not configs:
        raise ValueError("give at least one configuration")
    reference = reference or next(iter(configs))
    if reference not in configs:
        raise ValueError(f"reference {reference!r} is not one of {sorted(configs)}")
    order = [reference] + [n for n in configs if n != reference]
    token_ids: list[int] | None = None
    ref_top1: list[int] = []
    results: dict[str, QualityResult] = {}
    for name in order:
        kwargs = dict(configs[name])
        t0 = time.perf_counter()
        llm = LLM(model, **kwargs)
        if token_ids is None:
            ids = llm.get_tokenizer()(text or load_text()).input_ids
            token_ids = list(ids[:num_tokens] if num_tokens else ids)
        logprobs, top1 = score(llm, token_ids)
        del llm
        gc.collect()
        if name == reference:
            ref_top1 = top1
        agree = None
        if name != reference:
            agree = sum(a == b for a, b in zip(top1, ref_top1, strict=True)) / len(top1)
        ppl = math.exp(-sum(logprobs) / len(logprobs))
        seconds = time.perf_counter() - t0
        results[name] = QualityResult(name, kwargs, len(logprobs), ppl, agree, seconds)
    return [results[n] for n in configs]


def parse_config(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME=JSON`` (``fp8={"kv_cache_dtype": "fp8"}``) or ``NAME`` alone (no kwargs)."""
    name, sep, body = text.partition("=")
    if not name:
        raise ValueError(f"a configuration needs a name: {text!r}")
    kwargs = json.loads(body) if sep else {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"configuration {name!r}: LLM kwargs must be a JSON object")
    return name, kwargs


def format_table(results: list[QualityResult]) -> str:
    ref = next(r for r in results if r.agreement is None)
    lines = [
        "| config | LLM kwargs | tokens | perplexity | vs reference | top-1 agreement | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        delta = (r.perplexity / ref.perplexity - 1.0) * 100
        agree = "reference" if r.agreement is None else f"{r.agreement * 100:.2f}%"
        lines.append(
            f"| {r.name} | `{json.dumps(r.kwargs)}` | {r.num_tokens} | {r.perplexity:.4f} | "
            f"{delta:+.2f}% | {agree} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


DEFAULT_CONFIGS = {
    "auto": {},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "int8-kv": {"kv_cache_dtype": "int8"},
}


def add_cli(sub: Any) -> None:
    p = sub.add_parser("quality", help="perplexity and top-1 agreement per engine configuration")
    p.add_argument("--model", default=None, help="folder, .gguf, short name (default SmolLM2)")
    p.add_argument(
        "--config",
        action="append",
        default=None,
        help='NAME=JSON of LLM kwargs, e.g. fp8=\'{"kv_cache_dtype": "fp8"}\' (repeatable; '
        "default: auto, fp8-kv, int8-kv)",
    )
    p.add_argument("--reference", default=None, help="configuration to agree with (the first)")
    p.add_argument("--num-tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--text", default=None, help="a UTF-8 text file instead of the shipped essay")
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    p.set_defaults(func=cmd_quality)


def cmd_quality(args: Any) -> None:
    configs = dict(parse_config(c) for c in args.config) if args.config else DEFAULT_CONFIGS
    text = Path(args.text).read_text(encoding="utf-8") if args.text else None
    results = measure(configs, args.reference, args.model, args.num_tokens, text)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=2)
