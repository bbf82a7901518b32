"""The stop-string matcher: the same answers as a brute-force search (first position where a
stop string ends, the longest tail to hold back), under any chunking of the text; and its work,
counted in characters compared (not wall-clock time), grows with the new text only: not with
the text already generated, not with the stops' number or length."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roofline.engine.detokenizer import IncrementalDetokenizer
from roofline.engine.stop_matcher import StopAutomaton, StopMatcher, automaton_for
from roofline.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams


def brute_first_match(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(stop index, end) of the first end position of any stop; longest, then first listed."""
    for end in range(1, len(text) + 1):
        best = None
        for i, s in enumerate(stops):
            if text.endswith(s, 0, end) and (best is None or len(s) > len(stops[best])):
                best = i
        if best is not None:
            return best, end
    return None


def brute_pending(text: str, stops: list[str]) -> int:
    return max(
        (k for k in range(1, len(text) + 1) for s in stops if s.startswith(text[-k:])), default=0
    )


def feed_in_chunks(matcher: StopMatcher, text: str, cuts: list[int]) -> tuple[int, int] | None:
    pos = 0
    for cut in [*sorted(c for c in cuts if 0 < c < len(text)), len(text)]:
        match = matcher.feed(text[pos:cut])
        if match is not None:
            return match.stop_index, match.end
        pos = cut
    return None


ALPHABET = "abc"


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=5),
    text=st.text(ALPHABET, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_matches_brute_force_under_any_chunking(stops: list[str], text: str, cuts: list[int]):
    automaton = StopAutomaton(tuple(stops))
    found = feed_in_chunks(StopMatcher(automaton), text, cuts)
    expected = brute_first_match(text, stops)
    if expected is None:
        assert found is None
    else:
        assert found is not None
        assert found[1] == expected[1]
        assert stops[found[0]] == stops[expected[0]]  # equal strings: either index is the same
        assert found[0] == stops.index(stops[found[0]])  # ... and the first listed is reported
    matcher = StopMatcher(automaton)
    for i, ch in enumerate(text):
        matcher.feed(ch, report=False)
        assert matcher.num_pending_chars == brute_pending(text[: i + 1], stops)


def test_unicode_and_overlapping_stops() -> None:
    m = StopMatcher(StopAutomaton(("é\n", "\n\n", "ねこ")))
    assert m.feed("abcé") is None and m.num_pending_chars == 1
    assert m.feed("\n") == (0, 5)
    m = StopMatcher(StopAutomaton(("abab", "bab")))
    assert m.feed("aba") is None and m.num_pending_chars == 3
    assert m.feed("b") == (0, 4)  # both end here: the longer one


def steady_work(stop_chars: int, num_stops: int, num_prior_chars: int) -> list[int]:
    """Characters compared by each of 20 updates of 4 characters, after ``num_prior_chars``
    characters of text: stops of ``stop_chars`` characters that the text keeps almost matching
    (the worst case for a naive scan of every tail against every stop)."""
    stops = tuple("a" * (stop_chars - 1) + chr(ord("b") + i) for i in range(num_stops))
    matcher = StopMatcher(automaton_for(stops))
    text = "a" * num_prior_chars
    for i in range(0, len(text), 64):
        assert matcher.feed(text[i : i + 64]) is None
    work = []
    for _ in range(20):
        before = matcher.work
        assert matcher.feed("aaaa") is None
        work.append(matcher.work - before)
    return work


def test_work_per_update_does_not_grow_with_text_or_stops() -> None:
    small = steady_work(stop_chars=8, num_stops=1, num_prior_chars=1_000)
    long_text = steady_work(stop_chars=8, num_stops=1, num_prior_chars=50_000)
    big_stops = steady_work(MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, num_prior_chars=50_000)
    assert small == long_text == big_stops
    assert max(big_stops) <= 2 * 4  # at most two comparisons per new character


@pytest.mark.parametrize("seed", range(3))
def test_total_work_is_at_most_two_comparisons_per_character(seed: int) -> None:
    # A random walk over a tiny alphabet with long, self-similar stops: failure links are taken
    # often, yet each one shortens the matched tail that earlier characters built.
    rng = random.Random(seed)
    stops = tuple(
        "".join(rng.choice("ab") for _ in range(rng.randint(1, MAX_STOP_STRING_CHARS)))
        + "c" * (i + 1)
        for i in range(MAX_STOP_STRINGS)
    )
    matcher = StopMatcher(automaton_for(stops))
    num_chars = 0
    for _ in range(2_000):
        chunk = "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
        assert matcher.feed(chunk) is None
        num_chars += len(chunk)
        assert matcher.work <= 2 * num_chars


def test_detokenizer_work_is_linear_in_generated_text() -> None:
    class CharTokenizer:  # token id = code point
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(map(chr, ids))

    stops = ["x" * (MAX_STOP_STRING_CHARS - 1) + chr(0x100 + i) for i in range(MAX_STOP_STRINGS)]
    detok = IncrementalDetokenizer(CharTokenizer(), [ord("x")], SamplingParams(stop=stops))
    emitted = []
    for i in range(5_000):
        emitted.append(detok.update([ord("x" if i % 700 else "y")]).text_delta)
    matcher = detok._matcher
    assert matcher is not None and matcher.num_fed_chars == 5_000
    assert matcher.work <= 2 * 5_000
    # what is held back is the tail that could still begin a stop: at most a stop's length
    assert 5_000 - len("".join(emitted)) == matcher.num_pending_chars < MAX_STOP_STRING_CHARS
