"""``POST /v1/chat/completions``: messages rendered by the model's chat template, then served
like a completion. The tokenizer's own template is rendered in the API process (sandboxed jinja,
by the tokenizer); a template sent with the request is refused unless the operator allowed it
(``--trust-request-chat-template``), and is then rendered in a worker process under a time and
an output-size bound (:mod:`.chat_template`). Any failure to render or tokenize the
conversation is the request's: a 400.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from roofline.entrypoints.chat_tools import tool_sampling_params
from roofline.entrypoints.openai.chat_output import ChoiceParser, tool_call_id
from roofline.entrypoints.openai.chat_template import TemplateRenderer
from roofline.entrypoints.openai.errors import OpenAIError, from_exception
from roofline.entrypoints.openai.grammar_check import check_constraint
from roofline.entrypoints.openai.guards import ClientWatch, check_text, refuse_legacy_functions
from roofline.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    random_id,
)
from roofline.entrypoints.openai.reasoning import get_reasoning_parser
from roofline.entrypoints.openai.serving_base import (
    ChunkFormat,
    Delta,
    DeltaTracker,
    ServingState,
    add_requests,
    collect,
    ranked,
    sse_stream,
    token_strings,
    usage_of,
)
from roofline.entrypoints.openai.tools import (
    ToolError,
    ToolPlan,
    plan_tools,
    render_messages,
    template_reads_tools,
)
from roofline.outputs import RequestOutput
from roofline.sampling_params import SamplingParams


def _encode(tokenizer: Any, text: str) -> list[int]:
    """The rendered conversation's token ids (it already holds its special tokens)."""
    if not isinstance(text, str) or not text:
        raise ValueError("the chat template rendered an empty prompt")
    if not text.isascii():
        text.encode("utf-8")  # a lone surrogate made by the template: UnicodeEncodeError
    if tokenizer is None:
        raise ValueError("this model has no tokenizer")
    return list(tokenizer(text, add_special_tokens=False).input_ids)


async def render_prompt(
    state: ServingState, body: ChatCompletionRequest, plan: ToolPlan | None = None
) -> list[int]:
    """The conversation as prompt token ids, exactly as ``LLM.chat`` builds them (with the
    API process's copy of the tokenizer); tools and tool messages as :mod:`.tools` renders
    them."""
    messages = body.message_dicts()
    add_gen = body.add_generation_prompt
    engine = state.engine
    template = body.chat_template or getattr(engine.tokenizer, "chat_template", None)
    native = template_reads_tools(template if isinstance(template, str) else None)
    tools = plan.template_tools() if plan is not None and native else None
    if plan is not None or any(m["role"] == "tool" or "tool_calls" in m for m in messages):
        messages = render_messages(messages, plan, native)
    try:
        if body.chat_template is None and tools is None:
            return _encode(engine.tokenizer, engine.apply_chat_template(messages, add_gen))
        if body.chat_template is None:
            text = engine.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_gen
            )
            return _encode(engine.tokenizer, text)
        if not state.allow_request_chat_template:
            raise OpenAIError(
                400,
                "request-supplied chat templates are not allowed on this server",
                param="chat_template",
            )
        tok = engine.tokenizer
        special = {
            "bos_token": getattr(tok, "bos_token", None),
            "eos_token": getattr(tok, "eos_token", None),
            "tools": tools,
        }
        if state.template_renderer is None:
            state.template_renderer = TemplateRenderer()
        context = {"messages": messages, "add_generation_prompt": add_gen, **special}
        text = await state.template_renderer.render(body.chat_template, context)
        return _encode(tok, text)
    except OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001 - rendering the request's messages: its error
        raise OpenAIError(
            400,
            f"cannot apply the chat template: {type(e).__name__}: {e}",
            param="chat_template" if body.chat_template is not None else "messages",
            code="invalid_messages",
        ) from e


def _logprobs(delta: Delta, k: int, names: dict[int, str]) -> dict[str, list] | None:
    if delta.logprobs is None:
        return None
    content = []
    for tid, step in zip(delta.token_ids, delta.logprobs, strict=False):
        (text, logprob), top = ranked(step, tid, k, names)
        content.append(
            {
                "token": text,
                "logprob": -9999.0 if logprob is None else logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top
                ],
            }
        )
    return {"content": content}


