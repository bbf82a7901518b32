"""What a request asks its output to match: ``StructuredOutputsParams`` (vLLM's names).

Exactly one of ``json`` (a JSON schema, as a dict or a JSON string), ``regex``, ``choice`` (a
list of strings), ``grammar`` (EBNF in the backend's dialect) or ``json_object=True`` (any JSON
object) is set. Construction checks everything that can be checked without a tokenizer and
bounds the work a grammar may cost: the schema's serialized size and nesting depth, the regex
and grammar lengths, the number and length of choices. Over a bound, or a value of the wrong
type, raises ``ValueError`` naming the field, so a request is refused before it reaches the
engine. ``key`` is the canonical text a compiled grammar is cached under.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_SPEC_CHARS = 64 * 1024
"""Longest JSON schema (serialized), regex or grammar accepted."""
MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of objects and arrays inside a JSON schema document."""
MAX_CHOICES = 256
"""Most alternatives in ``choice``."""
MAX_CHOICE_CHARS = 1024
"""Longest single alternative in ``choice``."""


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON document; stops counting past ``limit`` (no deep recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


@dataclass
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    """A JSON schema the output must validate against (dict or its JSON text)."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF-style, root rule ``root``) the output must match."""
    json_object: bool = False
    """The output is any JSON object."""
    field_name: str = field(default="structured_outputs", repr=False, compare=False)
    """The request field the constraint came from, named in errors (``response_format``,
    ``guided_json``, ...)."""
    _key: tuple[str, str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = self.field_name
        kinds = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if not isinstance(self.json_object, bool):
            raise ValueError(f"{where}: json_object must be a bool")
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(
                f"{where}: set exactly one of json, regex, choice, grammar, json_object "
                f"(got {kinds or 'none'})"
            )
        if self.json is not None:
            self.json = self._checked_schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"{where}: {name} must be a non-empty string")
            if len(value) > MAX_SPEC_CHARS:
                raise ValueError(
                    f"{where}: {name} is {len(value)} characters, more than {MAX_SPEC_CHARS}"
                )
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice:
                raise ValueError(f"{where}: choice must be a non-empty list of strings")
            if len(choice) > MAX_CHOICES:
                raise ValueError(
                    f"{where}: choice holds {len(choice)} items, more than {MAX_CHOICES}"
                )
            for c in choice:
                if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                    raise ValueError(
                        f"{where}: each choice must be a string of 1 to {MAX_CHOICE_CHARS} "
                        "characters"
                    )
            self.choice = list(choice)

    def _checked_schema(self, schema: dict[str, Any] | str) -> dict[str, Any]:
        where = self.field_name
        if isinstance(schema, str):
            if len(schema) > MAX_SPEC_CHARS:
                raise ValueError(f"{where}: the JSON schema is longer than {MAX_SPEC_CHARS} chars")
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise ValueError(f"{where}: the JSON schema must be a JSON object")
        depth = _depth(schema, MAX_SCHEMA_DEPTH)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"{where}: the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
            )
        try:
            text = json.dumps(schema, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: the JSON schema is not serializable JSON: {e}") from e
        if len(text) > MAX_SPEC_CHARS:
            raise ValueError(
                f"{where}: the JSON schema is {len(text)} characters, more than {MAX_SPEC_CHARS}"
            )
        return schema

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints compile once. Computed once per object
        (requests sharing a ``SamplingParams`` share it: ~0.3 ms of JSON a request saved)."""
        if self._key is None:
            self._key = self._make_key()
        return self._key

    def _make_key(self) -> tuple[str, str]:
        kind = self.kind
        if kind == "json":
            return kind, json.dumps(self.json, sort_keys=True)
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)
