"""Greedy tokens of the embedded SmolLM2 GGUF with its Q4_1 blocks kept (the CPU kernels, int16
activations) against the same weights dequantized to fp32 (the reference path): 10 chat
prompts x 32 new tokens; prints per prompt whether the token ids are equal, and where the first
difference is.

    python scripts/cpu_quality.py
"""

from __future__ import annotations

from roofline import LLM, SamplingParams
from roofline.bench.workloads import CHAT_QUESTIONS

NUM_PROMPTS, NUM_TOKENS = 10, 32


def greedy(keep: bool, prompts: list[str]) -> list[list[int]]:
    llm = LLM("smollm2", dtype="float32", device="cpu", gguf_keep_quantized=keep)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    outs = llm.chat(msgs, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    prompts = list(CHAT_QUESTIONS[:NUM_PROMPTS])
    kept, ref = greedy(True, prompts), greedy(False, prompts)
    same = 0
    for prompt, a, b in zip(prompts, kept, ref):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        same += first is None
        where = "equal" if first is None else f"first difference at token {first}"
        print(f"{where:32s} {prompt[:60]!r}")
    print(f"{same}/{len(prompts)} prompts x {NUM_TOKENS} tokens equal (target >= 9)")


if __name__ == "__main__":
    main()
