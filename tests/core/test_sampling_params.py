"""SamplingParams validation: every refusal names its field; valid edge values pass."""

from __future__ import annotations

import math

import pytest

from roofline.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, SamplingParams

FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]

REFUSED = [
    # (field, value)
    ("temperature", -0.1),
    ("temperature", -1e-9),
    ("top_p", 0.0),
    ("top_p", 2.0),
    ("top_p", -0.5),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", "4"),
    ("min_p", 1.5),
    ("min_p", -0.01),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("n", 0),
    ("n", -1),
    ("n", MAX_N + 1),
    ("n", 10**9),
    ("n", True),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", -1),
    ("logprobs", 2.0),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("seed", "42"),
    ("stop", [""]),
    ("stop", ["ok", ""]),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
    ("stop", [1, 2]),
    ("stop", 5),
    ("stop", {"a": 1}),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", ["3"]),
    ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("skip_special_tokens", "no"),
    ("include_stop_str_in_output", None),
]


@pytest.mark.parametrize(("field", "value"), REFUSED)
def test_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1.0", None, True])
def test_floats_refuse_non_finite_and_bad_types(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


def test_edges_accepted_and_normalised() -> None:
    p = SamplingParams(
        n=MAX_N,
        temperature=0,
        top_p=1,
        top_k=-1,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1e-3,
        max_tokens=1,
        stop="###",
        stop_token_ids=(3, 4),
        seed=-(2**63),
        logprobs=0,
    )
    assert p.greedy and p.top_k == 0 and p.logprobs == 0
    assert isinstance(p.temperature, float) and isinstance(p.presence_penalty, float)
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4]
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(logprobs=MAX_LOGPROBS, seed=2**64 - 1).logprobs == MAX_LOGPROBS
    assert SamplingParams(stop=["x"] * MAX_STOP_STRINGS).max_stop_len() == 1
    assert SamplingParams(stop=["ab", "abcd"]).max_stop_len() == 4
    assert SamplingParams().max_stop_len() == 0
    assert not SamplingParams(temperature=1e-6).greedy
