"""``POST /v1/chat/completions``: messages rendered by the model's chat template, then served
like a completion. The tokenizer's own template is rendered in the API process (sandboxed jinja,
by the tokenizer); a template sent with the request is refused unless the operator allowed it
(``--trust-request-chat-template``), and is then rendered in a worker process under a time and
an output-size bound (:mod:`.chat_template`). Any failure to render or tokenize the
conversation is the request's: a 400.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from roofline.entrypoints.openai.chat_template import TemplateRenderer
from roofline.entrypoints.openai.errors import OpenAIError, from_exception
from roofline.entrypoints.openai.guards import ClientWatch, check_text, refuse_legacy_functions
from roofline.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    random_id,
)
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
from roofline.outputs import RequestOutput


def _encode(tokenizer: Any, text: str) -> list[int]:
    """The rendered conversation's token ids (it already holds its special tokens)."""
    if not isinstance(text, str) or not text:
        raise ValueError("the chat template rendered an empty prompt")
    if not text.isascii():
        text.encode("utf-8")  # a lone surrogate made by the template: UnicodeEncodeError
    if tokenizer is None:
        raise ValueError("this model has no tokenizer")
    return list(tokenizer(text, add_special_tokens=False).input_ids)


async def render_prompt(state: ServingState, body: ChatCompletionRequest) -> list[int]:
    """The conversation as prompt token ids, exactly as ``LLM.chat`` builds them (with the
    API process's copy of the tokenizer)."""
    messages = body.message_dicts()
    add_gen = body.add_generation_prompt
    engine = state.engine
    try:
        if body.chat_template is None:
            return _encode(engine.tokenizer, engine.apply_chat_template(messages, add_gen))
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
    prompt = await watch.guard(render_prompt(state, body))
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

    def render(i: int, output: RequestOutput) -> str:
        deltas = tracker.deltas(i, output)
        names = token_strings(state, deltas)
        events = []
        for d in deltas:
            message: dict[str, Any] = {"content": d.text}
            if d.first:
                message["role"] = "assistant"
            choice = {
                "index": d.index,
                "delta": message,
                "logprobs": _logprobs(d, k, names),
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
            }
            events.append(fmt.event([choice]))
        return "".join(events)

    return StreamingResponse(
        sse_stream(state, streams, render, fmt.usage_event),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )
