"""Stop-string matching whose cost is linear in the text fed to it.

An Aho-Corasick automaton over a request's stop strings (:class:`StopAutomaton`, built once per
distinct stop list and shared by every sequence that uses it) and a cursor into it per sequence
(:class:`StopMatcher`). Each new character of generated text moves the cursor: along a trie
edge when one exists, else down failure links (each failure link shortens the matched suffix by
at least one character, so over a whole stream the failure steps never outnumber the characters
fed: the work is amortized O(1) per character, whatever the number or length of the stops and
however long the text already is). The cursor's depth is, at every moment, the length of the
longest tail of the text that is a prefix of some stop string: exactly what a streaming
detokenizer must hold back so a stop string is never partly emitted. A match is reported at the
first position in the text where any stop string ends; of several ending there, the longest
(it starts first; the first listed among equal strings).

``work`` counts the characters compared (edge lookups, one per character and one per failure
step); the tests assert on it rather than on wall-clock time.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache
from typing import NamedTuple


class StopMatch(NamedTuple):
    stop_index: int
    """Index of the matched string in the stop list."""
    end: int
    """Position just after the match, counted in characters fed since the start."""


class StopAutomaton:
    """The trie of the stop strings with failure links and, per node, the stop string to report
    there (the longest stop that is a suffix of the node's string, or -1)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.children: list[dict[str, int]] = [{}]
        self.depth: list[int] = [0]
        self.fail: list[int] = [0]
        self.report: list[int] = [-1]
        for index, stop in enumerate(stops):
            node = 0
            for ch in stop:
                nxt = self.children[node].get(ch)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][ch] = nxt
                    self.children.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.fail.append(0)
                    self.report.append(-1)
                node = nxt
            if self.report[node] == -1:  # the first listed of equal strings
                self.report[node] = index
        # Breadth first: a node's failure link is shallower, so it is final before the node.
        queue = deque(self.children[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self.children[node].items():
                link = self.fail[node]
                while link and ch not in self.children[link]:
                    link = self.fail[link]
                target = self.children[link].get(ch, 0)
                self.fail[child] = target if target != child else 0
                if self.report[child] == -1:
                    self.report[child] = self.report[self.fail[child]]
                queue.append(child)


@lru_cache(maxsize=16)
def automaton_for(stops: tuple[str, ...]) -> StopAutomaton:
    """The shared automaton of a stop list (a request's n sequences and its prompts share one;
    the stop lists are bounded by ``SamplingParams``, so 16 cached automata stay small)."""
    return StopAutomaton(stops)


class StopMatcher:
    """One sequence's position in a :class:`StopAutomaton`."""

    def __init__(self, automaton: StopAutomaton) -> None:
        self.automaton = automaton
        self.node = 0
        self.num_fed_chars = 0
        self.work = 0
        """Characters compared so far (edge lookups)."""

    @property
    def num_pending_chars(self) -> int:
        """Length of the longest tail of the text fed so far that is a proper prefix of some
        stop string (or a whole one that was not reported): the text to hold back."""
        return self.automaton.depth[self.node]

    def feed(self, text: str, report: bool = True) -> StopMatch | None:
        """Advance over ``text``; the first match that ends in it (the cursor stops there), or
        None. With ``report=False`` matches are passed over (min_tokens not reached yet)."""
        a = self.automaton
        children, fail, report_at = a.children, a.fail, a.report
        node = self.node
        work = 0
        for i, ch in enumerate(text):
            while True:
                work += 1
                nxt = children[node].get(ch)
                if nxt is not None:
                    node = nxt
                    break
                if node == 0:
                    break
                node = fail[node]
            if report and report_at[node] != -1:
                self.node = node
                self.num_fed_chars += i + 1
                self.work += work
                return StopMatch(report_at[node], self.num_fed_chars)
        self.node = node
        self.num_fed_chars += len(text)
        self.work += work
        return None
