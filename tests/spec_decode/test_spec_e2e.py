"""Speculative decoding end to end on tiny random models (CPU): greedy tokens identical with and
without speculation (n-gram; a different draft model; the target as its own draft, where every
proposal must be accepted), batched with requests that do not speculate, with chunked prefill,
preemption and prefix caching; stop ids and max_tokens inside an accepted run; logprobs;
seeded sampling reproducible; a sampled first-tokens distribution unchanged; bad configs
refused before loading."""

from __future__ import annotations

import random

import pytest
import torch

from roofline import LLM, SamplingParams
from tests.e2e.hf_reference import tiny_hf_model

NUM_NEW = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tmp_path_factory.mktemp("target")
    tiny_hf_model("llama", target, seed=0)
    draft = tmp_path_factory.mktemp("draft")
    tiny_hf_model("llama", draft, seed=1, num_hidden_layers=1)
    other_vocab = tmp_path_factory.mktemp("vocab")
    tiny_hf_model("llama", other_vocab, seed=2, vocab_size=256)
    return str(target), str(draft), str(other_vocab)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 320) for _ in range(40)]
    out = [[rng.randrange(3, 320) for _ in range(n)] for n in (1, 9, 30)]
    out.append([11, 12, 13, 14, 15] * 8)  # repeats itself: n-gram proposals get accepted
    out += [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (3, 17)]
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _generate(path, prompts, params=GREEDY, **kwargs):
    llm = LLM(path, dtype="float32", device="cpu", **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.llm_engine


@pytest.fixture(scope="module")
def reference(models):
    outs, _ = _generate(models[0], _prompts())
    return [o.outputs[0].token_ids for o in outs]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 64}


@pytest.mark.parametrize(
    "kwargs",
    [{}, dict(max_num_batched_tokens=8, page_size=4), dict(num_pages=12, max_model_len=192)],
    ids=["default", "small-chunks", "preemption"],
)
def test_ngram_greedy_identical(models, reference, kwargs):
    steps = []
    outs, engine = _generate(models[0], _prompts(), speculative_config=NGRAM, **kwargs)
    assert _tokens(outs) == reference
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens_total > 0
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    if "num_pages" in kwargs:
        assert stats.num_preemptions_total > 0
    else:
        assert stats.prefix_cache_hits_total > 0
    del steps


def test_mixed_batches_with_and_without_proposals(models, reference):
    llm = LLM(models[0], dtype="float32", device="cpu", speculative_config=NGRAM)
    engine = llm.llm_engine
    mixed = []

    def watch(sched_out):
        ks = [len(s.request.spec_token_ids) for s in sched_out.scheduled]
        mixed.append(any(ks) and not all(ks))

    engine.on_schedule = watch
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert _tokens(outs) == reference
    assert any(mixed)


def test_draft_model_greedy_identical(models, reference):
    spec = {"method": "draft_model", "model": models[1], "num_speculative_tokens": 3}
    spec["disable_by_batch_size"] = 64
    outs, engine = _generate(models[0], _prompts(), speculative_config=spec, num_pages=40)
    assert _tokens(outs) == reference
    assert engine.get_stats().spec_decode_num_draft_tokens_total > 0


def test_target_as_its_own_draft_accepts_everything(models, reference):
    spec = {"method": "draft_model", "model": models[0], "num_speculative_tokens": 4}
    spec["disable_by_batch_size"] = 64
    outs, engine = _generate(models[0], _prompts(), speculative_config=spec)
    assert _tokens(outs) == reference
    stats = engine.get_stats()
    assert stats.spec_decode_num_draft_tokens_total > 100
    assert stats.spec_decode_num_accepted_tokens_total == stats.spec_decode_num_draft_tokens_total
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert per_pos[0] >= per_pos[-1] > 0


def test_stop_id_and_max_tokens_inside_accepted_run(models, reference):
    spec = {"method": "draft_model", "model": models[0], "num_speculative_tokens": 4}
    spec["disable_by_batch_size"] = 64
    ref = reference[3]
    stop = ref[9]
    first = ref.index(stop)
    params = [
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, stop_token_ids=[stop], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]
    outs, _ = _generate(models[0], [_prompts()[3]] * 2, params, speculative_config=spec)
    assert outs[0].outputs[0].token_ids == ref[: first + 1]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].token_ids == ref[:7]
    assert outs[1].outputs[0].finish_reason == "length"


def test_logprobs_of_emitted_tokens(models):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompt = [_prompts()[3]]
    base, _ = _generate(models[0], prompt, params)
    self_draft = {"method": "draft_model", "model": models[0], "num_speculative_tokens": 3}
    self_draft["disable_by_batch_size"] = 8
    spec, engine = _generate(models[0], prompt, params, speculative_config=self_draft)
    assert engine.get_stats().spec_decode_num_accepted_tokens_total > 0
    a, b = base[0].outputs[0], spec[0].outputs[0]
    assert a.token_ids == b.token_ids and len(b.logprobs) == 12
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()
        for t in x:
            assert abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank


