"""``roofline serve [MODEL]``: the OpenAI-compatible server from the command line.

Engine flags are ``EngineArgs``'s (the same as ``LLM(...)``'s keyword arguments); server flags
are added here. The engine core runs in its own process unless ``--engine-in-process``.
``add_cli`` registers the subcommand on the main CLI; ``python -m
roofline.entrypoints.openai.cli serve ...`` runs it on its own (the tests do that).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from roofline.entrypoints.openai import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_SEQS_PER_REQUEST,
    DEFAULT_SERVER_MAX_NUM_WAITING,
)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from roofline.engine.args import EngineArgs

    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model folder, .gguf file or short name (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--model", dest="model_flag", default=None, help="same as the positional MODEL"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("ROOFLINE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every path but /health (default: "
        "$ROOFLINE_API_KEY, unset = no key)",
    )
    parser.add_argument(
        "--public-docs-and-metrics",
        action="store_true",
        help="with --api-key, still serve /metrics, /docs and /openapi.json without the key",
    )
    parser.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=DEFAULT_MAX_SEQS_PER_REQUEST,
        help="most sequences (prompts x n) one request may start; 400 beyond (default %(default)s)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send and see (default: the model's name)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted (default %(default)s)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests carry their own chat_template (rendered sandboxed)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "hermes", "llama3_json", "llama3", "mistral"],
        help="how the model writes tool calls (auto: from its chat template; default %(default)s)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["qwen3", "deepseek_r1"],
        help="split <think>...</think> into reasoning_content (default: off)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine's step loop on a thread of the server process instead of in its "
        "own process (slower under load: the loop and the HTTP server share one GIL; for "
        "debugging and profiling)",
    )
    EngineArgs.add_cli_args(parser)


def add_cli(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible server", description=__doc__.split("\n\n")[0]
    )
    add_serve_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from roofline.engine.args import EngineArgs
    from roofline.engine.async_engine import AsyncLLMEngine
    from roofline.entrypoints.openai.server import build_app, run_server

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        print("error: give the model once (positional or --model)", file=sys.stderr)
        return 2
    args.model = args.model if args.model is not None else args.model_flag
    if args.max_body_bytes <= 0:
        print("error: --max-body-bytes must be positive", file=sys.stderr)
        return 2
    if args.max_seqs_per_request <= 0:
        print("error: --max-seqs-per-request must be positive", file=sys.stderr)
        return 2
    if args.max_num_waiting is None:  # a server bounds its queue unless told otherwise
        args.max_num_waiting = DEFAULT_SERVER_MAX_NUM_WAITING
    port_error = _port_unavailable(args.host, args.port)
    if port_error is not None:  # before the model loads, not after
        print(f"error: cannot listen on {args.host}:{args.port}: {port_error}", file=sys.stderr)
        return 2
    from roofline.entrypoints.cli import loading_notice

    with loading_notice(args.model or "SmolLM2-135M-Instruct (embedded)"):
        engine_args = EngineArgs.from_cli_args(args)
        engine = AsyncLLMEngine.from_engine_args(engine_args, in_process=args.engine_in_process)
    app = build_app(
        engine,
        args.served_model_name,
        args.api_key,
        max_body_bytes=args.max_body_bytes,
        allow_request_chat_template=args.trust_request_chat_template,
        model_root=args.model,
        max_seqs_per_request=args.max_seqs_per_request,
        public_docs_and_metrics=args.public_docs_and_metrics,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        structured_outputs_backend=engine_args.resolve_structured_outputs_backend(),
    )
    run_server(engine, app, args.host, args.port, args.log_level)
    return 0


def _port_unavailable(host: str, port: int) -> str | None:
    """Why the server could not bind ``host:port`` (None if it can), tried with a throwaway
    socket the way uvicorn binds (SO_REUSEADDR)."""
    import socket

    if not 0 <= port <= 65535:
        return "port must be in 0..65535"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return str(e)
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            return e.strerror or str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roofline")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
