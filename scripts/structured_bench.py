"""Mask cost per step of structured outputs on this machine's CPU: SmolLM2's real tokenizer
(49,152 tokens) and a synthetic vocabulary of Llama-3.1-8B's size (128,256), at 1, 16 and 64
constrained rows over a JSON schema (``roofline.structured_output.bench``).

    python scripts/structured_bench.py [--steps 50]
"""

from __future__ import annotations

import argparse

import torch

from roofline.models.weights import gguf_path, load_model_config, load_tokenizer, resolve_model
from roofline.structured_output.backend import make_backend
from roofline.structured_output.bench import format_costs, mask_cost, synthetic_backend


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    cpu = torch.device("cpu")
    source = resolve_model(str(gguf_path()))
    config = load_model_config(source)
    backend = make_backend("auto", load_tokenizer(source), config.vocab_size, config.eos_token_id)
    costs = [mask_cost(backend, rows, cpu, args.steps) for rows in (1, 16, 64)]
    print(f"SmolLM2 tokenizer, vocab {config.vocab_size}, torch threads {torch.get_num_threads()}")
    print(format_costs(costs), flush=True)
    synthetic = synthetic_backend(128256, 128009)
    costs = [mask_cost(synthetic, rows, cpu, args.steps) for rows in (1, 16, 64)]
    print("synthetic vocabulary of 128256 tokens (Llama-3.1-8B's size)")
    print(format_costs(costs))


if __name__ == "__main__":
    main()