async def create_chat_completion(
    state: ServingState, body: ChatCompletionRequest, raw: Request
) -> Any:
    check_text(body)
    state.check_request(body.model)
    refuse_legacy_functions(body)
    watch = ClientWatch(raw)
    try:
        return await _create_chat_completion(state, body, watch)
    finally:
        watch.stop()


async def _create_chat_completion(
    state: ServingState, body: ChatCompletionRequest, watch: ClientWatch
) -> Any:
    try:
        params = body.to_sampling_params()
    except ValueError as e:
        raise from_exception(e) from e
    try:
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ToolError as e:
        raise OpenAIError(400, str(e), param=e.param, code="invalid_value") from e
    params, make_parser = _output_parsing(state, plan, params)
    await watch.guard(check_constraint(state, params.structured_outputs))
    prompt = await watch.guard(render_prompt(state, body, plan))
    request_id = random_id("chatcmpl")
    streams = await watch.guard(
        add_requests(state, [prompt], params, request_id, body.priority, "messages", body.stream)
    )
    created = int(time.time())
    k = params.logprobs or 0
    tracker = DeltaTracker(params.n)

    if not body.stream:
        finals = await collect(state, watch, streams)
        deltas = tracker.deltas(0, finals[0])
        names = token_strings(state, deltas)
        choices = [
            ChatChoice(
                index=d.index,
                message=_message(d.text, make_parser),
                logprobs=_logprobs(d, k, names),
                finish_reason=d.finish_reason,
                stop_reason=d.stop_reason,
            )
            for d in sorted(deltas, key=lambda d: d.index)
        ]
        for choice in choices:
            if choice.message.tool_calls and choice.finish_reason == "stop":
                choice.finish_reason = "tool_calls"
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=state.served_model_name,
            choices=choices,
            usage=usage_of(finals),
        )

    fmt = ChunkFormat(
        request_id,
        "chat.completion.chunk",
        created,
        state.served_model_name,
        tracker,
        len(prompt),
        body.include_usage,
        body.continuous_usage,
    )

    parsers: dict[int, ChoiceParser] = {}

    def render(i: int, output: RequestOutput) -> str:
        deltas = tracker.deltas(i, output)
        names = token_strings(state, deltas)
        events = []
        for d in deltas:
            finish_reason = d.finish_reason
            if make_parser is None:
                message: dict[str, Any] = {"content": d.text}
            else:
                parser = parsers.get(d.index)
                if parser is None:
                    parser = parsers[d.index] = make_parser()
                message = parser.delta(d.text, final=finish_reason is not None)
                if not message and finish_reason is None and not d.first and d.logprobs is None:
                    continue
                if parser.called_tools and finish_reason == "stop":
                    finish_reason = "tool_calls"
            if d.first:
                message["role"] = "assistant"
            choice = {
                "index": d.index,
                "delta": message,
                "logprobs": _logprobs(d, k, names),
                "finish_reason": finish_reason,
                "stop_reason": d.stop_reason,
            }
            events.append(fmt.event([choice]))
        return "".join(events)

    return StreamingResponse(
        sse_stream(state, streams, render, fmt.usage_event),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


def _output_parsing(
    state: ServingState, plan: ToolPlan | None, params: SamplingParams
) -> tuple[SamplingParams, Callable[[], ChoiceParser] | None]:
    """The sampling parameters with the tool constraint added, and how each choice's text is
    read (None: plain content, the fast path)."""
    try:
        reasoning = get_reasoning_parser(state.reasoning_parser)
    except ValueError as e:
        raise OpenAIError(500, str(e)) from e
    if plan is None:
        if reasoning is None:
            return params, None
        return params, lambda: ChoiceParser(reasoning_parser=reasoning)
    template = getattr(state.engine.tokenizer, "chat_template", None)
    try:
        return tool_sampling_params(
            plan,
            params,
            state.tool_call_parser,
            template if isinstance(template, str) else None,
            reasoning,
        )
    except ToolError as e:
        raise OpenAIError(400, str(e), param=e.param) from e


def _message(text: str, make_parser: Callable[[], ChoiceParser] | None) -> AssistantMessage:
    if make_parser is None:
        return AssistantMessage(content=text)
    parsed = make_parser().parse(text)
    calls = [
        {"id": tool_call_id(), "type": "function", "function": {"name": n, "arguments": a}}
        for n, a in parsed.calls
    ]
    return AssistantMessage(
        content=parsed.content, reasoning_content=parsed.reasoning, tool_calls=calls
    )
