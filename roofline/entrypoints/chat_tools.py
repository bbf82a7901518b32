"""Tools in offline ``LLM.chat``: the same validation, rendering, constraint and parsing as the
server's chat completions, without the web stack.

:func:`prepare_chat` validates ``tools`` / ``tool_choice`` (a :class:`ToolError`, which is a
``ValueError``, before anything reaches the engine), renders the conversation (a template that
reads ``tools`` gets them natively, others a Hermes-style system message) and returns the prompt
and the plan; :func:`tool_sampling_params` adds the JSON-schema constraint that ``required`` or a
named function puts on the output; :func:`attach_tool_calls` reads each finished completion with
the model's tool parser and sets ``CompletionOutput.tool_calls`` (OpenAI-shaped: id, type,
function name and arguments JSON), ``content`` (the text outside the calls) and
``finish_reason="tool_calls"`` when calls were parsed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from roofline.entrypoints.openai.chat_output import ChoiceParser, tool_call_id
from roofline.entrypoints.openai.tool_parsers import get_tool_parser
from roofline.entrypoints.openai.tools import (
    ToolError,
    ToolPlan,
    plan_tools,
    render_messages,
    template_reads_tools,
)
from roofline.outputs import RequestOutput
from roofline.sampling_params import SamplingParams

__all__ = ["ToolError", "attach_tool_calls", "prepare_chat", "tool_sampling_params"]


def prepare_chat(
    engine: Any,
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    add_generation_prompt: bool,
) -> tuple[str, ToolPlan | None]:
    """(The rendered prompt text, the tool plan or None)."""
    plan = plan_tools(tools, tool_choice, parallel_tool_calls)
    tokenizer = engine.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    native = template_reads_tools(template if isinstance(template, str) else None)
    messages = list(conversation)
    if plan is not None or any(m.get("role") == "tool" or "tool_calls" in m for m in messages):
        messages = render_messages(messages, plan, native)
    if plan is not None and native:
        if tokenizer is None or not template:
            raise ValueError("this model has no chat template")
        text = tokenizer.apply_chat_template(
            messages,
            tools=plan.template_tools(),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return text, plan
    return engine.apply_chat_template(messages, add_generation_prompt), plan


def tool_sampling_params(
    plan: ToolPlan | None,
    params: SamplingParams,
    tool_call_parser: str,
    chat_template: str | None,
    reasoning_parser: Any = None,
) -> tuple[SamplingParams, Callable[[], ChoiceParser] | None]:
    """The parameters with the tool constraint added, and how to read each completion (with
    ``reasoning_parser``, the server's, splitting reasoning content first). Offline and the
    server's chat completions share it; a bad combination is a :class:`ToolError`."""
    if plan is None:
        return params, None
    constraint = plan.constraint()
    if constraint is not None and params.structured_outputs is not None:
        raise ToolError(
            "tool_choice required or a named function cannot be combined with another output "
            "constraint",
            "tool_choice",
        )
    if plan.choice == "required":
        from roofline.entrypoints.openai.tool_parsers.parsers import ArrayParser

        tool_parser = ArrayParser()
    else:
        tool_parser = get_tool_parser(tool_call_parser, chat_template)
    updates: dict[str, Any] = {}
    if constraint is not None:
        updates["structured_outputs"] = constraint
    if tool_parser.keeps_special_tokens:
        updates["skip_special_tokens"] = False
    if updates:
        params = dataclasses.replace(params, **updates)
    named = plan.named if plan.choice == "named" else None
    return params, lambda: ChoiceParser(tool_parser, reasoning_parser, named)


def attach_tool_calls(
    outputs: list[RequestOutput], make_parsers: list[Callable[[], ChoiceParser] | None]
) -> None:
    """Parse each finished completion's tool calls onto it (in place)."""
    for output, make_parser in zip(outputs, make_parsers):
        if make_parser is None:
            continue
        for completion in output.outputs:
            parsed = make_parser().parse(completion.text)
            completion.tool_calls = [
                {"id": tool_call_id(), "type": "function", "function": {"name": n, "arguments": a}}
                for n, a in parsed.calls
            ]
            completion.content = parsed.content
            if completion.tool_calls and completion.finish_reason == "stop":
                completion.finish_reason = "tool_calls"
