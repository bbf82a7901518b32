"""The ``roofline`` command: generate, chat, serve, bench and plan.

``roofline generate "What is the capital of France?"`` loads the embedded default model
(SmolLM2-135M-Instruct), applies its chat template and streams the answer to the terminal.
"""

from __future__ import annotations

import argparse
import sys
import time

from roofline.engine.args import EngineArgs
from roofline.sampling_params import SamplingParams


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _sampling_params(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty,
        presence_penalty=ns.presence_penalty,
        frequency_penalty=ns.frequency_penalty,
        seed=ns.sampling_seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )


def _engine(ns: argparse.Namespace):
    from roofline.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))


def _stream(engine, request_id: str, prompt, params: SamplingParams, out=sys.stdout) -> str:
    """Run one request to completion, writing its text to ``out`` as it is generated."""
    engine.add_request(request_id, prompt, params)
    shown, text, start, first, num_tokens = 0, "", time.perf_counter(), None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != request_id:
                continue
            first = first or time.perf_counter()
            text = o.outputs[0].text
            num_tokens = len(o.outputs[0].token_ids)
            out.write(text[shown:])
            out.flush()
            shown = len(text)
    out.write("\n")
    if first is not None and num_tokens > 1:
        elapsed = time.perf_counter() - first
        print(
            f"[{num_tokens} tokens, TTFT {1000 * (first - start):.0f} ms, "
            f"{(num_tokens - 1) / max(elapsed, 1e-9):.1f} tok/s]",
            file=sys.stderr,
        )
    return text


def _prompt_for(engine, text: str, ns: argparse.Namespace, history: list[dict] | None = None):
    if ns.no_chat_template or engine.tokenizer is None or not engine.tokenizer.chat_template:
        return text
    messages = ([{"role": "system", "content": ns.system}] if ns.system else []) + (history or [])
    messages.append({"role": "user", "content": text})
    return engine.encode_chat(messages)


def cmd_generate(ns: argparse.Namespace) -> int:
    engine = _engine(ns)
    params = _sampling_params(ns)
    prompts = ns.prompt or ["What is the capital of France?"]
    for i, text in enumerate(prompts):
        if len(prompts) > 1:
            print(f"--- {text}", file=sys.stderr)
        _stream(engine, str(i), _prompt_for(engine, text, ns), params)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    engine = _engine(ns)
    params = _sampling_params(ns)
    history: list[dict] = []
    print(
        "roofline chat: empty line or Ctrl-D to quit, /reset to clear the history", file=sys.stderr
    )
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history.clear()
            continue
        prompt = _prompt_for(engine, line, ns, history)
        reply = _stream(engine, f"chat-{turn}", prompt, params)
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]
        turn += 1
    stats = engine.get_stats()
    print(
        f"[prefix cache: {stats.prefix_cache_hits_total}/{stats.prefix_cache_queries_total} "
        "prompt tokens reused]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roofline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (
        ("generate", cmd_generate, "generate text for one or more prompts, streamed"),
        ("chat", cmd_chat, "interactive chat that keeps its history"),
    ):
        p = sub.add_parser(name, help=helptext)
        if name == "generate":
            p.add_argument("prompt", nargs="*", help="prompt text (default: a sample question)")
        p.add_argument(
            "--model",
            default=None,
            help="HF folder, .gguf file or short name (default: smollm2, embedded)",
        )
        p.add_argument("--system", default=None, help="system message for the chat template")
        p.add_argument(
            "--no-chat-template", action="store_true", help="send the prompt as raw text"
        )
        _add_sampling_args(p)
        EngineArgs.add_cli_args(p)
        p.set_defaults(func=fn)
    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub) -> None:
    from roofline.bench.cli import add_cli as add_bench
    from roofline.entrypoints.openai.cli import add_cli as add_serve
    from roofline.planner.cli import add_cli as add_plan

    add_serve(sub)
    add_bench(sub)
    add_plan(sub)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"roofline: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
