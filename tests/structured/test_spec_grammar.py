"""Speculative decoding with grammar-constrained requests (CPU, a tiny random Llama and a
synthetic byte-level vocabulary): proposals are cut at their first forbidden token, every
verified position is masked, and greedy output is identical with and without speculation."""

from __future__ import annotations

import re

import pytest

from roofline import LLM, SamplingParams
from roofline.structured_output import StructuredOutputsParams
from roofline.structured_output.bench import synthetic_backend, synthetic_vocab
from tests.e2e.hf_reference import tiny_hf_model

VOCAB, EOS = 320, 2
REGEX = r"[a-h]{2,6}( [a-h]{1,5}){2,9}\."
PROMPTS = [[5 + i, 40 + 3 * i, 77, 9 + i] * (1 + i) for i in range(4)] + [[11, 12, 13, 14] * 6]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", path, seed=0)
    return str(path)


def _run(model: str, params: list[SamplingParams], **kwargs):
    llm = LLM(model, dtype="float32", device="cpu", **kwargs)
    llm.llm_engine.grammars.use_backend(synthetic_backend(VOCAB, EOS))
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine


def _params() -> list[SamplingParams]:
    regex = StructuredOutputsParams(regex=REGEX)
    choice = StructuredOutputsParams(choice=["abc def", "abc deg", "bad"])
    return [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=regex),
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=choice),
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=regex),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),  # unconstrained
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=regex),
    ]


@pytest.fixture(scope="module")
def reference(model):
    tokens, _ = _run(model, _params())
    return tokens


def _text(token_ids: list[int]) -> str:
    vocab = synthetic_vocab(VOCAB)
    return b"".join(vocab[t] for t in token_ids if t != EOS).decode()


def test_reference_matches_its_constraints(reference) -> None:
    for i in (0, 2, 4):
        assert re.fullmatch(REGEX, _text(reference[i])), _text(reference[i])
    assert _text(reference[1]) in ("abc def", "abc deg", "bad")


@pytest.mark.parametrize("method", ["self_draft", "ngram"])
def test_greedy_identical_with_speculation(model, reference, method) -> None:
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
        spec["disable_by_batch_size"] = 64
    else:  # the target drafts for itself, unconstrained: its proposals often break the grammar
        spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 4}
        spec["disable_by_batch_size"] = 64
    tokens, engine = _run(model, _params(), speculative_config=spec)
    assert tokens == reference
    stats = engine.spec.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    if method == "self_draft":
        assert stats.num_accepted_tokens > 0


def test_async_scheduling_identical(model, reference) -> None:
    """The overlapped path (the mask filled after the previous step is folded in, while the
    next forward is queued) gives the synchronous tokens."""
    tokens, engine = _run(model, _params(), async_scheduling=True)
    assert tokens == reference
    masks = engine.grammars.manager.masks
    assert masks.num_applies > 0 and masks.num_slots_used == 0  # every slot released
