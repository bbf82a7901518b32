"""Quantized KV cache and prompt logprobs end to end on a tiny random Llama (CPU, torch backend).

With ``kv_cache_dtype`` fp8 or int8 the greedy tokens must not depend on how the work was
scheduled: prefix caching off, small chunks, a pool so small that requests are preempted and
async scheduling all give the tokens of the default run with the same KV dtype (a token's K/V
is quantized from the same values whichever step stores it). ``prompt_logprobs`` must equal HF
transformers' log-softmax over the prompt, also under chunked prefill, a prefix-cache hit (which
such a request skips) and preemption.
"""

from __future__ import annotations

import random

import pytest
import torch

from roofline import LLM, SamplingParams
from tests.e2e.hf_reference import tiny_hf_model

NUM_NEW = 16


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 320) for _ in range(40)]
    out = [[rng.randrange(3, 320) for _ in range(n)] for n in (1, 9, 33, 70)]
    return out + [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (5, 19)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_kvq")
    return path, tiny_hf_model("llama", path)


def _greedy(path, prompts, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype="float32", device="cpu", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantized_kv_greedy_independent_of_scheduling(tiny, kv_cache_dtype):
    path, hf = tiny
    prompts = _prompts()
    expected, llm = _greedy(path, prompts, kv_cache_dtype=kv_cache_dtype)
    assert llm.llm_engine.get_stats().prefix_cache_hits_total > 0
    runner = llm.llm_engine.runner
    assert runner.kv_cache.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache_dtype]
    for kwargs in (
        dict(enable_prefix_caching=False, max_num_batched_tokens=8, page_size=4),
        dict(async_scheduling=True, num_pages=10, max_model_len=128),
    ):
        got, llm = _greedy(path, prompts, kv_cache_dtype=kv_cache_dtype, **kwargs)
        assert got == expected, kwargs
        if "num_pages" in kwargs:
            assert llm.llm_engine.get_stats().num_preemptions_total > 0


def test_quantized_pool_holds_more_tokens(tiny):
    path, _ = tiny
    budget = dict(kv_cache_memory_bytes=1 << 20, max_model_len=128)
    pages = {}
    for dt in ("auto", "fp8", "int8"):
        engine = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_dtype=dt, **budget)
        pages[dt] = engine.llm_engine.runner.num_pages
        assert engine.llm_engine.get_stats().kv_cache_capacity_tokens == pages[dt] * 16
    # 3 layers x K, V x 2 heads, head_dim 16: 32 bytes per head in bf16, 16 + 4 (scale)
    page_bytes = {"auto": 16 * 3 * 2 * 2 * 32, "fp8": 16 * 3 * 2 * 2 * 20}
    assert pages["auto"] == (1 << 20) // page_bytes["auto"]
    assert pages["fp8"] == pages["int8"] == (1 << 20) // page_bytes["fp8"]


def test_bad_kv_cache_dtype_is_refused_before_loading(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(path), device="cpu", kv_cache_dtype="fp4")

    class NoQuantBackend:
        name = "plain"

    from roofline.quantization.kv_cache import KVCacheSpec

    with pytest.raises(ValueError, match="does not read kv_cache_dtype='int8'"):
        KVCacheSpec.create("int8", torch.float32).check_backend(
            NoQuantBackend(), torch.device("cpu")
        )


@torch.inference_mode()
def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    logits = hf(torch.tensor([prompt])).logits[0].float()  # [L, V]
    logprobs = torch.log_softmax(logits, dim=-1)[:-1]  # [L - 1, V]
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]  # [L - 1]


@pytest.mark.parametrize(
    "kwargs",
    [{}, dict(max_num_batched_tokens=8, page_size=4), dict(num_pages=10, max_model_len=128)],
    ids=["default", "small-chunks", "preemption"],
)
def test_prompt_logprobs_match_hf(tiny, kwargs):
    path, hf = tiny
    prompts = _prompts()
    llm = LLM(str(path), dtype="float32", device="cpu", **kwargs)
    # The shared prefix goes into the cache first: the requests below must not skip it.
    llm.generate([prompts[-1]], SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) and lps[0] is None
        got = torch.tensor([lps[i][t].logprob for i, t in enumerate(prompt) if i > 0])
        if len(prompt) > 1:
            torch.testing.assert_close(got, _hf_prompt_logprobs(hf, prompt), atol=1e-4, rtol=0)
        for i in range(1, len(prompt)):
            top = sorted(lps[i].values(), key=lambda lp: lp.rank)
            assert [lp.rank for lp in top[:2]] == [1, 2] and len(lps[i]) in (2, 3)
    if "num_pages" in kwargs:
        assert llm.llm_engine.get_stats().num_preemptions_total > 0
