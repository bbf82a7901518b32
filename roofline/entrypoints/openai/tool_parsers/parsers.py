"""The tool-call formats of the model families: Hermes (``<tool_call>{json}</tool_call>``:
Qwen2.5, Qwen3, SmolLM2 and Hermes models), Llama 3 (a bare JSON object, optionally after
``<|python_tag|>``, calls separated by ``;``) and Mistral (``[TOOL_CALLS]`` then a JSON array).
"""

from __future__ import annotations

from typing import NamedTuple

from roofline.entrypoints.openai.tool_parsers.scan import held_back


class Split(NamedTuple):
    content_end: int
    """``text[:content_end]`` is plain content (held-back characters excluded)."""
    region_start: int | None
    """Where tool calls begin, None if there are none (yet)."""


class ToolParser:
    name = "base"
    keeps_special_tokens = False
    """The format's markers are special tokens: detokenize without skipping them."""

    def split(self, text: str, final: bool) -> Split:
        raise NotImplementedError


class _MarkerParser(ToolParser):
    marker = ""

    def split(self, text: str, final: bool) -> Split:
        at = text.find(self.marker)
        if at >= 0:
            return Split(at, at + len(self.marker))
        return Split(len(text) - (0 if final else held_back(text, self.marker)), None)


class HermesParser(_MarkerParser):
    name = "hermes"
    marker = "<tool_call>"


class MistralParser(_MarkerParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    keeps_special_tokens = True


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"
    keeps_special_tokens = True

    def split(self, text: str, final: bool) -> Split:
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if stripped.startswith(self.tag):
            return Split(lead, lead + len(self.tag))
        if stripped.startswith("{"):
            return Split(lead, lead)
        if not final and self.tag.startswith(stripped):  # empty, or half the tag
            return Split(0, None)
        return Split(len(text), None)


class ArrayParser(ToolParser):
    """What ``tool_choice="required"`` constrains the output to: a JSON array of
    ``{"name": ..., "parameters": {...}}`` objects, nothing else."""

    name = "required"

    def split(self, text: str, final: bool) -> Split:
        return Split(0, 0)


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama3": Llama3JsonParser,
    "mistral": MistralParser,
}


def default_parser_name(chat_template: str | None) -> str:
    """The format a chat template's model was trained on (Hermes unless it says otherwise)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def get_tool_parser(name: str, chat_template: str | None = None) -> ToolParser:
    if name == "auto":
        name = default_parser_name(chat_template)
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(PARSERS)}")
    return cls()
