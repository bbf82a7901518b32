"""Token-id prompts are checked before anything is queued: a list or tuple of ints, no bools,
no floats; int subclasses still pass (the fast path hands them to the per-element check)."""

from __future__ import annotations

import enum

import pytest

from roofline.engine.prompt import tokenize_prompt


class _Tok(enum.IntEnum):
    A = 5


@pytest.mark.parametrize(
    "ids",
    [[1, 2, 3], (7,), [0] * 2000 + [9], [1, _Tok.A]],
)
def test_int_prompts_pass_as_lists(ids):
    text, out = tokenize_prompt(None, ids)
    assert text is None and out == list(ids) and type(out) is list


@pytest.mark.parametrize(
    "ids",
    [[1, True], [False], [1, 2.0], [1, "2"], [1, None], [[1]], {1, 2}, 3],
)
def test_other_prompts_are_a_value_error(ids):
    with pytest.raises(ValueError, match="list of token ids"):
        tokenize_prompt(None, ids)
