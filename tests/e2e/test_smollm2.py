"""End to end on the embedded default model (SmolLM2-135M-Instruct, GGUF): greedy parity with
HF transformers loading the same GGUF in fp32, seeded sampling, stops, n > 1, chat, and refusal of
bad input without harm to the engine."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.models.weights import gguf_path
from tests.e2e.hf_reference import hf_greedy

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. The waves",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "In 1969, astronauts landed on the Moon for the first time. The mission was called Apollo "
    "11, and the crew consisted of Neil Armstrong, Buzz Aldrin and Michael Collins. After the",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # the fp32 reference path (blocks dequantized at load), which HF parity is about
    return LLM(
        "smollm2", dtype="float32", device="cpu", max_model_len=1024, gguf_keep_quantized=False
    )


def test_greedy_matches_hf_on_gguf(llm):
    from transformers import AutoModelForCausalLM

    path = gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    ).eval()
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)  # different lengths
    expected = [hf_greedy(hf, p, 64) for p in ids]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    assert outs[0].outputs[0].text == tok.decode(expected[0], skip_special_tokens=True)


def test_chat_answers_sensibly(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ended on the end-of-turn token, not on length


def test_seeded_sampling_reproducible_alone_and_in_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(temperature=0.7, max_tokens=16, seed=7, ignore_eos=True),
    ]
    batch = llm.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]],
        [others[0], others[1], seeded, others[2]],
        use_tqdm=False,
    )
    assert batch[2].outputs[0].token_ids == alone
    different = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=99, ignore_eos=True)
    assert llm.generate([PROMPTS[1]], different, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_string_not_emitted(llm):
    greedy = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
    )[0].outputs[0]
    words = greedy.text.split()
    assert len(words) >= 3
    stop = words[2]
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text
    assert greedy.text.startswith(out.text)


def test_stop_token_ids(llm):
    greedy = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False
    )[0].outputs[0]
    stop_id = greedy.token_ids[3]
    out = llm.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    first = greedy.token_ids.index(stop_id)
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_n_completions_share_prompt_pages(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)
    before = llm.llm_engine.get_stats()
    out = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent samples
    assert llm.llm_engine.get_stats().kv_cache_usage == before.kv_cache_usage == 0.0


def test_logprobs(llm):
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    for tid, entry in zip(out.token_ids, out.logprobs):
        assert tid in entry and entry[tid].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        values = [lp.logprob for lp in entry.values()]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=float("nan")),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=2.0),
        dict(max_tokens=0),
        dict(n=0),
        dict(logprobs=100),
        dict(stop=[""]),
    ],
)
def test_bad_parameters_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_bad_requests_refused_and_engine_survives(llm):
    with pytest.raises(ValueError, match="1024"):
        llm.generate(["hello " * 2000], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 10**7]], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_token_counters(llm):
    before = llm.llm_engine.get_stats()
    tok = llm.get_tokenizer()
    prompt = "A completely fresh prompt about counting tokens in an engine"
    n = len(tok(prompt).input_ids)
    llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    after = llm.llm_engine.get_stats()
    assert after.generation_tokens_total - before.generation_tokens_total == 5
    assert after.prompt_tokens_total - before.prompt_tokens_total == n


def test_extreme_seeds_with_n(llm):
    # seed + completion index must stay a valid generator seed at both ends of the range
    for seed in (2**64 - 1, -(2**63)):
        params = SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=seed, ignore_eos=True)
        out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
        assert [len(c.token_ids) for c in out.outputs] == [3, 3]


def test_delta_outputs_add_up_to_the_cumulative_ones(llm):
    """delta=True outputs (what a streaming server sends) concatenate to the final cumulative
    output: text, token ids and logprobs, for every one of n completions."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, n=2, logprobs=2, stop=["."])
    engine.add_request("cum", "The capital of France is", params)
    engine.add_request("delta", "The capital of France is", params, delta=True)
    final: dict[str, object] = {}
    pieces: dict[int, list] = {0: [], 1: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "delta":
                for c in out.outputs:
                    pieces[c.index].append(c)
            if out.finished:
                final[out.request_id] = out
    for c in final["cum"].outputs:
        parts = pieces[c.index]
        assert "".join(p.text for p in parts) == c.text
        assert [t for p in parts for t in p.token_ids] == c.token_ids
        got = [lp for p in parts for lp in p.logprobs]
        assert [sorted(d) for d in got] == [sorted(d) for d in c.logprobs]
        for d_got, d_ref in zip(got, c.logprobs):  # same tokens; batch rows may round apart
            for tid, lp in d_ref.items():
                assert d_got[tid].logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert parts[-1].finish_reason == c.finish_reason
        assert parts[-1].cumulative_logprob == pytest.approx(c.cumulative_logprob, abs=1e-3)
        assert len(parts) > 1


def test_async_scheduling_matches_sync(llm):
    """The same batch through an engine with async scheduling (step N+1 launched before N's
    tokens are on the host): stop strings, seeded n > 1 sampling, a penalty (which makes the
    engine step synchronously while that request runs) and logprobs all give the same result."""
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, stop=["."]),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3),
    ]
    async_llm = LLM("smollm2", dtype="float32", device="cpu", max_model_len=1024,
                    async_scheduling=True, gguf_keep_quantized=False)  # fmt: skip
    want = llm.generate(prompts, params, use_tqdm=False)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert (gc.text, gc.token_ids, gc.finish_reason) == (
                wc.text,
                wc.token_ids,
                wc.finish_reason,
            )
            if wc.logprobs is not None:
                assert [sorted(d) for d in gc.logprobs] == [sorted(d) for d in wc.logprobs]
    engine = async_llm.llm_engine
    assert engine.async_scheduling and engine._num_sync_groups == 0
    assert engine.get_stats().kv_cache_usage == 0.0
    # aborting with a step in flight: nothing leaks, the engine keeps serving
    engine.add_request("x", "Hello", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("x")
    while engine.has_unfinished_requests():
        assert engine.step() == []
    assert engine.get_stats().kv_cache_usage == 0.0 and engine.get_stats().num_running == 0
    assert async_llm.generate(prompts[:1], params[0], use_tqdm=False)[0].outputs[0].text == (
        want[0].outputs[0].text
    )
