"""Benchmark workloads: synthetic random-token prompts with length ranges, a JSONL file of
prompts, or a fixed set of chat questions (rendered with the model's chat template)."""

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
