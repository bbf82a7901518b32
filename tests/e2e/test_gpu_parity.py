"""On CUDA (run through the device tool; skipped on CPU-only machines): fp32 greedy tokens
identical to HF transformers on the same random weights with every GPU path in use (Triton
attention, norm, RoPE and SiLU kernels, CUDA-graph decode)."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from tests.e2e.hf_reference import hf_greedy, tiny_hf_model
from tests.e2e.test_parity_tiny import NUM_NEW, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gpu_fp32_greedy_matches_hf(arch, tmp_path):
    hf = tiny_hf_model(arch, tmp_path, head_dim=32, hidden_size=128, num_attention_heads=4)
    prompts = _prompts(len(arch) * 7)
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        device="cuda",
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
    )
    assert llm.llm_engine.runner.graphs is not None  # decode steps replay CUDA graphs
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
