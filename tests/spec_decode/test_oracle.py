"""The benchmark oracle: its corruption of a position is fixed per (seed, prompt, position), so
a run is a function of its reference and alpha; the kept fraction is alpha."""

from __future__ import annotations

from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.spec_decode.oracle import OracleProposer

PROMPT = [3, 4, 5]
REF = list(range(10, 2010))


def _at(oracle: OracleProposer, num_output: int) -> list[int]:
    r = Request("r", PROMPT, SamplingParams(max_tokens=4000))
    r.output_token_ids = REF[:num_output]
    return oracle.propose([r], [4]).token_ids[0]


def test_position_keyed_and_alpha_controlled():
    a = OracleProposer(4, 0.7, 50000, seed=1)
    a.set_reference([PROMPT], [REF])
    b = OracleProposer(4, 0.7, 50000, seed=1)
    b.set_reference([PROMPT], [REF])
    # different call orders and alignments: position p is corrupted the same way
    first = {p + i: t for p in range(0, 1996, 4) for i, t in enumerate(_at(a, p))}
    second = {p + i: t for p in range(1, 1996, 3) for i, t in enumerate(_at(b, p))}
    common = sorted(set(first) & set(second))
    assert len(common) > 1000 and all(first[p] == second[p] for p in common)
    kept = sum(first[p] == REF[p] for p in first) / len(first)
    assert abs(kept - 0.7) < 0.04
    assert _at(OracleProposer(4, 0.7, 50000, seed=2), 0) == []  # no reference: no proposals
