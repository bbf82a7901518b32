"""Greedy parity with HF transformers (fp32, same weights) on tiny random Qwen3-MoE (8 experts,
top-2, renormalised, one dense layer) and Mixtral (4 experts, top-2) models: several prompts
batched, 64 new tokens each, checkpoints saved per expert and stacked at load. Once with the
defaults (prefix cache hits), once with small chunks, a KV pool small enough to preempt, and
async scheduling, all in one run."""

from __future__ import annotations

import pytest

from roofline import LLM
from tests.e2e.hf_reference import hf_greedy, tiny_hf_model
from tests.e2e.test_parity_tiny import GREEDY, NUM_NEW, _prompts


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def tiny_moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny_hf_model(request.param, path)
    # 5 of the dense test's prompts (lengths 1, 23, 70 and two sharing a 40-token prefix)
    prompts = [p for i, p in enumerate(_prompts(len(request.param) * 7)) if i in (0, 2, 4, 5, 6)]
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    return path, prompts, expected


def test_moe_greedy_matches_hf(tiny_moe):
    path, prompts, expected = tiny_moe
    llm = LLM(str(path), dtype="float32", device="cpu")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits_total > 0
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_moe_chunked_preempted_async(tiny_moe):
    path, prompts, expected = tiny_moe
    # 40 pages of 4 tokens: the longest request alone needs 34, so preemption must happen
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=16,
        page_size=4,
        num_pages=40,
        max_model_len=160,
        async_scheduling=True,
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
