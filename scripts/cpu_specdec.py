"""N-gram speculative decoding on real text: SmolLM2-135M-Instruct (the embedded GGUF) at batch
1, greedy, with and without prompt lookup, on prompts whose answers repeat their input (edit a
paragraph, continue a list, quote the question) and on plain chat. Prints acceptance, mean
accepted length, tokens/s and the speedup per prompt kind; greedy tokens must be identical.

    python scripts/cpu_specdec.py [--k 4] [--max-tokens 160] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from roofline import LLM, SamplingParams

PARAGRAPH = (
    "The quick brown fox jumpd over the lazy dog. It was a sunny day and the fox was verry "
    "happy to be runing in the feild. The dog, however, did not care at all and kept sleeping "
    "under the old oak tree next to the farmhouse."
)
PROMPTS = {
    "edit paragraph": f"Fix the spelling mistakes in this paragraph and write it out again in "
    f"full:\n\n{PARAGRAPH}",
    "continue list": "Continue this list with ten more lines in exactly the same format:\n"
    + "\n".join(f"- Item {i}: a red box of size {i} cm" for i in range(1, 9)),
    "quote question": "First repeat my question word for word, then answer it. Question: What "
    "are the three primary colors of light, and why do screens use them instead of the "
    "primary colors of paint?",
    "plain chat 1": "Tell me a short story about a robot who learns to paint.",
    "plain chat 2": "What are some good habits for staying healthy while working from home?",
}


def run(llm: LLM, conv: list[dict], max_tokens: int) -> tuple[list[int], float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    out = llm.chat(conv, params, use_tqdm=False)[0]
    return out.outputs[0].token_ids, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); 1 on a shared, oversubscribed machine, where "
        "spinning OpenMP threads made a 5-row GEMM 20x slower than on one thread",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec_cfg = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    llm = LLM(
        "smollm2",
        device=args.device,
        max_model_len=2048,
        kv_cache_memory_bytes=256 << 20,
        speculative_config=spec_cfg,
    )
    decoder = llm.llm_engine.spec
    assert decoder is not None
    threshold = decoder.max_batch_size
    print(f"n-gram k={args.k}, speculating while <= {threshold} requests run", flush=True)
    print(
        f"{'prompt':<16} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
        f"{'accept':>6} {'mean len':>8} identical"
    )
    for name, text in PROMPTS.items():
        conv = [{"role": "user", "content": text}]
        decoder.max_batch_size = 0  # the same engine with speculation off
        run(llm, conv, 8)  # warm
        base_ids, base_s = run(llm, conv, args.max_tokens)
        decoder.max_batch_size = threshold
        s = decoder.stats
        d0, p0, a0, e0 = (
            s.num_drafts,
            s.num_draft_tokens,
            s.num_accepted_tokens,
            s.num_emitted_tokens,
        )
        ids, spec_s = run(llm, conv, args.max_tokens)
        drafts, proposed = s.num_drafts - d0, s.num_draft_tokens - p0
        accepted, emitted = s.num_accepted_tokens - a0, s.num_emitted_tokens - e0
        n = len(base_ids)
        print(
            f"{name:<16} {n:>6} {n / base_s:>11.1f} {len(ids) / spec_s:>10.1f} "
            f"{base_s / spec_s:>6.2f}x {accepted / max(proposed, 1):>6.2f} "
            f"{emitted / max(drafts, 1):>8.2f} {ids == base_ids}",
            flush=True,
        )
    print(decoder.stats.summary())


if __name__ == "__main__":
    main()
