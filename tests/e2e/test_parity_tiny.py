"""Greedy parity with HF transformers (fp32, same weights) on tiny random Llama (with llama3
RoPE scaling), Qwen2 (q/k/v bias) and Qwen3 (q/k norm) models: several prompts of different
lengths generated together in one continuous batch, 64 new tokens each. The same tokens must
come out with prefix caching off, with chunked prefill forced small, and with a KV pool so small
that preemption happens."""

from __future__ import annotations

import random

import pytest

from roofline import LLM, SamplingParams
from tests.e2e.hf_reference import hf_greedy, tiny_hf_model

NUM_NEW = 64


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 320) for _ in range(40)]  # a common prefix for cache hits
    lens = [1, 7, 23, 33, 70]
    out = [[rng.randrange(3, 320) for _ in range(n)] for n in lens]
    out += [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (5, 19)]
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny_hf_model(request.param, path)
    prompts = _prompts(len(request.param) * 7)
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    return path, prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _run(path, prompts, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype="float32", device="cpu", **kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_greedy_matches_hf(tiny):
    path, prompts, expected = tiny
    got, llm = _run(path, prompts)
    assert got == expected
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits_total > 0  # the shared prefix was reused
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_prefix_caching_off(tiny):
    path, prompts, expected = tiny
    got, llm = _run(path, prompts, enable_prefix_caching=False)
    assert got == expected
    assert llm.llm_engine.get_stats().prefix_cache_hits_total == 0


def test_small_chunks(tiny):
    path, prompts, expected = tiny
    got, _ = _run(path, prompts, max_num_batched_tokens=8, page_size=4)
    assert got == expected


def test_preemption(tiny):
    path, prompts, expected = tiny
    # 12 pages of 16 tokens: the longest request alone needs 8, so they cannot all run together
    got, llm = _run(path, prompts, num_pages=12, max_model_len=192)
    assert got == expected
    assert llm.llm_engine.get_stats().num_preemptions_total > 0


@pytest.mark.parametrize(
    "kwargs",
    [{}, dict(max_num_batched_tokens=8, page_size=4), dict(num_pages=12, max_model_len=192)],
    ids=["default", "small-chunks", "preemption"],
)
def test_async_scheduling_gives_the_same_tokens(tiny, kwargs):
    """Step N+1 launched before step N's tokens reach the host (its decode rows read them on
    the device): the same greedy tokens, with chunking, prefix hits and preemption."""
    path, prompts, expected = tiny
    got, llm = _run(path, prompts, async_scheduling=True, **kwargs)
    assert got == expected
    engine = llm.llm_engine
    assert engine.async_scheduling and not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    if "num_pages" in kwargs:
        assert stats.num_preemptions_total > 0


def test_async_scheduling_stops_where_sync_does(tiny):
    """Stop tokens and max_tokens under async scheduling: each request ends exactly where the
    synchronous engine ends it, although one extra step was already launched for it."""
    path, prompts, expected = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", async_scheduling=True)
    params = []
    for i, exp in enumerate(expected):
        if i % 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i, ignore_eos=True))
        else:
            params.append(
                SamplingParams(temperature=0.0, max_tokens=NUM_NEW, stop_token_ids=[exp[9]])
            )
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        if i % 2:
            assert out.outputs[0].token_ids == exp[: 1 + i]
            assert out.outputs[0].finish_reason == "length"
        else:
            cut = min(exp.index(t) for t in (exp[9], 2) if t in exp) + 1  # stop id or EOS (2)
            assert out.outputs[0].token_ids == exp[:cut]
            assert out.outputs[0].finish_reason == "stop"
    stats = llm.llm_engine.get_stats()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
