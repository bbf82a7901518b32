"""A forgiving JSON scanner for tool calls in model output, complete or cut short.

``scan_calls(text, start)`` finds the top-level JSON objects from ``start`` on (skipping
anything between them: tags, brackets, commas, semicolons) and reads, in each, the string value
of ``"name"`` and the raw text span of ``"arguments"`` (or ``"parameters"``). A value still
being generated is reported as far as it goes: the arguments' text so far, no name until its
string has closed. Spans index into ``text``, so as the text grows a call's arguments only ever
grow: a stream can send the new part and the pieces add up to the final call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"
ARG_KEYS = ("arguments", "parameters")


@dataclass
class CallSpan:
    name: str | None
    """The function name, once its string has closed."""
    args_start: int | None
    """Where the arguments value begins in the text (None: not reached yet)."""
    args_end: int | None
    """Where it ends (None: still open)."""
    complete: bool
    """The whole object has closed."""

    def arguments(self, text: str) -> str:
        if self.args_start is None:
            return ""
        end = len(text) if self.args_end is None else self.args_end
        return text[self.args_start : end].rstrip(_WS)


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """``text[i] == '"'``: the index after the closing quote, None if it has not closed."""
    i += 1
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at ``i``, None if it is still open."""
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        while i < n:
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    while i < n and text[i] not in ",}]" + _WS:  # number, true, false, null
        i += 1
    return i if i < n else None


def _scan_object(text: str, i: int) -> tuple[CallSpan, int | None]:
    """``text[i] == '{'``: the call read from that object and the index after it (None if
    the object has not closed)."""
    call = CallSpan(None, None, None, False)
    i += 1
    n = len(text)
    while True:
        i = _skip_ws(text, i)
        if i >= n:
            return call, None
        c = text[i]
        if c == "}":
            call.complete = True
            return call, i + 1
        if c == ",":
            i += 1
            continue
        if c != '"':
            return call, None  # not an object of string keys: give up on it
        key_end = _string_end(text, i)
        if key_end is None:
            return call, None
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= n or text[i] != ":":
            return call, None
        i = _skip_ws(text, i + 1)
        if i >= n:
            return call, None
        end = _value_end(text, i)
        if key in ARG_KEYS and call.args_start is None:
            call.args_start, call.args_end = i, end
        elif key == "name" and end is not None and text[i] == '"':
            call.name = json.loads(text[i:end])
        if end is None:
            return call, None
        i = end


def scan_calls(text: str, start: int = 0) -> list[CallSpan]:
    calls: list[CallSpan] = []
    i = text.find("{", start)
    while i != -1:
        call, end = _scan_object(text, i)
        calls.append(call)
        if end is None:
            break
        i = text.find("{", end)
    return calls


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker`` (a stream
    holds them back rather than send half a tag as content)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
