"""Benchmark workloads: synthetic random-token prompts with length ranges, prompts that share a
common prefix, a JSONL file of prompts, a fixed set of chat questions (rendered with the model's
chat template), and named presets for the workload families the engine is held to."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in simple terms.",
    "Write a haiku about autumn.",
    "How do vaccines work?",
    "Give me three tips for learning a new language.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?",
    "What is the difference between weather and climate?",
    "Write a short story about a robot.",
    "Why is the sky blue?",
    "How do I make a cup of tea?",
    "What are prime numbers?",
    "Describe the water cycle.",
    "What is machine learning?",
    "Name three famous painters and one work by each.",
    "How does the internet work?",
    "What should I pack for a beach holiday?",
    "Explain gravity to a child.",
    "What is the tallest mountain in the world?",
    "Write a limerick about a cat.",
    "How do airplanes fly?",
    "What is a black hole?",
    "Give me a recipe for pancakes.",
    "Why do we dream?",
    "What is the Pythagorean theorem?",
    "How can I sleep better?",
    "What are the planets of the solar system?",
    "Explain what a computer virus is.",
    "What is democracy?",
    "Describe a sunset over the ocean.",
    "How do bees make honey?",
]


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    name: str
    shared_prefix_len: int = 0
    """Leading tokens every prompt has in common (the roofline prefills and reads them once)."""

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def synthetic(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    """Random token prompts; lengths uniform in the inclusive ranges."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_requests):
        n = rng.randint(*input_len)
        prompts.append([rng.randrange(10, vocab_size - 10) for _ in range(n)])
        outs.append(rng.randint(*output_len))
    lo_in, hi_in = input_len
    lo_out, hi_out = output_len
    name = f"synthetic n={num_requests} in={lo_in}-{hi_in} out={lo_out}-{hi_out}"
    return Workload(prompts, outs, name)


def shared_prefix(
    num_requests: int,
    prefix_len: int,
    unique_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    """One random ``prefix_len``-token prefix (a system prompt) followed by each request's own
    random tokens; lengths uniform in the inclusive ranges."""
    if prefix_len < 1:
        raise ValueError("prefix_len must be at least 1")
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab_size - 10) for _ in range(prefix_len)]
    base = synthetic(num_requests, unique_len, output_len, vocab_size, seed + 1)
    prompts = [prefix + p for p in base.prompts]
    lo, hi = unique_len
    lo_out, hi_out = output_len
    name = (
        f"shared-prefix n={num_requests} prefix={prefix_len} unique={lo}-{hi} out={lo_out}-{hi_out}"
    )
    return Workload(prompts, base.output_lens, name, shared_prefix_len=prefix_len)


PRESETS: dict[str, str] = {
    "default": "256 requests, input 100-1024, output 512 (the headline offline workload)",
    "short": "1,000 short requests: input 20-300, output 20-300",
    "shared-prefix": "256 requests: a common 2,000-token prefix + 64 unique tokens, output 128",
    "long-prompt": "16 requests of 8,000 input tokens, output 128",
}


def preset(name: str, vocab_size: int, seed: int = 0) -> Workload:
    """The named workload of ``PRESETS``, with random tokens from ``seed``."""
    if name == "default":
        wl = synthetic(256, (100, 1024), (512, 512), vocab_size, seed)
    elif name == "short":
        wl = synthetic(1000, (20, 300), (20, 300), vocab_size, seed)
    elif name == "shared-prefix":
        wl = shared_prefix(256, 2000, (64, 64), (128, 128), vocab_size, seed)
    elif name == "long-prompt":
        wl = synthetic(16, (8000, 8000), (128, 128), vocab_size, seed)
    else:
        raise ValueError(f"unknown workload preset {name!r}; choose from {', '.join(PRESETS)}")
    wl.name = f"preset {name}: {wl.name}"
    return wl


def chat(tokenizer, num_requests: int, output_len: int) -> Workload:
    """The built-in chat questions (cycled), rendered with the model's chat template."""
    prompts = []
    for i in range(num_requests):
        msgs = [{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        prompts.append(list(tokenizer(text, add_special_tokens=False).input_ids))
    return Workload(prompts, [output_len] * num_requests, f"chat n={num_requests} out={output_len}")


def jsonl(path: str, tokenizer, output_len: int, num_requests: int | None = None) -> Workload:
    """One JSON object per line with ``prompt`` (text) or ``prompt_token_ids``, and optionally
    ``output_len`` / ``max_tokens``."""
    prompts, outs = [], []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            ids = rec.get("prompt_token_ids")
            if ids is None:
                if tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; give prompt_token_ids")
                ids = tokenizer(rec["prompt"]).input_ids
            prompts.append(list(ids))
            outs.append(int(rec.get("output_len", rec.get("max_tokens", output_len))))
            if num_requests is not None and len(prompts) >= num_requests:
                break
    return Workload(prompts, outs, f"jsonl {path}")
