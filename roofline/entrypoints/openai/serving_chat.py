"""``POST /v1/chat/completions``: messages rendered by the model's chat template, then served
like a completion. The tokenizer's own template is rendered by the engine (sandboxed jinja);
a template sent with the request is refused unless the operator allowed it
(``--trust-request-chat-template``), and is then rendered here in an immutable jinja sandbox
off the event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import StreamingResponse
from jinja2.sandbox import ImmutableSandboxedEnvironment

from roofline.entrypoints.openai.errors import OpenAIError, from_exception
from roofline.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    TokenLogprob,
    TopLogprob,
    random_id,
)
from roofline.entrypoints.openai.serving_base import (
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
from roofline.outputs import RequestOutput


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def render_template(
    template: str,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    special: dict[str, str | None],
) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special
    )


def _encode(engine: Any, text: str) -> list[int]:
    """The rendered conversation's token ids (it already holds its special tokens)."""
    if not isinstance(text, str) or not text:
        raise ValueError("the chat template rendered an empty prompt")
    return list(engine.tokenizer(text, add_special_tokens=False).input_ids)


async def render_prompt(state: ServingState, body: ChatCompletionRequest) -> list[int]:
    """The conversation as prompt token ids, exactly as ``LLM.chat`` builds them."""
    messages = body.message_dicts()
    add_gen = body.add_generation_prompt
    try:
        if body.chat_template is None:
            return await state.engine.run_in_engine(
                lambda e: _encode(e, e.apply_chat_template(messages, add_gen))
            )
        else:
            if not state.allow_request_chat_template:
                raise OpenAIError(
                    400,
                    "request-supplied chat templates are not allowed on this server",
                    param="chat_template",
                )

            def special(e: Any) -> dict[str, str | None]:
                tok = e.tokenizer
                return {
                    "bos_token": getattr(tok, "bos_token", None),
                    "eos_token": getattr(tok, "eos_token", None),
                }

            tokens = await state.engine.run_in_engine(special)
            text = await asyncio.to_thread(
                render_template, body.chat_template, messages, add_gen, tokens
            )
            return await state.engine.run_in_engine(lambda e: _encode(e, text))
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise OpenAIError(
            400, f"cannot apply the chat template: {e}", param="messages", code="invalid_messages"
        ) from e


def _logprobs(delta: Delta, k: int, names: dict[int, str]) -> ChatLogprobs | None:
    if delta.logprobs is None:
        return None
    content = []
    for tid, step in zip(delta.token_ids, delta.logprobs, strict=False):
        (text, logprob), top = ranked(step, tid, k, names)
        content.append(
            TokenLogprob(
                token=text,
                logprob=-9999.0 if logprob is None else logprob,
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in top
                ],
            )
        )
    return ChatLogprobs(content=content)


async def create_chat_completion(
    state: ServingState, body: ChatCompletionRequest, raw: Request
) -> Any:
    state.check_model(body.model)
    try:
        params = body.to_sampling_params()
    except ValueError as e:
        raise from_exception(e) from e
    prompt = await render_prompt(state, body)
    request_id = random_id("chatcmpl")
    streams = await add_requests(state, [prompt], params, request_id, body.priority, "messages")
    created = int(time.time())
    k = params.logprobs or 0

    if not body.stream:
        finals = await collect(state, raw, streams)
        deltas = DeltaTracker(params.n).deltas(0, finals[0])
        names = await token_strings(state, deltas)
        choices = [
            ChatChoice(
                index=d.index,
                message=AssistantMessage(content=d.text),
                logprobs=_logprobs(d, k, names),
                finish_reason=d.finish_reason,
                stop_reason=d.stop_reason,
            )
            for d in sorted(deltas, key=lambda d: d.index)
        ]
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=state.served_model_name,
            choices=choices,
            usage=usage_of(finals),
        )

    tracker = DeltaTracker(params.n)
    include_usage = body.include_usage

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        c: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.served_model_name,
            "choices": choices,
        }
        if include_usage:
            c["usage"] = None
        return c

    async def render(i: int, output: RequestOutput) -> list[dict[str, Any]]:
        deltas = tracker.deltas(i, output)
        names = await token_strings(state, deltas)
        chunks = []
        for d in deltas:
            message: dict[str, Any] = {"content": d.text}
            if d.first:
                message["role"] = "assistant"
            lp = _logprobs(d, k, names)
            chunks.append(
                chunk(
                    [
                        {
                            "index": d.index,
                            "delta": message,
                            "logprobs": None if lp is None else lp.model_dump(),
                            "finish_reason": d.finish_reason,
                            "stop_reason": d.stop_reason,
                        }
                    ]
                )
            )
        return chunks

    def final(finals: list[RequestOutput]) -> list[dict[str, Any]]:
        if not include_usage:
            return []
        c = chunk([])
        c["usage"] = usage_of(finals).model_dump()
        return [c]

    return StreamingResponse(
        sse_stream(state, streams, render, final),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )
