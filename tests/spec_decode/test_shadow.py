"""Shadow proposals: while the adaptive switch keeps speculation off, an n-gram proposer is still
asked every few steps for a few requests' proposals, and the tokens those requests emit decide
them as a greedy verification would (accepted prefix, first rejection), so the switch learns the
acceptance without a speculative step; finished requests drop out; a draft model never shadows."""

from __future__ import annotations

from roofline.request import Request, RequestStatus
from roofline.sampling_params import SamplingParams
from roofline.spec_decode.config import SpeculativeConfig
from roofline.spec_decode.decoder import SpecDecoder
from roofline.spec_decode.draft_model import DraftModelProposer
from roofline.spec_decode.ngram import NgramProposer
from roofline.spec_decode.switch import SHADOW_EVERY, AdaptiveSwitch

K = 3


def _decoder(ratio: float) -> SpecDecoder:
    dec = SpecDecoder(SpeculativeConfig("ngram", K), NgramProposer(K, 1, 3), 64, 4096)
    dec.switch = AdaptiveSwitch(K, {8: 1.0}, {8: ratio}, 0.6, (0.0, 0.0), shadows=True)
    return dec


def _running(prompts: list[list[int]]) -> list[Request]:
    out = []
    for i, p in enumerate(prompts):
        r = Request(f"r{i}", p, SamplingParams(max_tokens=100), max_tokens=100)
        r.status = RequestStatus.RUNNING
        r.output_token_ids = [p[0]]  # decoding: the prompt repeats from its first token
        out.append(r)
    return out


def _step_until_shadowed(dec: SpecDecoder, running: list[Request]) -> None:
    for _ in range(SHADOW_EVERY):
        assert not dec.active(len(running), running)  # speculation never pays here
        if dec._shadows:
            return
    raise AssertionError("no shadow round")


def test_shadow_proposals_are_decided_by_the_emitted_tokens():
    dec = _decoder(ratio=50.0)
    running = _running([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    _step_until_shadowed(dec, running)
    proposals = {r.request_id: toks for r, _, toks in dec._shadows}
    assert proposals == {"r0": [11, 12, 13], "r1": [21, 22, 23]}
    assert not any(r.spec_token_ids for r in running)  # nothing is verified by a step
    # r0 emits its proposals; r1 emits the first, then something else
    running[0].output_token_ids += [11, 12]
    running[1].output_token_ids += [21, 99]
    dec.active(len(running), running)
    sw = dec.switch
    assert "r0" not in sw.requests or sw.requests["r0"].successes == 0  # not all known yet
    assert sw.requests["r1"].successes == 1 and sw.requests["r1"].failures == 1
    running[0].output_token_ids += [13]
    dec.active(len(running), running)
    assert sw.requests["r0"].successes == K and sw.requests["r0"].failures == 0
    assert sw.num_shadowed == 2


def test_shadows_of_finished_requests_are_dropped():
    dec = _decoder(ratio=50.0)
    running = _running([[10, 11, 12, 13, 14]])
    _step_until_shadowed(dec, running)
    dec.remove(["r0"])
    assert not dec._shadows
    running = _running([[30, 31, 32, 33]])
    _step_until_shadowed(dec, running)
    running[0].status = RequestStatus.FINISHED_LENGTH
    dec.active(1, running)
    assert not dec._shadows and dec.switch.num_shadowed == 0


def test_measured_acceptance_turns_speculation_on_without_a_probe():
    # the prior (0.05) says off; the shadows find every proposal accepted
    dec = _decoder(ratio=1.5)
    dec.switch.alpha_prior = 0.05
    running = _running([[i, i + 1, i + 2, i + 3, i + 4] for i in range(0, 80, 10)])
    on_at = None
    for step in range(200):
        on = dec.active(len(running), running)
        if on:
            on_at = step
            break
        for r in running:  # each request continues its prompt's pattern: 1 token per step
            r.output_token_ids.append(r.prompt_token_ids[len(r.output_token_ids) % 5])
    # on as soon as a shadow round moved the estimate (not REEVALUATE_STEPS later)
    assert on_at is not None and on_at < 3 * SHADOW_EVERY and dec.switch.num_on_steps == 1
    assert dec.switch.pooled_alpha() > 0.6


def test_a_draft_model_never_shadows():
    assert DraftModelProposer.shadows is False and NgramProposer.shadows is True