def test_seeded_sampling_reproducible(models):
    spec = {"method": "draft_model", "model": models[0], "num_speculative_tokens": 3}
    spec["disable_by_batch_size"] = 64
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, n=2)
    runs = [_generate(models[0], _prompts()[3:4], params, speculative_config=spec) for _ in (0, 1)]
    got = [[c.token_ids for o in outs for c in o.outputs] for outs, _ in runs]
    assert got[0] == got[1]
    assert runs[0][1].get_stats().spec_decode_num_accepted_tokens_total > 0


def test_sampled_distribution_unchanged_end_to_end(models):
    """The joint of the first two output tokens (the second emitted by a verification row),
    192 samples with and without speculation: two-sample BHC bound on the 7 most common pairs
    plus the rest, false alarm 1e-6 (fixed seeds). The rejection sampler's own test
    (test_verifier.py) has the statistical power; this checks the engine wiring."""
    prompt = [[7, 8, 9]] * 3
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=64)
    spec = {"method": "draft_model", "model": models[0], "num_speculative_tokens": 1}
    spec["disable_by_batch_size"] = 512
    torch.manual_seed(0)
    base, _ = _generate(models[0], prompt, params, max_num_seqs=512)
    torch.manual_seed(1)
    got, engine = _generate(models[0], prompt, params, speculative_config=spec, max_num_seqs=512)
    assert engine.get_stats().spec_decode_num_drafts_total > 0
    pairs_a = [tuple(c.token_ids[:2]) for o in base for c in o.outputs]
    pairs_b = [tuple(c.token_ids[:2]) for o in got for c in o.outputs]
    # two-sample check on the joint of the first two tokens, top categories pooled
    keys = sorted(set(pairs_a) | set(pairs_b), key=lambda k: -(pairs_a + pairs_b).count(k))[:7]

    def hist(pairs):
        h = [pairs.count(k) / len(pairs) for k in keys]
        return h + [1 - sum(h)]

    l1 = sum(abs(x - y) for x, y in zip(hist(pairs_a), hist(pairs_b)))
    import math

    eps = 2 * math.sqrt(2 * (8 * math.log(2) + math.log(1e6)) / len(pairs_a))  # two samples: 2x
    assert l1 < eps


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 200}, "too large"),
        ({"method": "ngram", "k": 2}, "unknown"),
        ("{not json", "JSON"),
    ],
)
def test_bad_config_is_refused(models, spec, match):
    with pytest.raises(ValueError, match=match):
        LLM(models[0], dtype="float32", device="cpu", max_model_len=64, speculative_config=spec)


def test_draft_with_another_vocabulary_is_refused(models):
    spec = {"method": "draft_model", "model": models[2], "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(models[0], dtype="float32", device="cpu", speculative_config=spec)


def test_metrics_and_bench_summary(models):
    from prometheus_client import CollectorRegistry, generate_latest

    from roofline.entrypoints.openai.metrics import _StatsCollector

    spec = {"method": "draft_model", "model": models[0], "num_speculative_tokens": 2}
    spec["disable_by_batch_size"] = 4
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    _, engine = _generate(models[0], [[5, 6, 7]], params, speculative_config=spec)
    stats = engine.get_stats()
    registry = CollectorRegistry()
    registry.register(_StatsCollector(lambda: stats, "tiny", dict))
    text = generate_latest(registry).decode()
    drafted = stats.spec_decode_num_draft_tokens_total
    assert drafted > 0
    assert f'roofline:spec_decode_num_draft_tokens_total{{model_name="tiny"}} {drafted:.1f}' in text
    assert "roofline:spec_decode_num_accepted_tokens_total" in text
    assert (
        'roofline:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"}'
        in text
    )
    assert "mean accepted length" in engine.spec.stats.summary()


def test_async_batches_switch_to_speculation_and_back(models):
    """Async scheduling on: above the threshold the steps overlap, below it they speculate."""
    prompts = _prompts()
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 4 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    base, _ = _generate(models[0], prompts, params)
    spec = dict(NGRAM, disable_by_batch_size=3)
    got, engine = _generate(
        models[0], prompts, params, speculative_config=spec, async_scheduling=True
    )
    assert _tokens(got) == _tokens(base)
    assert engine.get_stats().spec_decode_num_drafts_total > 0


def test_draft_with_another_tokenizer_is_refused():
    """Same vocabulary size, different token strings: refused before the draft is loaded."""
    from roofline.spec_decode.build import _check_tokenizers

    class _Tok:
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    target = _Tok({"a": 0, "b": 1})
    _check_tokenizers(target, _Tok({"a": 0, "b": 1}))  # the same: accepted
    _check_tokenizers(target, None)  # a config-only draft: the sizes were compared
    with pytest.raises(ValueError, match="tokenizer"):
        _check_tokenizers(target, _Tok({"a": 0, "c": 1}))
