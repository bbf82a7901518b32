"""Tools in chat completions: validating ``tools`` / ``tool_choice``, the constraint that
``required`` or a named function puts on the output, and the conversation as the chat template
sees it.

* **Validation** (:class:`ToolError`, a 400 naming the field on the server): every tool is
  ``{"type": "function", "function": {"name", "description"?, "parameters"?}}`` with a name
  of 1-64 letters, digits, ``_`` or ``-``; parameters, when given, a JSON-schema object of
  type ``object``; names unique;
  ``tool_choice`` one of ``none``, ``auto``, ``required`` or ``{"type": "function",
  "function": {"name": <a tool's name>}}``, and only with tools.
* **Constraints.** ``required``: the output is a JSON array (one item unless
  ``parallel_tool_calls``) of ``{"name": <one of the tools>, "parameters": <its schema>}``; a
  named function: the output is that function's arguments object. Either way the arguments
  always parse. ``auto`` leaves the output free; the tool parser finds the calls.
* **Rendering.** A template that reads a ``tools`` variable gets the tools and the history's
  assistant ``tool_calls`` / ``tool`` messages as they are (arguments as objects, as HF
  templates expect). One that does not (SmolLM2's) gets the tools described in a Hermes-style
  system message, assistant calls as ``<tool_call>`` text, and tool results inside
  ``<tool_response>`` tags. ``tool_choice="none"`` renders no tools.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from roofline.structured_output.params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128


class ToolError(ValueError):
    """Bad ``tools`` / ``tool_choice`` (the server answers 400 naming ``param``; ``LLM.chat``
    raises it as the ``ValueError`` it is). No web stack needed to raise it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _bad(message: str, param: str) -> ToolError:
    return ToolError(message, param)


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]
    """The validated function definitions ({"name", "description", "parameters"})."""
    choice: str
    """none, auto, required or named."""
    named: str | None
    parallel: bool

    def constraint(self) -> StructuredOutputsParams | None:
        if self.choice == "named":
            schema = next(t["parameters"] for t in self.tools if t["name"] == self.named)
            return StructuredOutputsParams(json=schema, field_name="tool_choice")
        if self.choice != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": t["name"]}, "parameters": t["parameters"]},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array, field_name="tool_choice")

    def template_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": t} for t in self.tools]


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None
) -> ToolPlan | None:
    """Validate the request's tools; None when it has none (or ``tool_choice="none"``)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise _bad(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    checked: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-'",
                f"{where}.function.name",
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise _bad(
                f"{where}.function.parameters must be a JSON schema of type object",
                f"{where}.function.parameters",
            )
        params = {"type": "object", **params}
        try:  # bounds (size, depth) of a schema, as for response_format
            StructuredOutputsParams(json=params, field_name=f"{where}.function.parameters")
        except ValueError as e:
            raise _bad(str(e), f"{where}.function.parameters") from e
        entry = {"name": name, "parameters": params}
        if isinstance(fn.get("description"), str):
            entry["description"] = fn["description"]
        checked.append(entry)
    names = [t["name"] for t in checked]
    if len(set(names)) != len(names):
        raise _bad("tool names must be unique", "tools")
    parallel = True if parallel is None else parallel
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan(checked, "auto", None, parallel)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolPlan(checked, "required", None, parallel)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") == "function" and isinstance(name, str):
            if name not in names:
                raise _bad(
                    f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
                )
            return ToolPlan(checked, "named", name, parallel)
    raise _bad(
        "tool_choice must be none, auto, required or {'type': 'function', 'function': "
        "{'name': ...}}",
        "tool_choice",
    )


def template_reads_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools)
    return (
        "You are a function calling AI model. You may call one or more functions to assist "
        "with the user query. Here are the available functions:\n<tools>\n"
        f"{listed}\n</tools>\n"
        "For each function call, return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, native: bool
) -> list[dict[str, Any]]:
    """The messages as the template gets them (``native``: it reads ``tools`` itself)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            if native:
                m["tool_calls"] = [
                    {
                        "id": c.get("id"),
                        "type": "function",
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": _arguments_object(c["function"].get("arguments")),
                        },
                    }
                    for c in calls
                ]
            else:
                text = "\n".join(
                    "<tool_call>\n"
                    + json.dumps(
                        {
                            "name": c["function"]["name"],
                            "arguments": _arguments_object(c["function"].get("arguments")),
                        }
                    )
                    + "\n</tool_call>"
                    for c in calls
                )
                m["content"] = (m.get("content") or "") + text
        if m.get("content") is None:
            m["content"] = ""
        if m["role"] == "tool" and not native:
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
            m.pop("tool_call_id", None)
        out.append(m)
    if plan is not None and not native:
        prompt = hermes_system_prompt(plan.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
