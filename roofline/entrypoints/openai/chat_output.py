"""One chat choice's text turned into OpenAI message parts: ``reasoning_content``, ``content``
and ``tool_calls``, whole (non-streamed) or as the deltas of a stream.

:class:`ChoiceParser` re-reads the text generated so far on every delta (reasoning split, then
the tool parser's split, then the call scanner) and sends what grew since the last delta: new
reasoning or content characters, a call's id and name once its name has closed, then argument
fragments. The final read is the same read with nothing held back, so a stream's pieces add up
to exactly the non-streamed message. A named ``tool_choice`` constrains the output to the
function's arguments: then the whole text is one call's arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from roofline.entrypoints.openai.reasoning import ReasoningParser
from roofline.entrypoints.openai.tool_parsers.parsers import ToolParser
from roofline.entrypoints.openai.tool_parsers.scan import CallSpan, scan_calls


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    calls: list[tuple[str, str]]
    """(name, arguments JSON text) of each complete call."""


@dataclass
class ChoiceParser:
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    named_function: str | None = None
    """The output is this function's arguments (a named ``tool_choice``)."""
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0
    sent_calls: list[tuple[str, int]] = field(default_factory=list)
    """Per call announced in the stream: (id, argument characters sent)."""
    _body: str = ""
    """The text after the reasoning, as last read."""

    def _read(self, final: bool) -> tuple[str, str, list[tuple[str | None, str, bool]]]:
        """(reasoning, content, calls as (name, arguments so far, complete))."""
        text, reasoning = self.text, ""
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.split(text, final)
            reasoning = split.reasoning
            text = "" if split.content_start is None else text[split.content_start :]
        self._body = text
        if self.named_function is not None:
            self._body = text
            stripped = text.strip()
            return reasoning, "", [(self.named_function, stripped, final)] if stripped else []
        if self.tool_parser is None:
            return reasoning, text, []
        split = self.tool_parser.split(text, final)
        content = text[: split.content_end]
        if split.region_start is None:
            return reasoning, content, []
        spans: list[CallSpan] = scan_calls(text, split.region_start)
        calls = [(s.name, s.arguments(text), s.complete) for s in spans]
        return reasoning, content, calls

    def delta(self, new_text: str, final: bool) -> dict[str, Any]:
        """The message delta for ``new_text`` (``final``: the choice finished); may be {}."""
        self.text += new_text
        reasoning, content, calls = self._read(final)
        out: dict[str, Any] = {}
        if len(reasoning) > self.sent_reasoning:
            out["reasoning_content"] = reasoning[self.sent_reasoning :]
            self.sent_reasoning = len(reasoning)
        if len(content) > self.sent_content:
            out["content"] = content[self.sent_content :]
            self.sent_content = len(content)
        deltas = []
        for index, (name, args, _) in enumerate(calls):
            if name is None:
                break  # later calls wait for this one's name
            if index == len(self.sent_calls):
                call_id = tool_call_id()
                self.sent_calls.append((call_id, 0))
                deltas.append(
                    {
                        "index": index,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                )
            call_id, num_sent = self.sent_calls[index]
            if len(args) > num_sent:
                deltas.append({"index": index, "function": {"arguments": args[num_sent:]}})
                self.sent_calls[index] = (call_id, len(args))
        if deltas:
            out["tool_calls"] = deltas
        return out

    @property
    def called_tools(self) -> bool:
        return bool(self.sent_calls)

    def parse(self, text: str) -> ParsedMessage:
        """The whole message of a finished choice (non-streamed answers)."""
        self.text = text
        reasoning, content, calls = self._read(final=True)
        good = []
        for name, args, complete in calls:
            if name is None or not complete:
                continue
            try:
                json.loads(args)
            except json.JSONDecodeError:
                continue
            good.append((name, args))
        if calls and not good and self.named_function is None:
            content = self._body  # no call parsed: the model wrote text after all
        return ParsedMessage(reasoning or None, content or None, good)
