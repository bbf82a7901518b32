"""Mask cost per step of structured outputs on this machine's CPU: a synthetic byte-level
vocabulary of Llama-3.1-8B's size (128,256) and SmolLM2's real tokenizer (49,152 tokens), at 1,
16 and 64 constrained rows, for a JSON schema, a regex and a choice, through the previous path
("baseline": every row refilled, xgrammar's "auto" threads) and the mask table ("table")
(``roofline.structured_output.bench``).

    python scripts/structured_bench.py [--steps 30] [--smollm2]
"""

from __future__ import annotations

import argparse

import torch

from roofline.structured_output.backend import make_backend
from roofline.structured_output.bench import (
    format_costs,
    mask_cost,
    synthetic_backend,
    synthetic_llguidance_backend,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2's real tokenizer")
    ap.add_argument("--kinds", default="json,regex,choice")
    ap.add_argument("--llguidance", action="store_true", help="also llguidance (table path)")
    args = ap.parse_args()
    cpu = torch.device("cpu")
    backends = [("synthetic vocabulary of 128256 tokens", synthetic_backend(128256, 128009))]
    if args.smollm2:
        from roofline.models.weights import (
            gguf_path,
            load_model_config,
            load_tokenizer,
            resolve_model,
        )

        source = resolve_model(str(gguf_path()))
        config = load_model_config(source)
        tok = load_tokenizer(source)
        backends.append(
            (
                f"SmolLM2 tokenizer, vocab {config.vocab_size}",
                make_backend("auto", tok, config.vocab_size, config.eos_token_id),
            )
        )
    if args.llguidance:
        backends.append(
            ("llguidance, synthetic 128256", synthetic_llguidance_backend(128256, 128009))
        )
    print(f"torch threads {torch.get_num_threads()}")
    for name, backend in backends:
        print(name)
        for kind in args.kinds.split(","):
            steps = args.steps if kind != "regex" else max(5, args.steps // 3)
            modes = ("baseline", "table") if backend.name == "xgrammar" else ("table",)
            costs = [
                mask_cost(backend, rows, cpu, steps, kind=kind, mode=mode)
                for rows in (1, 16, 64)
                for mode in modes
            ]
            print(format_costs(costs), flush=True)


if __name__ == "__main__":
    main()
