"""The ``roofline`` command: generate, chat, serve, bench and plan.

``roofline generate "What is the capital of France?"`` loads the embedded default model
(SmolLM2-135M-Instruct), applies its chat template and streams the answer to the terminal.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

# Start-up (torch's imports, the engine) allocates some 300k objects that live as long as the
# process, and CPython's collector walked them again and again: a quarter of `roofline
# generate`'s CPU time on the 2-core dev machine. When this module is the program, collections
# wait until a command has set itself up (_resume_gc), then skip those objects (frozen).
_GC_PAUSED = __name__ == "__main__" or os.path.basename(sys.argv[0]) == "roofline"
if _GC_PAUSED:
    gc.disable()

from roofline.engine.args import EngineArgs  # noqa: E402 (after the collector is paused)
from roofline.sampling_params import SamplingParams  # noqa: E402

# Defaults per command where the model's generation_config.json says nothing: generate keeps
# plain greedy decoding; chat adds a repetition penalty (small models loop when greedy) and a
# token limit that lets answers end.
_DEFAULTS = {
    "generate": {
        "max_tokens": 256,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.0,
    },
    "chat": {
        "max_tokens": 512,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.1,
    },
}
_GENERATION_CONFIG_KEYS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
}


def _add_sampling_args(p: argparse.ArgumentParser, command: str) -> None:
    d = _DEFAULTS[command]
    src = "default: the model's generation_config.json, else %s"
    p.add_argument(
        "--max-tokens", type=int, default=None, help=f"new tokens at most ({src % d['max_tokens']})"
    )
    p.add_argument(
        "--temperature", type=float, default=None, help=f"0 = greedy ({src % d['temperature']})"
    )
    p.add_argument("--top-p", type=float, default=None, help=src % d["top_p"])
    p.add_argument("--top-k", type=int, default=None, help=src % d["top_k"])
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument(
        "--repetition-penalty", type=float, default=None, help=src % d["repetition_penalty"]
    )
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _generation_defaults(ns: argparse.Namespace) -> dict:
    """The command's sampling defaults, overridden by the model's generation_config.json."""
    import json

    from roofline.models.weights import resolve_model

    defaults = dict(_DEFAULTS[ns.command])
    source = resolve_model(ns.model)
    if source.kind == "hf" and (source.path / "generation_config.json").is_file():
        gen = json.loads((source.path / "generation_config.json").read_text())
        if gen.get("do_sample") is False:
            gen = {k: v for k, v in gen.items() if k not in ("temperature", "top_p", "top_k")}
        for key, name in _GENERATION_CONFIG_KEYS.items():
            if gen.get(key) is not None:
                defaults[name] = gen[key]
    return defaults


def _sampling_params(ns: argparse.Namespace) -> SamplingParams:
    """Validated before anything is loaded: a bad value fails at once."""
    d = _generation_defaults(ns)

    def pick(name: str):
        value = getattr(ns, name)
        return d[name] if value is None else value

    return SamplingParams(
        max_tokens=pick("max_tokens"),
        temperature=pick("temperature"),
        top_p=pick("top_p"),
        top_k=pick("top_k"),
        min_p=ns.min_p,
        repetition_penalty=pick("repetition_penalty"),
        presence_penalty=ns.presence_penalty,
        frequency_penalty=ns.frequency_penalty,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )


def _check_model(ns: argparse.Namespace) -> None:
    """Refuse, before loading, a bundled random-weight config without --load-format dummy."""
    from roofline.models.weights import resolve_model

    source = resolve_model(ns.model)
    if source.kind == "config" and ns.load_format != "dummy":
        raise ValueError(
            f"{source.name!r} is a random-weight config for benchmarks (no weights, no "
            "tokenizer); run it with --load-format dummy (token ids only, meaningless text), "
            "or give a checkpoint folder, a .gguf file or 'smollm2'"
        )
    if source.kind == "config" and not ns.no_chat_template:
        raise ValueError(f"{source.name!r} has no tokenizer: add --no-chat-template")


class loading_notice:
    """Prints ``loading MODEL ...`` to stderr if loading is still running after ``after_s``
    seconds, and how long it took at the end (nothing for a load that finishes sooner)."""

    def __init__(self, what: str, after_s: float = 1.0) -> None:
        import threading

        self.what, self.shown, self.start = what, False, time.perf_counter()
        self.timer = threading.Timer(after_s, self._show)
        self.timer.daemon = True

    def _show(self) -> None:
        self.shown = True
        print(f"[loading {self.what} ...]", file=sys.stderr, flush=True)

    def __enter__(self) -> loading_notice:
        if sys.stderr.isatty() or os.environ.get("ROOFLINE_PROGRESS") == "1":
            self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()
        if self.shown and exc[0] is None:
            elapsed = time.perf_counter() - self.start
            print(f"[loaded {self.what} in {elapsed:.1f} s]", file=sys.stderr, flush=True)


def _engine(ns: argparse.Namespace):
    from roofline.engine.llm_engine import LLMEngine

    with loading_notice(ns.model or "SmolLM2-135M-Instruct (embedded)"):
        engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    _resume_gc()
    return engine


def _resume_gc() -> None:
    """Collections back on, with everything made so far frozen (see _GC_PAUSED)."""
    global _GC_PAUSED
    if _GC_PAUSED:
        _GC_PAUSED = False
        gc.freeze()
        gc.enable()


def _stream(engine, request_id: str, prompt, params: SamplingParams, out=sys.stdout) -> str:
    """Run one request to completion, writing its text to ``out`` as it is generated."""
    from roofline.engine.heap import frozen_heap

    engine.add_request(request_id, prompt, params)
    shown, text, start, first, num_tokens = 0, "", time.perf_counter(), None, 0
    with frozen_heap():  # no full-heap GC pauses between steps, as in LLM.generate
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
    params = _sampling_params(ns)
    _check_model(ns)
    prompts = list(ns.prompts)
    if ns.prompt:
        prompts.insert(0, " ".join(ns.prompt))  # bare words are one prompt
    prompts = prompts or ["What is the capital of France?"]
    engine = _engine(ns)
    for i, text in enumerate(prompts):
        if len(prompts) > 1:
            print(f"--- {text}", file=sys.stderr)
        _stream(engine, str(i), _prompt_for(engine, text, ns), params)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    params = _sampling_params(ns)
    _check_model(ns)
    engine = _engine(ns)
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
            print("[history cleared]", file=sys.stderr)
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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``command`` "generate" or "chat" the bench/serve/plan commands are
    left out (their modules take a noticeable part of a first answer's start-up to import)."""
    from roofline import __version__
    from roofline.models.weights import available_configs

    parser = argparse.ArgumentParser(prog="roofline", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"roofline {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    configs = ", ".join(available_configs()) or "none"
    for name, fn, helptext in (
        ("generate", cmd_generate, "generate text for one or more prompts, streamed"),
        ("chat", cmd_chat, "interactive chat that keeps its history"),
    ):
        p = sub.add_parser(name, help=helptext)
        if name == "generate":
            p.add_argument(
                "prompt",
                nargs="*",
                help="the prompt; several bare words are ONE prompt (quotes optional; default: "
                "a sample question)",
            )
            p.add_argument(
                "--prompt",
                dest="prompts",
                action="append",
                default=[],
                help="a further prompt (repeatable: one request each)",
            )
        p.add_argument(
            "--model",
            default=None,
            help="HF checkpoint folder, .gguf file, or 'smollm2' (SmolLM2-135M-Instruct, "
            f"embedded; the default). Random-weight configs for benchmarks only (need "
            f"--load-format dummy): {configs}",
        )
        p.add_argument("--system", default=None, help="system message for the chat template")
        p.add_argument(
            "--no-chat-template", action="store_true", help="send the prompt as raw text"
        )
        _add_sampling_args(p, name)
        EngineArgs.add_cli_args(p)
        p.set_defaults(func=fn)
    if command not in ("generate", "chat"):
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
    args = sys.argv[1:] if argv is None else argv
    ns = build_parser(args[0] if args else None).parse_args(args)
    if getattr(ns, "func", None) not in (cmd_generate, cmd_chat):
        _resume_gc()  # generate and chat resume once their engine is built
    try:
        return int(ns.func(ns) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"roofline: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
