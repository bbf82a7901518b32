"""A stop string that ends inside a verified run: the output stops at the token that completes
it, with and without speculation alike (SmolLM2 on the CPU; the oracle proposes the target's
own continuation, so every proposal is accepted and each verification emits 1 + k tokens)."""

from __future__ import annotations

from roofline import LLM, SamplingParams

PROMPT = "The three primary colors are"
NUM_NEW = 12


def test_stop_string_inside_accepted_run():
    spec = {"method": "oracle", "num_speculative_tokens": 4, "acceptance_rate": 1.0}
    spec["disable_by_batch_size"] = 8
    kw = dict(dtype="float32", device="cpu", max_model_len=256, gguf_keep_quantized=False)
    # one engine: the oracle proposes nothing for a prompt it has no reference for
    plain = spec_llm = LLM("smollm2", speculative_config=spec, **kw)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    (ref,) = plain.generate([PROMPT], greedy, use_tqdm=False)
    ref_ids = list(ref.outputs[0].token_ids)
    tok = plain.get_tokenizer()
    prompt_ids = tok(PROMPT).input_ids
    # the text that tokens 6..7 add: the stop is found while a 1 + 4 token run (tokens 6..10)
    # is folded in, at most at its second token
    before, upto = tok.decode(ref_ids[:6]), tok.decode(ref_ids[:8])
    stop = upto[len(before) :].strip()
    assert stop
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, stop=[stop])
    (expected,) = plain.generate([PROMPT], params, use_tqdm=False)
    proposer = spec_llm.llm_engine.spec.proposer
    proposer.set_reference([prompt_ids], [ref_ids])
    (got,) = spec_llm.generate([PROMPT], params, use_tqdm=False)
    stats = spec_llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens_total >= 4  # verified runs really happened
    want, have = expected.outputs[0], got.outputs[0]
    assert len(want.token_ids) < NUM_NEW and want.finish_reason == "stop"
    assert list(have.token_ids) == list(want.token_ids)
    assert have.text == want.text and have.stop_reason == stop
