"""Reasoning parsers: the ``<think>...</think>`` part of a reasoning model's answer becomes
``reasoning_content``, the rest ``content`` (``--reasoning-parser``).

``qwen3``: reasoning only when the answer opens with ``<think>``. ``deepseek_r1``: the answer
starts in reasoning even without the opening tag (R1's template puts it in the prompt), up to
``</think>``. A stream holds back characters that may be half a tag.
"""

from __future__ import annotations

from typing import NamedTuple

from roofline.entrypoints.openai.tool_parsers.scan import held_back

OPEN, CLOSE = "<think>", "</think>"


class ReasoningSplit(NamedTuple):
    reasoning: str
    content_start: int | None
    """Where the content begins in the text (None: still reasoning, or undecided)."""


class ReasoningParser:
    def __init__(self, starts_in_reasoning: bool) -> None:
        self.starts_in_reasoning = starts_in_reasoning

    def split(self, text: str, final: bool) -> ReasoningSplit:
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if stripped.startswith(OPEN):
            body = lead + len(OPEN)
        elif not final and OPEN.startswith(stripped):  # empty, or half the opening tag
            return ReasoningSplit("", None)
        elif self.starts_in_reasoning:
            body = 0
        else:
            return ReasoningSplit("", 0)
        close = text.find(CLOSE, body)
        if close >= 0:
            after = close + len(CLOSE)
            while after < len(text) and text[after] == "\n":
                after += 1
            return ReasoningSplit(text[body:close], after)
        end = len(text) - (0 if final else held_back(text, CLOSE))
        return ReasoningSplit(text[body:end], None)


REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None or name == "none":
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}"
        )
    return ReasoningParser(REASONING_PARSERS[name])
