"""Tool-call and reasoning parsing without a model: every family's format read whole and
streamed in pieces of every size (the pieces must add up to the whole), tags never leaked as
content, bad tools and tool choices refused, and constraint parameters bounded."""

from __future__ import annotations

import json

import pytest

from roofline.entrypoints.openai.chat_output import ChoiceParser
from roofline.entrypoints.openai.reasoning import get_reasoning_parser
from roofline.entrypoints.openai.tool_parsers import default_parser_name, get_tool_parser
from roofline.entrypoints.openai.tool_parsers.parsers import ArrayParser
from roofline.entrypoints.openai.tools import ToolError, plan_tools, render_messages
from roofline.structured_output.params import MAX_SCHEMA_DEPTH, StructuredOutputsParams

ARGS = '{"city": "Paris \\"15e\\"", "days": [1, 2], "unit": "c"}'
CASES = [
    (
        "hermes",
        f'Sure.<tool_call>\n{{"name": "weather", "arguments": {ARGS}}}\n</tool_call>',
        "Sure.",
        [("weather", ARGS)],
    ),
    (
        "hermes",
        f'<tool_call>{{"name": "a", "arguments": {{}}}}</tool_call>\n<tool_call>'
        f'{{"name": "b", "arguments": {ARGS}}}</tool_call>',
        None,
        [("a", "{}"), ("b", ARGS)],
    ),
    ("hermes", "No tools needed <tool here.", "No tools needed <tool here.", []),
    ("llama3_json", f'{{"name": "weather", "parameters": {ARGS}}}', None, [("weather", ARGS)]),
    (
        "llama3_json",
        f'<|python_tag|>{{"name": "a", "parameters": {{"x": 1}}}}; '
        f'{{"name": "b", "parameters": {ARGS}}}',
        None,
        [("a", '{"x": 1}'), ("b", ARGS)],
    ),
    ("llama3_json", "Paris is in France.", "Paris is in France.", []),
    (
        "mistral",
        f'Let me check.[TOOL_CALLS] [{{"name": "weather", "arguments": {ARGS}}}]',
        "Let me check.",
        [("weather", ARGS)],
    ),
]


def _stream(make, text: str, size: int) -> tuple[str, str, list[tuple[str, str]]]:
    parser = make()
    content, reasoning, calls = "", "", {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        delta = parser.delta(piece, final=i == len(pieces) - 1)
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            if "id" in call:
                assert call["id"].startswith("call_") and call["function"]["arguments"] == ""
                entry[0] = call["function"]["name"]
            entry[1] += call["function"]["arguments"]
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_tool_formats_whole_and_streamed(name, text, content, calls) -> None:
    make = lambda: ChoiceParser(get_tool_parser(name))
    parsed = make().parse(text)
    assert parsed.content == content
    assert parsed.calls == calls
    for _, args in parsed.calls:
        json.loads(args)
    for size in (1, 2, 3, 7, len(text)):
        s_content, _, s_calls = _stream(make, text, size)
        assert (s_content or None) == content
        assert s_calls == calls
        if calls:  # no half tag ever leaked as content
            assert "<tool" not in s_content and "[TOOL" not in s_content


def test_required_array_and_named_function() -> None:
    text = f'[{{"name": "weather", "parameters": {ARGS}}}, {{"name": "a", "parameters": {{}}}}]'
    make = lambda: ChoiceParser(ArrayParser())
    assert make().parse(text).calls == [("weather", ARGS), ("a", "{}")]
    assert _stream(make, text, 3)[2] == [("weather", ARGS), ("a", "{}")]
    named = lambda: ChoiceParser(None, None, "weather")
    assert named().parse(ARGS).calls == [("weather", ARGS)]
    assert _stream(named, ARGS, 4)[2] == [("weather", ARGS)]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_split_streamed(parser) -> None:
    text = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4."
    make = lambda: ChoiceParser(reasoning_parser=get_reasoning_parser(parser))
    parsed = make().parse(text)
    assert parsed.reasoning == "\nThe user wants 2+2. That is 4.\n"
    assert parsed.content == "The answer is 4."
    for size in (1, 2, 5, len(text)):
        content, reasoning, _ = _stream(make, text, size)
        assert (content, reasoning) == ("The answer is 4.", parsed.reasoning)
    plain = make().parse("Just 4.")
    if parser == "qwen3":
        assert (plain.reasoning, plain.content) == (None, "Just 4.")
    else:  # R1 starts in reasoning
        assert (plain.reasoning, plain.content) == ("Just 4.", None)
        assert make().parse("thinking</think>done").content == "done"


def test_reasoning_then_tool_call() -> None:
    text = f'<think>need weather</think><tool_call>{{"name": "w", "arguments": {ARGS}}}</tool_call>'
    make = lambda: ChoiceParser(get_tool_parser("hermes"), get_reasoning_parser("qwen3"))
    parsed = make().parse(text)
    assert (parsed.reasoning, parsed.content, parsed.calls) == ("need weather", None, [("w", ARGS)])
    assert _stream(make, text, 2) == ("", "need weather", [("w", ARGS)])


TOOL = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "tools,choice,param",
    [
        (
            [{"type": "function", "function": {"description": "no name"}}],
            None,
            "tools[0].function.name",
        ),
        ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "w", "parameters": {"type": "array"}}}],
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "w", "parameters": [1]}}],
            None,
            "tools[0].function.parameters",
        ),
        ([TOOL], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
        ([TOOL], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
        ([TOOL, TOOL], None, "tools"),
        ([{"type": "retrieval"}], None, "tools[0]"),
    ],
)
def test_bad_tools_refused(tools, choice, param) -> None:
    with pytest.raises(ToolError) as e:  # a ValueError; the server makes it a 400
        plan_tools(tools, choice, None)
    assert isinstance(e.value, ValueError) and e.value.param == param


def test_tool_constraints_and_rendering() -> None:
    plan = plan_tools([TOOL], "required", False)
    schema = plan.constraint().json
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {
        "const": "w"
    }
    assert plan_tools([TOOL], "auto", None).constraint() is None
    assert plan_tools([TOOL], "none", None) is None
    named = plan_tools([TOOL], {"type": "function", "function": {"name": "w"}}, None)
    assert named.constraint().json == {"type": "object"}
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"a": 1}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    hermes = render_messages(history, plan, native=False)
    assert hermes[0]["role"] == "system" and "<tools>" in hermes[0]["content"]
    assert hermes[2]["content"] == '<tool_call>\n{"name": "w", "arguments": {"a": 1}}\n</tool_call>'
    assert hermes[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    native = render_messages(history, plan, native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert default_parser_name("... [TOOL_CALLS] ...") == "mistral"
    assert default_parser_name("<|python_tag|>") == "llama3_json"
    assert default_parser_name(None) == "hermes"


def test_constraint_params_bounded() -> None:
    deep: dict = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(ValueError, match="deeper"):
        StructuredOutputsParams(json=deep, field_name="response_format")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="characters"):
        StructuredOutputsParams(regex="a" * 70000)
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{oops")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    assert (
        StructuredOutputsParams(json='{"type": "object"}').key
        == StructuredOutputsParams(json={"type": "object"}).key
    )
